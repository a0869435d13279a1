"""Claim PixArt-α/Σ weights: the original single file (``blocks.N.attn.qkv`` …, ``.pth`` or ``.safetensors``),
a diffusers transformer file passed alone (``transformer_blocks.N.attn2`` + ``adaln_single`` +
``caption_projection``), a diffusers PixArt pipeline folder or hub repo. α and Σ differ in their caption length
(120 vs 300 T5 tokens: the original ``y_embedder.y_embedding``) and pipeline class; α 1024 models carry
size/aspect micro-conditions. Without either mark (a 512 px α file saved without its null caption) the weights
are the same network as Σ's and are taken as Σ, as ComfyUI's model_detection does."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.pixart.keys import is_diffusers_layout

_TOKENS = {120: "pixart-alpha", 300: "pixart-sigma"}


def _single_file(ev: Evidence) -> Optional[str]:
    shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
    if is_diffusers_layout(shapes):
        null = shapes.get("caption_projection.y_embedding")
        sizes = "adaln_single.emb.resolution_embedder.linear_1.weight"
    elif "blocks.0.attn.qkv.weight" in shapes and "blocks.0.cross_attn.kv_linear.weight" in shapes:
        null, sizes = shapes.get("y_embedder.y_embedding"), "csize_embedder.mlp.0.weight"
        compressed = sorted(k for k in shapes if k.startswith("blocks.") and ".attn.sr." in k)
        if compressed:
            raise ValueError(f"a PixArt-Σ transformer with KV token compression ({compressed[0]} …). diffusers' "
                             "PixArt transformer has no KV compression, so Atelier cannot load or train it; use a "
                             "PixArt-Σ checkpoint without it (e.g. PixArt-Sigma-XL-2-1024-MS or -2K-MS)")
    else:
        return None
    if null is not None and len(null) == 2 and int(null[0]) in _TOKENS:
        return _TOKENS[int(null[0])]
    return "pixart-alpha" if sizes in shapes else "pixart-sigma"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        return _single_file(ev)
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
        extra = transformer.get("use_additional_conditions")  # None: diffusers derives it from sample_size == 128
        return "pixart-alpha" if extra or (extra is None and transformer.get("sample_size") == 128) else "pixart-sigma"
    return None
