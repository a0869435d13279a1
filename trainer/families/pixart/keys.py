"""PixArt transformer keys: diffusers (``PixArtTransformer2DModel``) ↔ the original PixArt checkpoint layout
(``PixArt-Sigma-XL-2-1024-MS.pth`` and the single files people share: ``blocks.N.attn.qkv``,
``blocks.N.cross_attn.kv_linear``, ``x_embedder``, ``t_embedder``, ``y_embedder`` …), and what a single file
tells of the transformer's config.

The map is the one of diffusers' scripts/convert_pixart_{alpha,sigma}_to_diffusers.py (diffusers has no
single-file loader for PixArt and no reverse direction), written both ways. The original fuses self-attention
q/k/v (``attn.qkv``) and cross-attention k/v (``cross_attn.kv_linear``). ``y_embedder.y_embedding`` (the
learned empty caption of the original training code) and the ``pos_embed`` buffer have no diffusers weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict

_TOP = {
    "x_embedder.proj": "pos_embed.proj",
    "y_embedder.y_proj.fc1": "caption_projection.linear_1",
    "y_embedder.y_proj.fc2": "caption_projection.linear_2",
    "t_embedder.mlp.0": "adaln_single.emb.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "adaln_single.emb.timestep_embedder.linear_2",
    "csize_embedder.mlp.0": "adaln_single.emb.resolution_embedder.linear_1",
    "csize_embedder.mlp.2": "adaln_single.emb.resolution_embedder.linear_2",
    "ar_embedder.mlp.0": "adaln_single.emb.aspect_ratio_embedder.linear_1",
    "ar_embedder.mlp.2": "adaln_single.emb.aspect_ratio_embedder.linear_2",
    "t_block.1": "adaln_single.linear",
    "final_layer.linear": "proj_out",
}
_BLOCK = {
    "attn.proj": "attn1.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "cross_attn.q_linear": "attn2.to_q",
    "cross_attn.proj": "attn2.to_out.0",
}
_FUSED = {"attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v")}
SKIPPED = ("y_embedder.y_embedding", "pos_embed")
# A transformer/diffusion_pytorch_model.safetensors downloaded from a diffusers repo, passed as a single file.
DIFFUSERS_MARKERS = ("adaln_single.linear.weight", "caption_projection.linear_1.weight",
                     "transformer_blocks.0.attn2.to_k.weight")


def is_diffusers_layout(keys) -> bool:
    keys = set(keys)
    return all(k in keys for k in DIFFUSERS_MARKERS)


def read_state(path) -> Dict[str, object]:
    """All tensors of a single file: ``.safetensors``, or a PyTorch ``.pth``/``.pt``/``.ckpt`` (the original
    PixArt releases: ``{"state_dict": ...}``), read with ``weights_only=True``."""

    import torch  # torch inside: detection (validate) reads this module without torch
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file  # torch inside: detection (validate) reads this module without torch
        return dict(load_file(str(path)))
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    return {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def config_from_state(state: Dict[str, object], config: Dict[str, object]) -> Dict[str, object]:
    """``config`` (a PixArtTransformer2DModel config of the variant) corrected by what the weights show:
    the depth, the α micro-conditions (only the 1024 α models have ``csize_embedder``/``ar_embedder``; the
    256/512 α models and Σ do not) and, where the original file keeps its ``pos_embed`` buffer, the
    training size. Works on either layout."""
    state = _strip(state)
    diffusers = is_diffusers_layout(state)
    blocks = "transformer_blocks." if diffusers else "blocks."
    out = dict(config)
    out["num_layers"] = 1 + max(int(k.split(".")[1]) for k in state if k.startswith(blocks))
    size_key = "adaln_single.emb.resolution_embedder.linear_1.weight" if diffusers else "csize_embedder.mlp.0.weight"
    out["use_additional_conditions"] = size_key in state
    pos = state.get("pos_embed")
    if pos is not None and getattr(pos, "ndim", 0) == 3:
        side = math.isqrt(int(pos.shape[1]))
        if side * side == int(pos.shape[1]):
            out["sample_size"] = side * int(out.get("patch_size", 2))
            # the diffusers conversion scripts: interpolation_scale = image size / 512 (sample_size / 64)
            out["interpolation_scale"] = max(out["sample_size"] / 64, 0.5)
    return out


def _strip(state):
    return {k.split("diffusion_model.", 1)[-1]: v for k, v in state.items()}


def original_to_diffusers(state: Dict[str, object]) -> Dict[str, object]:
    state = _strip(state)
    out: Dict[str, object] = {}
    for orig, ours in _TOP.items():
        for suffix in ("weight", "bias"):
            if f"{orig}.{suffix}" in state:
                out[f"{ours}.{suffix}"] = state[f"{orig}.{suffix}"]
    out["scale_shift_table"] = state["final_layer.scale_shift_table"]
    n = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1)
    for i in range(n):
        src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
        out[dst + "scale_shift_table"] = state[src + "scale_shift_table"]
        for orig, ours in _BLOCK.items():
            for suffix in ("weight", "bias"):
                out[f"{dst}{ours}.{suffix}"] = state[f"{src}{orig}.{suffix}"]
        for orig, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                for name, chunk in zip(parts, state[f"{src}{orig}.{suffix}"].chunk(len(parts), dim=0)):
                    out[f"{dst}{name}.{suffix}"] = chunk
    return out


def diffusers_to_original(state: Dict[str, object]) -> Dict[str, object]:
    import torch  # torch inside: detection (validate) reads this module without torch
    out: Dict[str, object] = {}
    for orig, ours in _TOP.items():
        for suffix in ("weight", "bias"):
            if f"{ours}.{suffix}" in state:
                out[f"{orig}.{suffix}"] = state[f"{ours}.{suffix}"]
    out["final_layer.scale_shift_table"] = state["scale_shift_table"]
    n = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")), default=-1)
    for i in range(n):
        src, dst = f"transformer_blocks.{i}.", f"blocks.{i}."
        out[dst + "scale_shift_table"] = state[src + "scale_shift_table"]
        for orig, ours in _BLOCK.items():
            for suffix in ("weight", "bias"):
                out[f"{dst}{orig}.{suffix}"] = state[f"{src}{ours}.{suffix}"]
        for orig, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                out[f"{dst}{orig}.{suffix}"] = torch.cat([state[f"{src}{p}.{suffix}"] for p in parts], dim=0)
    return out
