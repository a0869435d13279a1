"""Claim Stable Cascade stage C weights: the original single file (``stage_c.safetensors``,
``stage_c_lite.safetensors``, or ComfyUI's checkpoint with the text encoder), a diffusers prior or combined
pipeline folder or hub repo. The decoder (stage B) given as the model is refused, naming what to do."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.common.cascade_keys import is_lite, is_stage_b, is_stage_c, strip_prefix

PRIORS = ("StableCascadePriorPipeline", "StableCascadeCombinedPipeline")
STAGE_B = ("the Stable Cascade decoder (stage B), which turns the prior's output into pictures and is not what a "
           "Stable Cascade LoRA or fine-tune trains. Set model.path to the stage C prior (e.g. "
           "stabilityai/stable-cascade-prior, or stage_c.safetensors / stage_c_lite.safetensors) and model.decoder_path "
           "to this")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = strip_prefix(ev.shapes)
        if is_stage_b(shapes):
            raise ValueError(f"it holds {STAGE_B}")
        if is_stage_c(shapes):
            return "stable-cascade-lite" if is_lite(shapes) else "stable-cascade"
        return None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in PRIORS:
        return "stable-cascade"
    if name == "StableCascadeDecoderPipeline":
        raise ValueError(f"it is {STAGE_B}")
    prior = ev.json("prior/config.json")
    if prior and prior.get("_class_name") == "StableCascadeUNet" and not prior.get("effnet_in_channels"):
        return "stable-cascade"
    return None
