"""Lumina 2 transformer keys: the original single file (Alpha-VLLM's NextDiT, ComfyUI's ``lumina2`` model) ↔
diffusers' ``Lumina2Transformer2DModel``.

diffusers' own converter (``convert_lumina2_to_diffusers``) splits the fused ``qkv`` at the released model's sizes
(2304 / 768 / 768); these maps take the sizes from the tensors, so tiny models and any width convert, and
:func:`diffusers_to_original` inverts them (``qkv`` fused again). The original file's unused top-level
``norm_final.weight`` is dropped on reading, as diffusers drops it; ComfyUI's model has none, so it is not written."""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

import torch

# Alpha-VLLM/Lumina-Image-2.0 transformer/config.json (Lumina2Transformer2DModel's defaults are that model)
CONFIG: Dict[str, Any] = {"_class_name": "Lumina2Transformer2DModel", "sample_size": 128, "patch_size": 2,
                          "in_channels": 16, "hidden_size": 2304, "num_layers": 26, "num_refiner_layers": 2,
                          "num_attention_heads": 24, "num_kv_heads": 8, "multiple_of": 256,
                          "ffn_dim_multiplier": None, "norm_eps": 1e-5, "scaling_factor": 1.0,
                          "axes_dim_rope": [32, 32, 32], "axes_lens": [300, 512, 512], "cap_feat_dim": 2304}

# the other components of ComfyUI's all-in-one checkpoints (the VAE, Gemma)
OTHER_PARTS = ("first_stage_model.", "text_encoders.", "cond_stage_model.", "vae.")
_TOP = {"t_embedder.mlp.0": "time_caption_embed.timestep_embedder.linear_1",
        "t_embedder.mlp.2": "time_caption_embed.timestep_embedder.linear_2",
        "cap_embedder.0": "time_caption_embed.caption_embedder.0",
        "cap_embedder.1": "time_caption_embed.caption_embedder.1",
        "final_layer.adaLN_modulation.1": "norm_out.linear_1", "final_layer.linear": "norm_out.linear_2",
        "x_embedder": "x_embedder"}
# block module renames (original → diffusers); attention_norm1 depends on the block's modulation (below)
_BLOCK = {"attention.out": "attn.to_out.0", "attention.q_norm": "attn.norm_q", "attention.k_norm": "attn.norm_k",
          "feed_forward.w1": "feed_forward.linear_1", "feed_forward.w2": "feed_forward.linear_2",
          "feed_forward.w3": "feed_forward.linear_3", "adaLN_modulation.1": "norm1.linear",
          "attention_norm2": "norm2", "ffn_norm1": "ffn_norm1", "ffn_norm2": "ffn_norm2"}
_BLOCK_KEY = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_INV = {v: k for k, v in _TOP.items()}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}


def original_module(path: str) -> str:
    """A diffusers module path -> its original module path (q/k/v -> the fused ``attention.qkv``); KeyError when the
    original model has no such module."""
    if path in _TOP_INV:
        return _TOP_INV[path]
    kind, index, rest = path.split(".", 2)
    if kind not in ("layers", "noise_refiner", "context_refiner"):
        raise KeyError(path)
    if rest in ("attn.to_q", "attn.to_k", "attn.to_v"):
        return f"{kind}.{index}.attention.qkv"
    if rest in ("norm1.norm", "norm1") and (rest == "norm1.norm") == (kind != "context_refiner"):
        return f"{kind}.{index}.attention_norm1"
    return f"{kind}.{index}.{_BLOCK_INV[rest]}"


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors (with or without ComfyUI's ``model.diffusion_model.``) as diffusers' tensors."""
    state = {k.split("model.diffusion_model.", 1)[-1]: v for k, v in state.items() if not k.startswith(OTHER_PARTS)}
    state.pop("norm_final.weight", None)
    out: Dict[str, Any] = {}
    for key, value in state.items():
        module, _, end = key.rpartition(".")
        if module in _TOP:
            out[f"{_TOP[module]}.{end}"] = value
            continue
        m = _BLOCK_KEY.match(key)
        if m is None:
            raise KeyError(f"not a Lumina 2 key: {key}")
        kind, index, rest, end = m.groups()
        prefix = f"{kind}.{index}."
        if rest == "attention.qkv":
            head = state[f"{prefix}attention.q_norm.weight"].shape[0]
            kv = (value.shape[0] - value.shape[1]) // 2  # q is as wide as the model; k and v share the rest
            q, k, v = torch.split(value, [value.shape[0] - 2 * kv, kv, kv], dim=0)
            assert kv % head == 0, key
            out.update({f"{prefix}attn.to_q.{end}": q, f"{prefix}attn.to_k.{end}": k, f"{prefix}attn.to_v.{end}": v})
        elif rest == "attention_norm1":
            out[f"{prefix}{'norm1' if kind == 'context_refiner' else 'norm1.norm'}.{end}"] = value
        else:
            out[f"{prefix}{_BLOCK[rest]}.{end}"] = value
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers` (no prefix, as Alpha-VLLM's and ComfyUI's transformer files)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        module, _, end = key.rpartition(".")
        if module.endswith(("attn.to_k", "attn.to_v")):
            continue
        name = original_module(module)
        if module.endswith("attn.to_q"):
            value = torch.cat([state[key], state[key.replace(".to_q.", ".to_k.")],
                               state[key.replace(".to_q.", ".to_v.")]], dim=0)
        out[f"{name}.{end}"] = value
    return out


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)), default=-1)


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A Lumina2Transformer2DModel config for original-layout weights: ``base`` (a local folder's config, else the
    released model's) with the sizes the tensors tell."""
    state = {k.split("model.diffusion_model.", 1)[-1]: v for k, v in state.items()}
    cfg = dict(CONFIG, **dict(base))
    hidden, patch_in = state["x_embedder.weight"].shape
    head = int(state["layers.0.attention.q_norm.weight"].shape[0])
    qkv = int(state["layers.0.attention.qkv.weight"].shape[0])
    patch = int(cfg.get("patch_size", 2))
    cfg.update(hidden_size=int(hidden), in_channels=int(patch_in) // (patch * patch),
               num_layers=_count(state, "layers."), num_refiner_layers=_count(state, "noise_refiner."),
               num_attention_heads=int(hidden) // head, num_kv_heads=(qkv - int(hidden)) // 2 // head,
               cap_feat_dim=int(state["cap_embedder.1.weight"].shape[1]))
    if sum(cfg["axes_dim_rope"]) != head:  # rope axes fill the head (tiny models)
        t = head // 3 // 2 * 2
        cfg["axes_dim_rope"] = [head - 2 * t, t, t]
    return cfg
