"""Claim Würstchen 2 prior weights: a diffusers ``WuerstchenPriorPipeline`` (or combined) folder or hub repo,
or the prior alone as one file (diffusers or original layout). Its decoder given as the model is refused."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.common.cascade_keys import is_wuerstchen_prior, strip_prefix

PRIORS = ("WuerstchenPriorPipeline", "WuerstchenCombinedPipeline")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        return "wuerstchen-2" if is_wuerstchen_prior(strip_prefix(ev.shapes)) else None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in PRIORS:
        return "wuerstchen-2"
    if name == "WuerstchenDecoderPipeline":
        raise ValueError("it is the Würstchen 2 decoder, which turns the prior's output into pictures and is not what "
                         "a Würstchen LoRA or fine-tune trains. Set model.path to the prior (e.g. warp-ai/wuerstchen-prior) "
                         "and model.decoder_path to this")
    prior = ev.json("prior/config.json")
    if prior and prior.get("_class_name") == "WuerstchenPrior":
        return "wuerstchen-2"
    return None
