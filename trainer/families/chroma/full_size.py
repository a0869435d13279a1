"""Full-size configs of Chroma (lodestones/Chroma1-HD): see :mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import FLUX_VAE, T5_MAX_LENGTH, T5_XXL

FULL_SIZE = {"chroma": {
    "tiny": "tiny-chroma",
    "configs": {"transformer": {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19,
                                "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
                                "joint_attention_dim": 4096, "axes_dims_rope": [16, 56, 56],
                                "approximator_num_channels": 64, "approximator_hidden_dim": 5120,
                                "approximator_layers": 5},
                "vae": FLUX_VAE, "text_encoder": T5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}}
