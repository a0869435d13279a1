"""Full-size configs of SD 3.5 large and medium and SD3 medium (stabilityai/stable-diffusion-3.5-large,
-3.5-medium, -3-medium-diffusers): see :mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import CLIP_G, CLIP_L, SD3_VAE, T5_MAX_LENGTH, T5_XXL

_COMMON = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "attention_head_dim": 64,
           "joint_attention_dim": 4096, "pooled_projection_dim": 2048}
_TRANSFORMERS = {
    "sd3.5-large": {**_COMMON, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                    "pos_embed_max_size": 192, "qk_norm": "rms_norm", "dual_attention_layers": []},
    "sd3.5-medium": {**_COMMON, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                     "pos_embed_max_size": 384, "qk_norm": "rms_norm", "dual_attention_layers": list(range(13))},
    "sd3-medium": {**_COMMON, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                   "pos_embed_max_size": 192, "qk_norm": None, "dual_attention_layers": []},
}

FULL_SIZE = {variant: {"tiny": "tiny-sd3",
                       "configs": {"transformer": transformer, "vae": SD3_VAE, "text_encoder": CLIP_L,
                                   "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL},
                       "max_length": {"tokenizer_3": T5_MAX_LENGTH}}
             for variant, transformer in _TRANSFORMERS.items()}
