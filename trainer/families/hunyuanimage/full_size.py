"""Full-size configs of HunyuanImage 2.1 (hunyuanvideo-community/HunyuanImage-2.1-Diffusers): see
:mod:`trainer.families.common.full_size`. The transformer is the released config (``keys.CONFIG``: diffusers'
``scripts/convert_hunyuan_image_to_diffusers.py``, 17B); the VAE is that script's 32× config; Qwen2.5-VL-7B is
Qwen-Image's; the glyph encoder is ByT5-small's encoder (d_model 1472, the transformer's ``text_embed_2_dim``)."""

from trainer.families.common.full_size import QWEN25_VL_7B, QWEN_MAX_LENGTH
from trainer.families.hunyuanimage.keys import CONFIG

# diffusers scripts/convert_hunyuan_image_to_diffusers.py (huggingface/diffusers 58eb52c0): the base model's VAE
VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 64,
       "block_out_channels": [128, 256, 512, 512, 1024, 1024], "layers_per_block": 2, "spatial_compression_ratio": 32,
       "sample_size": 384, "scaling_factor": 0.75289,
       "downsample_match_channel": True, "upsample_match_channel": True}
# the glyph encoder: google/byt5-small's encoder with Glyph-SDXL-v2's added colour/font tokens (1510), as
# diffusion-pipe ships its config (configs/hunyuan_image/byt5-small/config.json, tdrussell/diffusion-pipe 8f83dbf)
BYT5_SMALL = {"d_model": 1472, "d_ff": 3584, "d_kv": 64, "num_heads": 6, "num_layers": 12, "num_decoder_layers": 4,
              "vocab_size": 1510, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_pytorch_tanh",
              "is_gated_act": True, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
              "layer_norm_epsilon": 1e-06}

FULL_SIZE = {"hunyuan-image": {
    "tiny": "tiny-hunyuan-image",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"}, "vae": VAE,
                "text_encoder": QWEN25_VL_7B, "text_encoder_2": BYT5_SMALL},
    "max_length": {"tokenizer": QWEN_MAX_LENGTH},
}}
