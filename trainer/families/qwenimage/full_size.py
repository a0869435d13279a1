"""Full-size configs of Qwen-Image (Qwen/Qwen-Image): see :mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import QWEN25_VL_7B, QWEN_MAX_LENGTH

FULL_SIZE = {"qwen-image": {
    "tiny": "tiny-qwen-image",
    "configs": {"transformer": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                                "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
                "vae": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                        "temperal_downsample": [False, True, True], "dropout": 0.0},
                "text_encoder": QWEN25_VL_7B},
    "max_length": {"tokenizer": QWEN_MAX_LENGTH},
}}
