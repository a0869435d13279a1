"""Sana transformer keys: the original single file (NVlabs' ``SanaMS``, as ComfyUI custom nodes and Sana's own code
read it) ↔ diffusers' ``SanaTransformer2DModel``.

diffusers' ``convert_sana_transformer_to_diffusers`` (``from_single_file``) reads Sana 1.0 only: it drops Sana 1.5's
q/k norms (``blocks.N.attn.q_norm`` …) and so fails on a 1.5 file; these maps carry them (as diffusers'
``scripts/convert_sana_to_diffusers.py`` does) and :func:`diffusers_to_original` inverts them (``qkv`` and
``kv_linear`` fused again). The original file's ``pos_embed`` (a fixed table diffusers recomputes) and
``y_embedder.y_embedding`` (the training-time null caption, unused at sampling) are no diffusers weights: the family
keeps those of the file it loaded and writes them back."""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

import torch

# Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json (SanaTransformer2DModel's defaults)
CONFIG: Dict[str, Any] = {"_class_name": "SanaTransformer2DModel", "in_channels": 32, "out_channels": 32,
                          "num_attention_heads": 70, "attention_head_dim": 32, "num_layers": 20,
                          "num_cross_attention_heads": 20, "cross_attention_head_dim": 112,
                          "cross_attention_dim": 2240, "caption_channels": 2304, "mlp_ratio": 2.5,
                          "attention_bias": False, "sample_size": 32, "patch_size": 1,
                          "norm_elementwise_affine": False, "norm_eps": 1e-6, "interpolation_scale": None}
# tensors of the original file that are no diffusers weight (kept and written back)
EXTRAS = ("pos_embed", "y_embedder.y_embedding")
OTHER_PARTS = ("first_stage_model.", "text_encoders.", "cond_stage_model.", "vae.")
_TOP = {"x_embedder.proj": "patch_embed.proj", "t_embedder.mlp.0": "time_embed.emb.timestep_embedder.linear_1",
        "t_embedder.mlp.2": "time_embed.emb.timestep_embedder.linear_2", "t_block.1": "time_embed.linear",
        "y_embedder.y_proj.fc1": "caption_projection.linear_1", "y_embedder.y_proj.fc2": "caption_projection.linear_2",
        "attention_y_norm": "caption_norm", "final_layer.linear": "proj_out"}
_BLOCK = {"attn.proj": "attn1.to_out.0", "attn.q_norm": "attn1.norm_q", "attn.k_norm": "attn1.norm_k",
          "cross_attn.q_linear": "attn2.to_q", "cross_attn.proj": "attn2.to_out.0",
          "cross_attn.q_norm": "attn2.norm_q", "cross_attn.k_norm": "attn2.norm_k",
          "mlp.inverted_conv.conv": "ff.conv_inverted", "mlp.depth_conv.conv": "ff.conv_depth",
          "mlp.point_conv.conv": "ff.conv_point"}
# fused original modules -> their diffusers parts, in order
_FUSED = {"attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v")}
_KEY = re.compile(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_INV = {v: k for k, v in _TOP.items()}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_PART_INV = {part: (fused, i) for fused, parts in _FUSED.items() for i, part in enumerate(parts)}


def strip(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The transformer's tensors of a file: ComfyUI's ``model.diffusion_model.`` dropped, other components left out."""
    return {k.split("model.diffusion_model.", 1)[-1]: v for k, v in state.items() if not k.startswith(OTHER_PARTS)}


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors (with or without the prefix) as diffusers' tensors; :data:`EXTRAS` left out."""
    out: Dict[str, Any] = {}
    for key, value in strip(state).items():
        if key in EXTRAS:
            continue
        if key == "final_layer.scale_shift_table":
            out["scale_shift_table"] = value
            continue
        if key.startswith("blocks.") and key.endswith(".scale_shift_table"):
            out["transformer_" + key] = value
            continue
        module, _, end = key.rpartition(".")
        if module in _TOP:
            out[f"{_TOP[module]}.{end}"] = value
            continue
        m = _KEY.match(key)
        if m is None:
            raise KeyError(f"not a Sana key: {key}")
        index, rest, end = m.groups()
        prefix = f"transformer_blocks.{index}."
        if rest in _FUSED:
            for part, tensor in zip(_FUSED[rest], torch.chunk(value, len(_FUSED[rest]), dim=0)):
                out[f"{prefix}{part}.{end}"] = tensor
        elif rest in _BLOCK:
            out[f"{prefix}{_BLOCK[rest]}.{end}"] = value
        else:
            raise KeyError(f"not a Sana key: {key}")
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers` (no prefix, as NVlabs' files)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            out["final_layer.scale_shift_table"] = value
            continue
        if key.endswith(".scale_shift_table"):
            out[key.removeprefix("transformer_")] = value
            continue
        module, _, end = key.rpartition(".")
        if module in _TOP_INV:
            out[f"{_TOP_INV[module]}.{end}"] = value
            continue
        _, index, rest = module.split(".", 2)
        if rest in _PART_INV:
            fused, i = _PART_INV[rest]
            if i == 0:
                block = f"transformer_blocks.{index}"
                out[f"blocks.{index}.{fused}.{end}"] = torch.cat(
                    [state[f"{block}.{part}.{end}"] for part in _FUSED[fused]], dim=0)
            continue
        out[f"blocks.{index}.{_BLOCK_INV[rest]}.{end}"] = value
    return out


def _count(state: Mapping[str, Any]) -> int:
    return 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1)


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A SanaTransformer2DModel config for original-layout weights: ``base`` (a local folder's config, else Sana
    1.6B's) with the sizes the tensors tell. The head width is not in the weights (linear attention has no
    per-head tensor): ``base``'s, 32 in every released Sana."""
    state = strip(state)
    cfg = dict(CONFIG, **dict(base))
    hidden, channels = state["x_embedder.proj.weight"].shape[:2]
    patch = int(state["x_embedder.proj.weight"].shape[-1])
    head = int(cfg["attention_head_dim"])
    cross = int(state["blocks.0.cross_attn.q_linear.weight"].shape[0])
    cross_head = int(cfg["cross_attention_head_dim"]) if cross % int(cfg["cross_attention_head_dim"]) == 0 else head
    cfg.update(in_channels=int(channels), out_channels=int(state["final_layer.linear.weight"].shape[0]) // patch ** 2,
               patch_size=patch, num_layers=_count(state), num_attention_heads=int(hidden) // head,
               cross_attention_dim=cross, num_cross_attention_heads=cross // cross_head,
               cross_attention_head_dim=cross_head,
               caption_channels=int(state["y_embedder.y_proj.fc1.weight"].shape[1]),
               mlp_ratio=int(state["blocks.0.mlp.point_conv.conv.weight"].shape[1]) / int(hidden),
               qk_norm="rms_norm_across_heads" if "blocks.0.attn.q_norm.weight" in state else None)
    return cfg


def extras(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The file's :data:`EXTRAS` (kept to write back)."""
    return {k: v for k, v in strip(state).items() if k in EXTRAS}
