"""Full-size configs of Flux.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B) and Flux.2 [dev] (black-forest-labs/
FLUX.2-dev: a 32B transformer over Mistral Small 3.1, 24B): see :mod:`trainer.families.common.full_size`."""

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

_VAE = FULL_SIZE["flux2-klein"]["configs"]["vae"]
# mistralai/Mistral-Small-3.1-24B-Instruct-2503 (the text model and its Pixtral vision tower)
MISTRAL_SMALL_31 = {
    "text_config": {"vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 131072, "rope_theta": 1000000000.0, "rms_norm_eps": 1e-05,
                    "tie_word_embeddings": False},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                      "head_dim": 64, "image_size": 1540, "patch_size": 14, "rope_theta": 10000.0},
    "spatial_merge_size": 2, "image_token_index": 10, "multimodal_projector_bias": False, "tie_word_embeddings": False}
FULL_SIZE["flux2-dev"] = {
    "tiny": "tiny-flux2-dev",
    "configs": {"transformer": {**FULL_SIZE["flux2-klein"]["configs"]["transformer"], "num_layers": 8,
                                "num_single_layers": 48, "num_attention_heads": 48, "joint_attention_dim": 15360,
                                "guidance_embeds": True},
                "vae": _VAE, "text_encoder": MISTRAL_SMALL_31},
    "max_length": {"tokenizer": 131072},
}
