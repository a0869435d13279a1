"""Claim Qwen-Image weights and tell its edit models apart, from configs and key names only.

- A diffusers folder or hub repo: ``model_index.json``'s pipeline class — ``QwenImagePipeline`` (text to image),
  ``QwenImageEditPipeline`` (Qwen-Image-Edit), ``QwenImageEditPlusPipeline`` (-2509 and -2511, which share it).
  2511 is told from 2509 by its transformer config's ``zero_cond_t`` (diffusers runs the reference tokens at
  timestep 0 when it is on; ComfyUI calls it ``index_timestep_zero``); a Plus folder whose config does not say
  (saved before diffusers had the field) is 2511 when its name says so, else 2509 — ``model.family`` decides.
- One file (the transformer under diffusers' names, as ComfyUI's split files have them, optionally
  ``model.diffusion_model.``-prefixed): the weights of Qwen-Image, -Edit and -2509 are the same tensors, so such a file
  is ``qwen-image`` unless ``model.family`` names an edit model; ComfyUI's 2511 file carries the marker tensor
  ``__index_timestep_zero__`` (comfy/model_detection.py), which makes it 2511.
The layered, ControlNet, inpainting and img2img pipelines take other inputs and are refused."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINES = {"QwenImagePipeline": "qwen-image", "QwenImageEditPipeline": "qwen-image-edit"}
PLUS = "QwenImageEditPlusPipeline"
MARKER_2511 = "__index_timestep_zero__"  # ComfyUI's 2511 files (model_detection: default_ref_method)
LAYERED_KEY = "time_text_embed.addition_t_embedding.weight"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if not ("transformer_blocks.0.img_mod.1.weight" in keys and "txt_norm.weight" in keys and "img_in.weight" in keys):
            return None
        if LAYERED_KEY in keys:
            raise ValueError("this is the Qwen-Image-Layered transformer (it decomposes an image into layers), which "
                             "Atelier does not train; use Qwen-Image or Qwen-Image-Edit(-2509/-2511)")
        return "qwen-image-edit-2511" if MARKER_2511 in keys else "qwen-image"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == PLUS:
        transformer = ev.json("transformer/config.json") or {}
        if "zero_cond_t" in transformer:
            return "qwen-image-edit-2511" if transformer["zero_cond_t"] else "qwen-image-edit-2509"
        return "qwen-image-edit-2511" if "2511" in ev.where else "qwen-image-edit-2509"
    if name in PIPELINES:
        return PIPELINES[name]
    if name.startswith("QwenImage"):
        raise ValueError(f"{ev.where} is a {name}, which takes other inputs than an instruction and control images; "
                         "Atelier trains Qwen-Image (QwenImagePipeline) and Qwen-Image-Edit (QwenImageEditPipeline, "
                         "QwenImageEditPlusPipeline for -2509/-2511). Point model.path at one of those (e.g. "
                         "Qwen/Qwen-Image or Qwen/Qwen-Image-Edit-2509)")
    transformer = ev.json("transformer/config.json")
    return "qwen-image" if transformer and transformer.get("_class_name") == "QwenImageTransformer2DModel" else None
