"""Claim Stable Diffusion 3 / 3.5 weights: Stability's single file (``joint_blocks.N.x_block…``, optionally
``model.diffusion_model.``-prefixed), a diffusers ``StableDiffusion3Pipeline`` folder or hub repo. 3.5 has q/k
RMSNorm in its attention; 3.5 medium adds a second attention in its first blocks (MMDiT-X)."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

_OTHER_PIPELINES = {"StableDiffusion3InpaintPipeline": "an SD3 inpainting pipeline",
                    "StableDiffusion3ControlNetPipeline": "an SD3 ControlNet pipeline",
                    "StableDiffusion3ControlNetInpaintingPipeline": "an SD3 ControlNet inpainting pipeline"}


def _variant(qk_norm: bool, dual: bool) -> str:
    return "sd3.5-medium" if dual else "sd3.5-large" if qk_norm else "sd3-medium"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {k.split("diffusion_model.", 1)[-1] for k in ev.shapes}
        if "joint_blocks.0.x_block.attn.qkv.weight" not in keys:
            return None
        return _variant(any(".attn.ln_q." in k for k in keys), any(".x_block.attn2." in k for k in keys))
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in _OTHER_PIPELINES:
        raise ValueError(f"{ev.where} is {_OTHER_PIPELINES[name]}: Atelier trains the text-to-image SD3 model. Point "
                         "model.path at a StableDiffusion3Pipeline (e.g. stabilityai/stable-diffusion-3.5-medium)")
    transformer = ev.json("transformer/config.json")
    if transformer is None or transformer.get("_class_name") != "SD3Transformer2DModel":
        if name == "StableDiffusion3Pipeline" and transformer is None:
            return "sd3.5-large"  # the transformer config could not be read: the loader tells the variant
        return None
    return _variant(bool(transformer.get("qk_norm")), bool(transformer.get("dual_attention_layers")))
