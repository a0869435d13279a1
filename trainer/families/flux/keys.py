"""Flux.1 transformer keys: the BFL ↔ diffusers map is shared with Chroma (families/common/bfl_keys.py); the
config a BFL file describes is Flux's own."""

from __future__ import annotations

from typing import Dict

from trainer.families.common.bfl_keys import bfl_to_diffusers, block_count, diffusers_to_bfl, strip_prefix

__all__ = ["bfl_to_diffusers", "config_from_bfl", "diffusers_to_bfl", "strip_prefix"]


def config_from_bfl(state: Dict[str, "object"], base: dict) -> dict:
    """A ``FluxTransformer2DModel`` config for BFL weights: ``base`` (the shipped real-size config of the
    variant) with the sizes the tensors tell (so a file of another width or depth loads too)."""
    state = strip_prefix(state)
    cfg = dict(base)
    hidden, in_ch = state["img_in.weight"].shape
    head_dim = state["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
    cfg.update(in_channels=int(in_ch), num_layers=block_count(state, "double_blocks"),
               num_single_layers=block_count(state, "single_blocks"), attention_head_dim=int(head_dim),
               num_attention_heads=int(hidden // head_dim), joint_attention_dim=int(state["txt_in.weight"].shape[1]),
               pooled_projection_dim=int(state["vector_in.in_layer.weight"].shape[1]),
               guidance_embeds="guidance_in.in_layer.weight" in state)
    if sum(cfg.get("axes_dims_rope", ())) != head_dim:  # rope axes must fill the head (tiny models)
        t = head_dim // 8 * 2
        cfg["axes_dims_rope"] = [head_dim - 2 * ((head_dim - t) // 2), (head_dim - t) // 2, (head_dim - t) // 2]
    return cfg
