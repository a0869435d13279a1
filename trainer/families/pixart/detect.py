"""Claim PixArt-α/Σ weights: the original single file (``blocks.N.attn.qkv`` …), a diffusers PixArt
pipeline folder or hub repo. α and Σ differ in their caption length (120 vs 300 T5 tokens: the original
``y_embedder.y_embedding``) and pipeline class; α 1024 models carry size/aspect micro-conditions."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
        if "blocks.0.attn.qkv.weight" not in shapes or "blocks.0.cross_attn.kv_linear.weight" not in shapes:
            return None
        y = shapes.get("y_embedder.y_embedding")
        if y is not None and len(y) == 2:
            return "pixart-alpha" if int(y[0]) == 120 else "pixart-sigma"
        return "pixart-alpha" if "csize_embedder.mlp.0.weight" in shapes else "pixart-sigma"
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in ("PixArtAlphaPipeline", "PixArtSigmaPipeline"):
        return "pixart-alpha" if "Alpha" in name else "pixart-sigma"
    transformer = ev.json("transformer/config.json")
    if transformer is None:
        return None
    cls = transformer.get("_class_name")
    if cls == "PixArtTransformer2DModel" or (cls == "Transformer2DModel" and transformer.get("norm_type") ==
                                             "ada_norm_single" and transformer.get("caption_channels")):
        return "pixart-alpha" if transformer.get("use_additional_conditions") else "pixart-sigma"
    return None
