"""Claim HiDream-I1 weights: the original single file (dual- and single-stream blocks with MoE feed-forwards,
``double_stream_blocks.0.block.adaLN_modulation.1``, with or without ComfyUI's ``model.diffusion_model.``), a
diffusers ``HiDreamImagePipeline`` folder or hub repo. Which of full, dev and fast: the repo's name where it says,
else its scheduler (full samples with UniPC, dev and fast with flow-matching Euler at shift 6 and 3), else full.
HiDream-E1 (the editing model) is refused by name."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

MARKER = "double_stream_blocks.0.block.adaLN_modulation.1.weight"
NAMES = {"i1-dev": "hidream-dev", "i1-fast": "hidream-fast", "i1-full": "hidream-full"}


def variant_of(where: str, scheduler: Optional[dict]) -> str:
    """full / dev / fast from a name (``HiDream-ai/HiDream-I1-Dev``) or the scheduler config."""
    low = where.lower()
    for marker, variant in NAMES.items():
        if marker in low:
            return variant
    if scheduler and scheduler.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
        return "hidream-dev" if float(scheduler.get("shift", 3.0)) >= 5.0 else "hidream-fast"
    return "hidream-full"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
        if MARKER not in shapes or "caption_projection.0.linear.weight" not in shapes:
            return None
        return variant_of(ev.where, None)
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    transformer = ev.json("transformer/config.json")
    ours = name == "HiDreamImagePipeline" or bool(
        transformer and transformer.get("_class_name") == "HiDreamImageTransformer2DModel")
    if name.startswith("HiDream") and name != "HiDreamImagePipeline":
        raise ValueError(f"{ev.where} is a {name} (HiDream-E1, the editing model): Atelier trains the text-to-image "
                         "HiDream-I1. Point model.path at a HiDreamImagePipeline (e.g. HiDream-ai/HiDream-I1-Dev)")
    if not ours:
        return None
    return variant_of(ev.where, ev.json("scheduler/scheduler_config.json"))
