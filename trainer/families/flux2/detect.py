"""Claim Flux.2 weights: a diffusers ``Flux2KleinPipeline`` ([klein], Qwen3) or ``Flux2Pipeline`` ([dev], Mistral
Small 3.1) folder or hub repo, or the transformer as one file, in BFL's layout (BFL's releases, Atelier's fine-tunes)
or under diffusers' names; [dev]'s has a guidance embedder."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if "double_stream_modulation_img.lin.weight" in keys and "img_in.weight" in keys:  # BFL's layout
            return "flux2-dev" if any(k.startswith("guidance_in.") for k in keys) else "flux2-klein"
        if "double_stream_modulation_img.linear.weight" not in keys or "x_embedder.weight" not in keys:
            return None
        return "flux2-dev" if any(k.startswith("time_guidance_embed.guidance_embedder.") for k in keys) else "flux2-klein"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == "Flux2Pipeline":
        return "flux2-dev"
    if name == "Flux2KleinPipeline":
        return "flux2-klein"
    transformer = ev.json("transformer/config.json")
    if transformer and transformer.get("_class_name") == "Flux2Transformer2DModel":
        return "flux2-dev" if transformer.get("guidance_embeds", True) else "flux2-klein"
    return None
