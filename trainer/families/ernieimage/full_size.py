"""Full-size configs of ERNIE-Image (baidu/ERNIE-Image, 8B): see :mod:`trainer.families.common.full_size`. The
transformer is the released config (``keys.CONFIG``, ComfyUI's ``ErnieImageModel`` defaults); the VAE is Flux.2's
(black-forest-labs/FLUX.2-klein-4B vae/config.json); the text model is Ministral 3 3B (the release's ``pe/config.json``
gives its text sizes: 26 layers of 3072) with a Pixtral vision tower of Mistral Small 3.1's size, which the pipeline
loads but the text path never runs."""

from trainer.families.ernieimage.keys import CONFIG

FLUX2_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 32,
             "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": True, "use_post_quant_conv": True,
             "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}
MINISTRAL3_3B = {
    "text_config": {"vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-05, "tie_word_embeddings": True},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14,
                      "rope_theta": 10000.0},
    "spatial_merge_size": 2, "image_token_index": 10, "multimodal_projector_bias": False}

FULL_SIZE = {"ernie-image": {
    "tiny": "tiny-ernie-image",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"}, "vae": FLUX2_VAE,
                "text_encoder": MINISTRAL3_3B},
    "max_length": {"tokenizer": 262144},
}}
