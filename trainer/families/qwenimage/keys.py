"""Qwen-Image's transformer config from its weights (the single file keeps diffusers' names), and the keys a file
carries that are no weights (ComfyUI's 2511 marker)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

# Qwen/Qwen-Image transformer/config.json (QwenImageTransformer2DModel's defaults are that model)
CONFIG: Dict[str, Any] = {"_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64,
                          "out_channels": 16, "num_layers": 60, "attention_head_dim": 128, "num_attention_heads": 24,
                          "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}


def config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    inner, in_ch = state["img_in.weight"].shape
    head = int(state["transformer_blocks.0.attn.norm_q.weight"].shape[0])
    cfg.update(in_channels=int(in_ch), attention_head_dim=head, num_attention_heads=int(inner) // head,
               num_layers=1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")),
               joint_attention_dim=int(state["txt_in.weight"].shape[1]),
               out_channels=int(state["proj_out.weight"].shape[0]) // int(cfg["patch_size"]) ** 2,
               guidance_embeds=any(k.startswith("time_text_embed.guidance_embedder.") for k in state))
    if sum(cfg["axes_dims_rope"]) != head:  # rope axes fill the head (tiny models)
        t = head // 8 * 2
        cfg["axes_dims_rope"] = [t, (head - t) // 2, head - t - (head - t) // 2]
    return cfg


def without_marker(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The file's tensors less ComfyUI's ``__index_timestep_zero__`` (an empty marker of its 2511 files, no weight)."""
    return {k: v for k, v in state.items() if k != "__index_timestep_zero__"}
