"""Claim ERNIE-Image weights from configs and key names only.

- A diffusers folder or hub repo: ``model_index.json``'s ``ErnieImagePipeline``, or an
  ``ErnieImageTransformer2DModel`` transformer config.
- One file: the original layout is diffusers' own module names (diffusers' single-file converter only strips
  ComfyUI's ``model.diffusion_model.``): the shared ``adaLN_modulation.1``, ``x_embedder.proj`` and the blocks'
  ``self_attention``/``adaLN_sa_ln``.
Another pipeline class of the family (an edit or image-to-image one) is refused by name."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINE = "ErnieImagePipeline"
MARKERS = ("x_embedder.proj.weight", "adaLN_modulation.1.weight", "layers.0.self_attention.to_q.weight",
           "layers.0.adaLN_sa_ln.weight", "final_linear.weight")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("model.diffusion_model.", 1)[-1] for k in ev.shapes}
        return "ernie-image" if all(m in keys for m in MARKERS) else None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == PIPELINE:
        return "ernie-image"
    if name.startswith("ErnieImage"):
        raise ValueError(f"{ev.where} is a {name}; Atelier trains ERNIE-Image text-to-image (ErnieImagePipeline)")
    transformer = ev.json("transformer/config.json")
    return "ernie-image" if transformer and transformer.get("_class_name") == "ErnieImageTransformer2DModel" else None
