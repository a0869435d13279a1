"""Claim Lumina 2 weights (Lumina-Image-2.0, Neta-Lumina): the original single file (NextDiT layers with fused
``attention.qkv``, context and noise refiners, a caption embedder, SiLU + Linear modulation at ``adaLN_modulation.1``;
with or without ComfyUI's ``model.diffusion_model.``, alone or with the VAE and Gemma in one file), a diffusers
``Lumina2Pipeline`` folder or hub repo. Z-Image has the same layout with a single modulation Linear
(``adaLN_modulation.0``) and pad tokens: it is left to its own family. NewBie-image (Lumina 2 with a CLIP pooled input,
``clip_text_pooled_proj``) is refused by name."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINES = ("Lumina2Pipeline", "Lumina2Text2ImgPipeline")  # the second: diffusers' earlier name


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items() if "diffusion_model." in k
                  or not k.startswith(("first_stage_model.", "text_encoders.", "cond_stage_model.", "vae."))}
        needed = ("layers.0.attention.qkv.weight", "context_refiner.0.attention.qkv.weight", "cap_embedder.1.weight",
                  "layers.0.adaLN_modulation.1.weight")
        if not all(k in shapes for k in needed) or "cap_pad_token" in shapes:
            return None
        if "clip_text_pooled_proj.0.weight" in shapes:
            raise ValueError(f"{ev.where} is NewBie-image (Lumina 2 with a CLIP text input), which Atelier does not "
                             "train yet; Lumina-Image-2.0 and Neta-Lumina files are")
        return "lumina2"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in PIPELINES:
        return "lumina2"
    transformer = ev.json("transformer/config.json")
    return "lumina2" if transformer and transformer.get("_class_name") == "Lumina2Transformer2DModel" else None
