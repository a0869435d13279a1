"""Full-size configs of Flux.1 dev and schnell (black-forest-labs/FLUX.1-dev, FLUX.1-schnell): see
:mod:`trainer.families.common.full_size`."""

import json
from pathlib import Path

from trainer.families.common.full_size import CLIP_L, FLUX_VAE, T5_MAX_LENGTH, T5_XXL

_CONFIGS = Path(__file__).parent / "configs"


def _spec(variant: str) -> dict:
    transformer = json.loads((_CONFIGS / variant / "transformer" / "config.json").read_text(encoding="utf-8"))
    return {"tiny": "tiny-flux",
            "configs": {"transformer": {k: v for k, v in transformer.items() if not k.startswith("_")},
                        "vae": FLUX_VAE, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
            "max_length": {"tokenizer_2": T5_MAX_LENGTH}}


FULL_SIZE = {"flux-dev": _spec("flux-dev"), "flux-schnell": _spec("flux-schnell")}
