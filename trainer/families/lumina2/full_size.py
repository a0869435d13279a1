"""Full-size configs of Lumina 2 (Alpha-VLLM/Lumina-Image-2.0; Neta-Lumina is the same model): see
:mod:`trainer.families.common.full_size`. The transformer is the published 2.6B config (``keys.CONFIG``); Gemma-2-2B
is google/gemma-2-2b's config.json (2.6B with its tied embedding)."""

from trainer.families.common.full_size import FLUX_VAE
from trainer.families.lumina2.keys import CONFIG

# google/gemma-2-2b config.json
GEMMA2_2B = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-06, "sliding_window": 4096, "query_pre_attn_scalar": 256,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
             "layer_types": None}

FULL_SIZE = {"lumina2": {
    "tiny": "tiny-lumina2",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"}, "vae": FLUX_VAE,
                "text_encoder": GEMMA2_2B},
    "max_length": {"tokenizer": 8192},
}}
