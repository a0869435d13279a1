"""Full-size configs of Flux.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B): see
:mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import QWEN3_4B, QWEN_MAX_LENGTH

FULL_SIZE = {"flux2-klein": {
    "tiny": "tiny-flux2-klein",
    "configs": {"transformer": {"patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 5,
                                "num_single_layers": 20, "attention_head_dim": 128, "num_attention_heads": 24,
                                "joint_attention_dim": 7680, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
                                "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-06,
                                "guidance_embeds": False},
                "vae": {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 32,
                        "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": True, "use_post_quant_conv": True,
                        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4},
                "text_encoder": {**QWEN3_4B, "tie_word_embeddings": True}},
    "max_length": {"tokenizer": QWEN_MAX_LENGTH},
}}
