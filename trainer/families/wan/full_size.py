"""Full-size configs of Wan 2.1 T2V 1.3B and 14B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B-Diffusers), Wan 2.1 I2V 14B
(Wan-AI/Wan2.1-I2V-14B-480P-Diffusers), Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers) and Wan 2.2 T2V/I2V A14B
(Wan-AI/Wan2.2-T2V-A14B-Diffusers, -I2V-A14B-Diffusers): see :mod:`trainer.families.common.full_size`. The 14B Wan 2.1
T2V is one variant with the 1.3B (``wan21-t2v``); its configs are under ``wan21-t2v-14b``, which the family picks for a
hub id that names 14B."""

from trainer.families.common.full_size import T5_MAX_LENGTH
from trainer.families.wan.keys import CONFIG_13B, CONFIG_14B, CONFIG_14B_I2V, CONFIG_A14B_I2V

# google/umt5-xxl encoder (Wan-AI's text_encoder/config.json)
UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
            "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06,
            "tie_word_embeddings": False}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json (every Wan 2.1 model's VAE; latents_mean/std are the defaults)
WAN21_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [False, True, True], "dropout": 0.0}

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json
TRANSFORMER_22_5B = dict({k: v for k, v in CONFIG_13B.items() if k != "_class_name"}, num_attention_heads=24,
                         in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30)
# its vae/config.json: the 2.2 VAE (residual, pixels patchified 2×2, 16× in space, 48 channels); the latent statistics
# (48 values each) only scale the latents and stay the tiny model's in a config used for memory estimates
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
             "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
             "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
             "scale_factor_temporal": 4}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts with Wan 2.1 14B's transformer config (dim 5120 = 40 heads × 128,
# 40 layers, FFN 13824), the 2.1 VAE; Wan-AI/Wan2.1-T2V-14B-Diffusers has the same transformer
TRANSFORMER_14B = {k: v for k, v in CONFIG_14B.items() if k != "_class_name"}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: in_dim 36, CLIP image features (image_dim 1280, added_kv_proj_dim 5120)
TRANSFORMER_14B_I2V = {k: v for k, v in CONFIG_14B_I2V.items() if k != "_class_name"}
# Wan-AI/Wan2.2-I2V-A14B-Diffusers: each expert in_dim 36, no image features
TRANSFORMER_A14B_I2V = {k: v for k, v in CONFIG_A14B_I2V.items() if k != "_class_name"}
# its image_encoder/config.json: CLIP ViT-H/14's vision tower (open-clip xlm-roberta-large-vit-huge-14)
CLIP_VIT_H14 = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                "image_size": 224, "patch_size": 14, "projection_dim": 1024, "hidden_act": "gelu",
                "layer_norm_eps": 1e-05}
# its image_processor/preprocessor_config.json: 224 px (short side, then a centre crop)
CLIP_224 = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}

FULL_SIZE = {"wan21-t2v-14b": {
    "tiny": "tiny-wan21",
    "configs": {"transformer": TRANSFORMER_14B, "vae": WAN21_VAE, "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}, "wan21-i2v": {
    "tiny": "tiny-wan21-i2v",
    "configs": {"transformer": TRANSFORMER_14B_I2V, "vae": WAN21_VAE, "text_encoder": UMT5_XXL,
                "image_encoder": CLIP_VIT_H14, "image_processor": CLIP_224},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}, "wan22-i2v-a14b": {
    "tiny": "tiny-wan22-i2v-a14b",
    "configs": {"transformer": TRANSFORMER_A14B_I2V, "transformer_2": TRANSFORMER_A14B_I2V, "vae": WAN21_VAE,
                "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}, "wan22-t2v-a14b": {
    "tiny": "tiny-wan22-a14b",
    "configs": {"transformer": TRANSFORMER_14B, "transformer_2": TRANSFORMER_14B, "vae": WAN21_VAE,
                "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}, "wan22-ti2v-5b": {
    "tiny": "tiny-wan22-5b",
    "configs": {"transformer": TRANSFORMER_22_5B, "vae": WAN22_VAE, "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}, "wan21-t2v": {
    "tiny": "tiny-wan21",
    "configs": {"transformer": {k: v for k, v in CONFIG_13B.items() if k != "_class_name"},
                "vae": WAN21_VAE, "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}}
