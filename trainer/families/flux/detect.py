"""Claim Flux.1 weights: the BFL single file (transformer only, optionally ``model.diffusion_model.``-
prefixed as in ComfyUI checkpoints), a diffusers ``FluxPipeline`` folder or hub repo, and FLUX.1 Kontext [dev]
as a ``FluxKontextPipeline`` folder or hub repo. A Kontext single file has Flux.1 dev's keys and shapes (ComfyUI's
model detection cannot tell them apart either): it is claimed as dev, and ``model.family: flux-kontext`` says
what it is. The other Flux variants (Fill, Depth/Canny, Kontext inpainting, Redux) are refused: they need inputs
Atelier does not build."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

# x_embedder / img_in input width -> what the model is (64 = 16 latent channels × 2×2 packing)
_IN_CHANNELS = {384: "Flux.1 Fill (inpainting/outpainting: 64 + 320 mask and image channels)",
                128: "Flux.1 Depth or Canny (structure-conditioned: 64 + 64 control channels)"}
_OTHER_PIPELINES = {"FluxFillPipeline": "Flux.1 Fill", "FluxKontextInpaintPipeline": "Flux.1 Kontext inpainting",
                    "FluxPriorReduxPipeline": "Flux.1 Redux",
                    "FluxControlPipeline": "Flux.1 Depth/Canny", "FluxControlNetPipeline": "a Flux ControlNet"}


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where} is {what}, which trains with inputs Atelier does not build yet. Use the plain "
                      "Flux.1 dev or schnell text-to-image model, or FLUX.1 Kontext [dev] for edits (model.path), "
                      "instead.")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = [k.split("diffusion_model.", 1)[-1] for k in ev.shapes]
        if "double_blocks.0.img_attn.qkv.weight" not in keys:
            return None
        if any(k.startswith("distilled_guidance_layer.") for k in keys):
            return None  # Chroma: Flux-shaped, its own family
        if "double_stream_modulation_img.lin.weight" in keys:
            return None  # Flux.2 in BFL's layout: the same block names, its own family
        img_in = next((s for k, s in ev.shapes.items() if k.endswith("img_in.weight")), None)
        if img_in is not None and len(img_in) == 2 and int(img_in[1]) in _IN_CHANNELS:
            raise _refuse(ev.where, _IN_CHANNELS[int(img_in[1])])
        return "flux-dev" if any(k.startswith("guidance_in.") for k in keys) else "flux-schnell"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in _OTHER_PIPELINES:
        raise _refuse(ev.where, _OTHER_PIPELINES[name])
    transformer = ev.json("transformer/config.json")
    kontext = name == "FluxKontextPipeline"
    if transformer is None or transformer.get("_class_name") != "FluxTransformer2DModel":
        if name in ("FluxPipeline", "FluxKontextPipeline") and transformer is None:
            # the repo's transformer config could not be read: the loader tells dev/schnell
            return "flux-kontext" if kontext else "flux-dev"
        return None
    in_ch = int(transformer.get("in_channels", 64))
    if in_ch in _IN_CHANNELS:
        raise _refuse(ev.where, _IN_CHANNELS[in_ch])
    if kontext:
        return "flux-kontext"
    return "flux-dev" if transformer.get("guidance_embeds", False) else "flux-schnell"
