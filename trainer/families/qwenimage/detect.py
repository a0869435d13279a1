"""Claim Qwen-Image weights: the transformer as one file (diffusers' names, as ComfyUI's qwen_image files have them,
optionally ``model.diffusion_model.``-prefixed), a diffusers ``QwenImagePipeline`` folder or hub repo. The edit,
layered and ControlNet pipelines take other inputs and are refused."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        ok = "transformer_blocks.0.img_mod.1.weight" in keys and "txt_norm.weight" in keys and "img_in.weight" in keys
        return "qwen-image" if ok else None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name.startswith("QwenImage") and name != "QwenImagePipeline":
        raise ValueError(f"{ev.where} is a {name}, which takes other inputs than text; Atelier trains the text-to-image "
                         "Qwen-Image model. Point model.path at a QwenImagePipeline (e.g. Qwen/Qwen-Image)")
    if name == "QwenImagePipeline":
        return "qwen-image"
    transformer = ev.json("transformer/config.json")
    return "qwen-image" if transformer and transformer.get("_class_name") == "QwenImageTransformer2DModel" else None
