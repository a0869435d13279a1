"""Claim Qwen-Image 2.1 weights and tell Turbo from the base model, from configs and key names only.

- A diffusers folder or hub repo: ``model_index.json``'s ``QwenImage21Pipeline``; a non-empty ``sample_sigmas`` (the
  sampling grid the Turbo checkpoint ships, what diffusers' modular loader picks the Turbo blocks by) makes it
  ``qwen-image-21-turbo``. A ``QwenImage21Transformer2DModel`` folder without it is the base model.
- One file in the original layout (with or without ``model.diffusion_model.``): the shared ``modulation`` and the
  blocks' fused ``img_mlp.gate_up`` (what diffusers' single-file loader converts). Base and Turbo have the same
  tensors, so a file is ``qwen-image-21`` unless ``model.family`` says Turbo (or the file name does).
A file under diffusers' names is read too (its ``gate_layer``/``proj``)."""

from __future__ import annotations

import os
from typing import Optional

from trainer.families import Evidence

PIPELINE = "QwenImage21Pipeline"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if "modulation.1.weight" not in keys or "txt_in.in_layer.weight" not in keys:
            return None
        if not any(k in keys for k in ("transformer_blocks.0.img_mlp.gate_up.weight",
                                       "transformer_blocks.0.img_mlp.gate_layer.weight")):
            return None
        return "qwen-image-21-turbo" if "turbo" in os.path.basename(str(ev.where)).lower() else "qwen-image-21"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == PIPELINE:
        return "qwen-image-21-turbo" if index.get("sample_sigmas") else "qwen-image-21"
    if name.startswith("QwenImage21"):
        raise ValueError(f"{ev.where} is a {name}; Atelier trains Qwen-Image 2.1 text-to-image (QwenImage21Pipeline)")
    transformer = ev.json("transformer/config.json")
    named = transformer and transformer.get("_class_name") == "QwenImage21Transformer2DModel"
    return "qwen-image-21" if named else None
