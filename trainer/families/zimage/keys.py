"""Z-Image transformer keys: the original single file ↔ diffusers' ``ZImageTransformer2DModel``. Original →
diffusers is diffusers' own ``convert_z_image_transformer_checkpoint_to_diffusers``; :func:`diffusers_to_original`
inverts it (``qkv`` fused again, ``out``/``q_norm``/``k_norm``, ``x_embedder.``/``final_layer.`` for patch 2)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

# Tongyi-MAI/Z-Image-Turbo transformer/config.json (ZImageTransformer2DModel's defaults are that model)
CONFIG: Dict[str, Any] = {"_class_name": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1],
                          "in_channels": 16, "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                          "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0,
                          "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512]}
_RENAMES = ((".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
            (".attention.norm_q.", ".attention.q_norm."))


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in state.items():
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        if ".attention.to_q." in k:
            parts = [state[k.replace(".to_q.", f".to_{x}.")] for x in "qkv"]
            out[k.replace(".attention.to_q.", ".attention.qkv.")] = torch.cat(parts, dim=0)
            continue
        for ours, theirs in _RENAMES:
            k = k.replace(ours, theirs)
        k = k.replace("all_final_layer.2-1.", "final_layer.").replace("all_x_embedder.2-1.", "x_embedder.")
        out[k] = v
    return out


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)), default=-1)


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A ZImageTransformer2DModel config for original-layout weights: ``base`` with the sizes the tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    dim, patch_in = state["x_embedder.weight"].shape
    head = int(state["layers.0.attention.q_norm.weight"].shape[0])
    qkv = int(state["layers.0.attention.qkv.weight"].shape[0])
    cfg.update(dim=int(dim), in_channels=int(patch_in) // 4, n_layers=_count(state, "layers."),
               n_refiner_layers=_count(state, "noise_refiner."), n_heads=int(dim) // head,
               n_kv_heads=(qkv - int(dim)) // 2 // head, cap_feat_dim=int(state["cap_embedder.1.weight"].shape[1]))
    if sum(cfg["axes_dims"]) != head:  # rope axes fill the head (tiny models)
        t = head // 8 * 2
        cfg["axes_dims"] = [t, (head - t) // 2, head - t - (head - t) // 2]
    return cfg
