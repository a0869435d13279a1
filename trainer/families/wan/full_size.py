"""Full-size configs of Wan 2.1 T2V (Wan-AI/Wan2.1-T2V-1.3B-Diffusers; the 14B differs in its transformer): see
:mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import T5_MAX_LENGTH
from trainer.families.wan.keys import CONFIG_13B

# google/umt5-xxl encoder (Wan-AI's text_encoder/config.json)
UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
            "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06,
            "tie_word_embeddings": False}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json (every Wan 2.1 model's VAE; latents_mean/std are the defaults)
WAN21_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [False, True, True], "dropout": 0.0}

FULL_SIZE = {"wan21-t2v": {
    "tiny": "tiny-wan21",
    "configs": {"transformer": {k: v for k, v in CONFIG_13B.items() if k != "_class_name"},
                "vae": WAN21_VAE, "text_encoder": UMT5_XXL},
    "max_length": {"tokenizer": T5_MAX_LENGTH},
}}
