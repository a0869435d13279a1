"""Claim Z-Image weights: the original single file (NextDiT layers with fused ``attention.qkv``, noise and context
refiners, a caption embedder over Qwen3 features), a diffusers ``ZImagePipeline`` folder or hub repo. Lumina-Image
2.0 has the same layout over Gemma-2 features (2304 wide): it is not claimed."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

LUMINA2_CAPTION_WIDTH = 2304


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
        cap = shapes.get("cap_embedder.1.weight")
        if "layers.0.attention.qkv.weight" not in shapes or "noise_refiner.0.attention.qkv.weight" not in shapes \
                or cap is None or len(cap) != 2 or int(cap[1]) == LUMINA2_CAPTION_WIDTH:
            return None
        return "z-image"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name.startswith("ZImage") and name != "ZImagePipeline":
        raise ValueError(f"{ev.where} is a {name}: Atelier trains the text-to-image Z-Image model. Point model.path at "
                         "a ZImagePipeline (e.g. Tongyi-MAI/Z-Image-Turbo)")
    if name == "ZImagePipeline":
        return "z-image"
    transformer = ev.json("transformer/config.json")
    return "z-image" if transformer and transformer.get("_class_name") == "ZImageTransformer2DModel" else None
