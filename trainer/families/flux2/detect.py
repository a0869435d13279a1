"""Claim Flux.2 [klein] weights: a diffusers ``Flux2KleinPipeline`` folder or hub repo, or its transformer as one
file (diffusers' names). Flux.2 [dev] (Mistral Small 3.1 as text encoder) is recognised and refused: its text
path is not built here yet."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

DEV = ("Flux.2 [dev], whose text encoder (Mistral Small 3.1, a vision-language model with its own processor) Atelier "
       "does not drive yet; Flux.2 [klein] (Qwen3 text encoder) trains. Point model.path at a Flux2KleinPipeline "
       "(e.g. black-forest-labs/FLUX.2-klein-4B)")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if "double_stream_modulation_img.linear.weight" not in keys or "x_embedder.weight" not in keys:
            return None
        if any(k.startswith("time_guidance_embed.guidance_embedder.") for k in keys):
            raise ValueError(f"it holds {DEV}")
        return "flux2-klein"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name == "Flux2Pipeline":
        raise ValueError(f"it is {DEV}")
    if name == "Flux2KleinPipeline":
        return "flux2-klein"
    transformer = ev.json("transformer/config.json")
    if transformer and transformer.get("_class_name") == "Flux2Transformer2DModel":
        if transformer.get("guidance_embeds", True) and name != "Flux2KleinPipeline":
            raise ValueError(f"it is {DEV}")
        return "flux2-klein"
    return None
