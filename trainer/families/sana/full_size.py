"""Full-size configs of Sana (Efficient-Large-Model/Sana_1600M_1024px_diffusers): see
:mod:`trainer.families.common.full_size`. The transformer is the published 1.6B config (``keys.CONFIG``; Sana 1.5
1.6B is the same with q/k norms), the VAE mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers' config (as diffusers'
``scripts/convert_dcae_to_diffusers.py`` writes it), the text encoder gemma-2-2b-it (google/gemma-2-2b's
architecture, as Lumina 2's)."""

from trainer.families.common.full_size import GEMMA2_2B
from trainer.families.sana.keys import CONFIG

# mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers vae/config.json: 32× compression, 32 latent channels
DC_AE_F32C32 = {"latent_channels": 32, "attention_head_dim": 32,
                "encoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
                "decoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
                "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
                "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
                "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
                "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
                "encoder_layers_per_block": [2, 2, 2, 3, 3, 3], "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
                "downsample_block_type": "conv", "upsample_block_type": "interpolate",
                "decoder_norm_types": "rms_norm", "decoder_act_fns": "silu", "scaling_factor": 0.41407}

FULL_SIZE = {"sana": {
    "tiny": "tiny-sana",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"} | {"qk_norm": None},
                "vae": DC_AE_F32C32, "text_encoder": GEMMA2_2B},
    "max_length": {"tokenizer": 8192},
}}
