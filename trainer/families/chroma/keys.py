"""Chroma's config from an original single file (the key map itself is Flux's, families/common/bfl_keys.py)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

# lodestones/Chroma1-HD transformer/config.json (ChromaTransformer2DModel's defaults are that model)
CONFIG: Dict[str, Any] = {"_class_name": "ChromaTransformer2DModel", "patch_size": 1, "in_channels": 64,
                          "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
                          "joint_attention_dim": 4096, "axes_dims_rope": [16, 56, 56], "approximator_num_channels": 64,
                          "approximator_hidden_dim": 5120, "approximator_layers": 5}


def _blocks(state: Mapping[str, Any], kind: str) -> int:
    return 1 + max((int(k.split(".")[1]) for k in state if k.startswith(kind + ".")), default=-1)


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A ``ChromaTransformer2DModel`` config for original-layout weights (unprefixed): ``base`` (a diffusers
    config, or the released model's) with the sizes the tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    hidden, in_ch = state["img_in.weight"].shape
    head_dim = int(state["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0])
    approx = state["distilled_guidance_layer.in_proj.weight"].shape
    cfg.update(in_channels=int(in_ch), num_layers=_blocks(state, "double_blocks"),
               num_single_layers=_blocks(state, "single_blocks"), attention_head_dim=head_dim,
               num_attention_heads=int(hidden) // head_dim, joint_attention_dim=int(state["txt_in.weight"].shape[1]),
               approximator_num_channels=int(approx[1]), approximator_hidden_dim=int(approx[0]),
               approximator_layers=1 + max(int(k.split(".")[2]) for k in state
                                           if k.startswith("distilled_guidance_layer.layers.")))
    if sum(cfg.get("axes_dims_rope", ())) != head_dim:  # rope axes must fill the head (tiny models)
        t = head_dim // 8 * 2
        cfg["axes_dims_rope"] = [head_dim - 2 * ((head_dim - t) // 2), (head_dim - t) // 2, (head_dim - t) // 2]
    return cfg
