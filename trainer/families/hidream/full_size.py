"""Full-size configs of HiDream-I1 (full, dev and fast share them): see :mod:`trainer.families.common.full_size`. The
transformer is the published 17B MoE config (``keys.CONFIG``); the text encoders are HiDream's long-context CLIP-L/G
(248 positions), google/t5-v1_1-xxl's encoder and meta-llama/Llama-3.1-8B-Instruct."""

from trainer.families.common.full_size import CLIP_G, CLIP_L, FLUX_VAE, T5_MAX_LENGTH, T5_XXL
from trainer.families.hidream.keys import CONFIG

# HiDream-ai/HiDream-I1-Full text_encoder / text_encoder_2: CLIP-L and CLIP-G with projection, 248 positions
CLIP_L_LONG = {**CLIP_L, "max_position_embeddings": 248}
CLIP_G_LONG = {**CLIP_G, "max_position_embeddings": 248}
# meta-llama/Llama-3.1-8B-Instruct config.json
LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "head_dim": 128,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192}}

FULL_SIZE = {name: {
    "tiny": "tiny-hidream",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"}, "vae": FLUX_VAE,
                "text_encoder": CLIP_L_LONG, "text_encoder_2": CLIP_G_LONG, "text_encoder_3": T5_XXL,
                "text_encoder_4": LLAMA_31_8B},
    "max_length": {"tokenizer_3": T5_MAX_LENGTH, "tokenizer_4": 131072},
} for name in ("hidream-full", "hidream-dev", "hidream-fast")}
