"""Qwen-Image 2.1 transformer keys: the original single file (Qwen's release, ComfyUI's split file) ↔ diffusers'
``QwenImage21Transformer2DModel``.

The layouts differ in one tensor per block (diffusers 0.42.1 ``convert_qwen_image21_transformer_checkpoint_to_
diffusers``, the single-file converter ``from_single_file`` uses): the original fuses the SwiGLU's gate and up
projections into ``img_mlp.gate_up`` (gate rows first); diffusers has ``img_mlp.gate_layer`` and ``img_mlp.proj``.
Every other key is the same in both, with or without ComfyUI's ``model.diffusion_model.`` prefix."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

# QwenImage21Transformer2DModel's defaults (diffusers documents them as the released model's)
CONFIG: Dict[str, Any] = {"_class_name": "QwenImage21Transformer2DModel", "patch_size": 1, "in_channels": 64,
                          "out_channels": 64, "num_layers": 32, "attention_head_dim": 128, "num_attention_heads": 32,
                          "context_in_dim": 4096, "mlp_ratio": 3, "axes_dims_rope": [16, 56, 56], "eps": 1e-6,
                          "causal_condition": True}
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def strip_prefix(key: str) -> str:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors as diffusers': ``gate_up`` cut into ``gate_layer`` (first half) and ``proj``."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        key = strip_prefix(key)
        if key.endswith("img_mlp.gate_up.weight"):
            gate, up = torch.chunk(value, 2, dim=0)
            out[key.replace("gate_up", "gate_layer")], out[key.replace("gate_up", "proj")] = gate, up
        else:
            out[key] = value
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers` (no prefix, as ComfyUI's diffusion-model loader reads it)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if key.endswith("img_mlp.proj.weight"):
            continue
        if key.endswith("img_mlp.gate_layer.weight"):
            value = torch.cat([value, state[key.replace("gate_layer", "proj")]])
            key = key.replace("gate_layer", "gate_up")
        out[key] = value
    return out


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A QwenImage21Transformer2DModel config for original-layout weights: ``base`` (a local folder's config, else the
    released model's) with the sizes the tensors tell (the head width from the q norm)."""
    state = {strip_prefix(k): v for k, v in state.items()}
    cfg = dict(CONFIG, **dict(base))
    hidden, in_channels = state["img_in.weight"].shape
    head = int(state["transformer_blocks.0.attn.norm_q.weight"].shape[0])
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    fused = state.get("transformer_blocks.0.img_mlp.gate_up.weight")
    mlp = (int(fused.shape[0]) // 2 if fused is not None
           else int(state["transformer_blocks.0.img_mlp.gate_layer.weight"].shape[0]))
    cfg.update(in_channels=int(in_channels), out_channels=int(state["proj_out.weight"].shape[0]), num_layers=layers,
               attention_head_dim=head, num_attention_heads=int(hidden) // head, mlp_ratio=mlp // int(hidden),
               context_in_dim=int(state["txt_in.in_layer.weight"].shape[1]))
    if sum(cfg["axes_dims_rope"]) != head:  # tiny models: the rotary axes fill the head
        side = (head * 7 // 16) // 2 * 2
        cfg["axes_dims_rope"] = [head - 2 * side, side, side]
    return cfg
