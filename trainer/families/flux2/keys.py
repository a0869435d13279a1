"""Flux.2's transformer config from its weights (its single file keeps diffusers' names)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

# black-forest-labs/FLUX.2-klein-4B transformer/config.json
CONFIG: Dict[str, Any] = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128,
                          "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128, "num_attention_heads": 24,
                          "joint_attention_dim": 7680, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
                          "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": False}


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)), default=-1)


def config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    inner, in_ch = state["x_embedder.weight"].shape
    head = int(state["transformer_blocks.0.attn.norm_q.weight"].shape[0])
    cfg.update(in_channels=int(in_ch), attention_head_dim=head, num_attention_heads=int(inner) // head,
               num_layers=_count(state, "transformer_blocks."), num_single_layers=_count(state, "single_transformer_blocks."),
               joint_attention_dim=int(state["context_embedder.weight"].shape[1]),
               timestep_guidance_channels=int(state["time_guidance_embed.timestep_embedder.linear_1.weight"].shape[1]),
               guidance_embeds=any(k.startswith("time_guidance_embed.guidance_embedder.") for k in state))
    if sum(cfg["axes_dims_rope"]) != head:  # rope axes fill the head (tiny models)
        cfg["axes_dims_rope"] = [head // 4] * 4
    return cfg
