"""Claim Chroma weights: the original single file (Flux's BFL layout without modulation layers, with the
``distilled_guidance_layer`` approximator; optionally ``model.diffusion_model.``-prefixed), a diffusers
``ChromaPipeline`` folder or hub repo. Its img2img/inpainting pipelines are the same model."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINES = ("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        ok = "double_blocks.0.img_attn.qkv.weight" in keys and "distilled_guidance_layer.in_proj.weight" in keys
        return "chroma" if ok else None
    index = ev.json("model_index.json") or {}
    if str(index.get("_class_name", "") or "") in PIPELINES:
        return "chroma"
    transformer = ev.json("transformer/config.json")
    return "chroma" if transformer and transformer.get("_class_name") == "ChromaTransformer2DModel" else None
