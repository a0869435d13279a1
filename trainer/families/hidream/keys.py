"""HiDream-I1 transformer keys. The original single file (HiDream-ai's checkpoints, ComfyUI's ``hidream`` model) has
diffusers' own module names, with or without ComfyUI's ``model.diffusion_model.`` prefix: diffusers' converter
(``convert_hidream_transformer_to_diffusers``) only strips that prefix. So the layout maps are the identity; what a
file does not say (head width, RoPE axes, the Llama layers each block reads) comes from the released config."""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Tuple

PREFIX = "model.diffusion_model."
# HiDream-ai/HiDream-I1-Full (and -Dev, -Fast: the same transformer config) transformer/config.json
CONFIG: Dict[str, Any] = {
    "_class_name": "HiDreamImageTransformer2DModel", "patch_size": 2, "in_channels": 16, "out_channels": 16,
    "num_layers": 16, "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
    "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4, "num_activated_experts": 2,
    "axes_dims_rope": [64, 32, 32], "max_resolution": [128, 128],
    # the Llama-3.1 layer (of hidden_states[1:]) each of the 16 + 32 blocks reads
    "llama_layers": [0, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30] + [31] * 30,
}
_BLOCK = re.compile(r"^(double_stream_blocks|single_stream_blocks)\.(\d+)\.")
_EXPERT = re.compile(r"\.ff_i\.experts\.(\d+)\.")


def strip_prefix(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors (with or without ComfyUI's prefix) as diffusers' (the same names)."""
    return {k.split(PREFIX, 1)[-1]: v for k, v in state.items()}


def config_from_original(state: Mapping[str, Any], base: Dict[str, Any]) -> Dict[str, Any]:
    """The transformer config of a file's tensors: the sizes the tensors carry (width, depth, experts, text widths),
    the rest from ``base`` (a local ``transformer/config.json``) or the released config."""
    shapes: Dict[str, Tuple[int, ...]] = {k: tuple(v.shape) for k, v in strip_prefix(state).items()}
    cfg = {k: v for k, v in {**CONFIG, **(base or {})}.items() if not k.startswith("_")}
    depth = {"double_stream_blocks": set(), "single_stream_blocks": set()}
    for k in shapes:
        m = _BLOCK.match(k)
        if m:
            depth[m.group(1)].add(int(m.group(2)))
    inner, patch_in = shapes["x_embedder.proj.weight"]
    n_caption = len({k.split(".")[1] for k in shapes if k.startswith("caption_projection.")})
    cfg.update(num_layers=len(depth["double_stream_blocks"]), num_single_layers=len(depth["single_stream_blocks"]),
               text_emb_dim=shapes["p_embedder.pooled_embedder.linear_1.weight"][1],
               caption_channels=[shapes[f"caption_projection.{n_caption - 1}.linear.weight"][1],
                                 shapes["caption_projection.0.linear.weight"][1]],
               num_routed_experts=len({m.group(1) for k in shapes if (m := _EXPERT.search(k))}) or
               cfg["num_routed_experts"])
    if inner != cfg["num_attention_heads"] * cfg["attention_head_dim"]:
        cfg["num_attention_heads"] = inner // cfg["attention_head_dim"]
    cfg["in_channels"] = patch_in // (cfg["patch_size"] ** 2)
    cfg["out_channels"] = shapes["final_layer.linear.weight"][0] // (cfg["patch_size"] ** 2)
    return cfg
