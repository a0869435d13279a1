"""Claim Krea 2 weights and tell Turbo from Raw, from configs and key names only.

- A diffusers folder or hub repo: ``model_index.json``'s ``Krea2Pipeline``; its ``is_distilled`` (the pipeline's own
  switch to Turbo's fixed schedule) makes it ``krea2-turbo``. A ``Krea2Transformer2DModel`` folder without it is Raw.
- One file in the original layout (krea-ai's and ComfyUI's, with or without ``model.diffusion_model.``): the text
  fusion's ``txtfusion.projector`` (what diffusers' single-file loader checks) and the blocks' flat ``mod.lin``. Raw and
  Turbo have the same tensors, so a file is ``krea2`` unless ``model.family: krea2-turbo`` says otherwise (or the file
  name says turbo).
A diffusers-named transformer file, or a pipeline class of Krea 2 that is not text-to-image, is refused by name."""

from __future__ import annotations

import os
from typing import Optional

from trainer.families import Evidence

PIPELINE = "Krea2Pipeline"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if "txtfusion.projector.weight" in keys and "blocks.0.mod.lin" in keys:
            return "krea2-turbo" if "turbo" in os.path.basename(str(ev.where)).lower() else "krea2"
        if "text_fusion.projector.weight" in keys and "transformer_blocks.0.scale_shift_table" in keys:
            raise ValueError("this is a Krea 2 transformer under diffusers' names; Atelier reads the original single "
                             "file (krea-ai's or ComfyUI's) or a diffusers Krea2Pipeline folder")
        return None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == PIPELINE:
        return "krea2-turbo" if index.get("is_distilled") else "krea2"
    if name.startswith("Krea2"):
        raise ValueError(f"{ev.where} is a {name}; Atelier trains Krea 2 text-to-image (Krea2Pipeline: Krea-2-Raw or "
                         "Krea-2-Turbo)")
    transformer = ev.json("transformer/config.json")
    return "krea2" if transformer and transformer.get("_class_name") == "Krea2Transformer2DModel" else None
