"""Full-size configs of Lumina 2 (Alpha-VLLM/Lumina-Image-2.0; Neta-Lumina is the same model): see
:mod:`trainer.families.common.full_size`. The transformer is the published 2.6B config (``keys.CONFIG``); Gemma-2-2B
is google/gemma-2-2b's config.json (2.6B with its tied embedding)."""

from trainer.families.common.full_size import FLUX_VAE, GEMMA2_2B
from trainer.families.lumina2.keys import CONFIG

FULL_SIZE = {"lumina2": {
    "tiny": "tiny-lumina2",
    "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"}, "vae": FLUX_VAE,
                "text_encoder": GEMMA2_2B},
    "max_length": {"tokenizer": 8192},
}}
