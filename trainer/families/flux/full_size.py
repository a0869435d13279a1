"""Full-size configs of Flux.1 dev and schnell (black-forest-labs/FLUX.1-dev, FLUX.1-schnell) and FLUX.1 Kontext
[dev] (black-forest-labs/FLUX.1-Kontext-dev: dev's transformer, VAE and text encoders under FluxKontextPipeline):
see :mod:`trainer.families.common.full_size`."""

import json
from pathlib import Path

from trainer.families.common.full_size import CLIP_L, FLUX_VAE, T5_MAX_LENGTH, T5_XXL

_CONFIGS = Path(__file__).parent / "configs"


def _spec(variant: str, tiny: str = "tiny-flux") -> dict:
    transformer = json.loads((_CONFIGS / variant / "transformer" / "config.json").read_text(encoding="utf-8"))
    return {"tiny": tiny,
            "configs": {"transformer": {k: v for k, v in transformer.items() if not k.startswith("_")},
                        "vae": FLUX_VAE, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
            "max_length": {"tokenizer_2": T5_MAX_LENGTH}}


# the tiny model gives the pipeline's layout (its model_index.json names the pipeline class)
FULL_SIZE = {"flux-dev": _spec("flux-dev"), "flux-schnell": _spec("flux-schnell"),
             "flux-kontext": _spec("flux-kontext", "tiny-flux-kontext")}
