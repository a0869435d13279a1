"""Full-size configs of Ideogram 4 (ideogram-ai/ideogram-v4): see :mod:`trainer.families.common.full_size`. Both
transformers are ``Ideogram4Transformer2DModel``'s defaults (the released model, keys.CONFIG); the VAE is Flux.2's
(black-forest-labs/FLUX.2-klein-4B vae/config.json); the text encoder is Qwen/Qwen3-VL-8B-Instruct's config.json
(its vision tower included, as the pipeline loads the model; 36 layers of 4096, of which the pipeline reads 13)."""

from trainer.families.common.full_size import QWEN_MAX_LENGTH
from trainer.families.ideogram4.keys import CONFIG

TRANSFORMER = {k: v for k, v in CONFIG.items() if k != "_class_name"}
FLUX2_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 32,
             "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": True, "use_post_quant_conv": True,
             "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}
QWEN3_VL_8B = {
    "text_config": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
}

FULL_SIZE = {"ideogram4": {
    "tiny": "tiny-ideogram4",
    "configs": {"transformer": TRANSFORMER, "unconditional_transformer": TRANSFORMER, "vae": FLUX2_VAE,
                "text_encoder": QWEN3_VL_8B},
    "max_length": {"tokenizer": QWEN_MAX_LENGTH},
}}
