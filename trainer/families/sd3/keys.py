"""SD3/3.5 transformer keys: diffusers' ``SD3Transformer2DModel`` ↔ Stability's single file (the MMDiT as
``joint_blocks.N.{x_block,context_block}…``, files carry ``model.diffusion_model.`` before it). Original → diffusers
is diffusers' own ``convert_sd3_transformer_checkpoint_to_diffusers``; :func:`diffusers_to_original` is its exact
inverse: q/k/v concatenated back into ``qkv``, ``to_out.0``/``to_add_out`` → ``proj``, the last block's context
adaLN and the final layer's adaLN halves swapped back (``swap_scale_shift`` is its own inverse), the last block's
context stream without proj/mlp (``context_pre_only``), SD3.5's q/k RMSNorm and 3.5 medium's second attention."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

ORIGINAL_PREFIX = "model.diffusion_model."

# transformer/config.json of the diffusers repos (stabilityai/stable-diffusion-3.5-large, -3.5-medium,
# -3-medium-diffusers)
CONFIG_35_LARGE: Dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
    "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192, "qk_norm": "rms_norm",
    "dual_attention_layers": []}
CONFIG_35_MEDIUM: Dict[str, Any] = dict(CONFIG_35_LARGE, num_layers=24, num_attention_heads=24,
                                        caption_projection_dim=1536, pos_embed_max_size=384,
                                        dual_attention_layers=list(range(13)))
CONFIG_3_MEDIUM: Dict[str, Any] = dict(CONFIG_35_LARGE, num_layers=24, num_attention_heads=24,
                                       caption_projection_dim=1536, qk_norm=None)


def _swap(t):
    """diffusers' ``swap_scale_shift`` (shift ‖ scale ↔ scale ‖ shift), its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def is_sd3_original(keys) -> bool:
    return any(k.split(ORIGINAL_PREFIX, 1)[-1] == "joint_blocks.0.x_block.attn.qkv.weight" for k in keys)


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Stability's layout (prefixed or not) → diffusers, by diffusers' own converter."""
    return convert_sd3_transformer_checkpoint_to_diffusers(dict(state))


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """diffusers → Stability's layout (without the prefix)."""
    s = dict(state)
    n = 1 + max(int(k.split(".")[1]) for k in s if k.startswith("transformer_blocks."))
    out: Dict[str, Any] = {
        "pos_embed": s.pop("pos_embed.pos_embed"), "x_embedder.proj.weight": s.pop("pos_embed.proj.weight"),
        "x_embedder.proj.bias": s.pop("pos_embed.proj.bias"),
        "context_embedder.weight": s.pop("context_embedder.weight"), "context_embedder.bias": s.pop("context_embedder.bias"),
        "final_layer.linear.weight": s.pop("proj_out.weight"), "final_layer.linear.bias": s.pop("proj_out.bias"),
        "final_layer.adaLN_modulation.1.weight": _swap(s.pop("norm_out.linear.weight")),
        "final_layer.adaLN_modulation.1.bias": _swap(s.pop("norm_out.linear.bias"))}
    for ours, theirs in (("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                         ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                         ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                         ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2")):
        for p in ("weight", "bias"):
            out[f"{ours}.{p}"] = s.pop(f"{theirs}.{p}")
    for i in range(n):
        d, o = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        last = i == n - 1
        for p in ("weight", "bias"):
            out[f"{o}x_block.attn.qkv.{p}"] = torch.cat([s.pop(f"{d}attn.to_{x}.{p}") for x in "qkv"])
            out[f"{o}context_block.attn.qkv.{p}"] = torch.cat([s.pop(f"{d}attn.add_{x}_proj.{p}") for x in "qkv"])
            out[f"{o}x_block.attn.proj.{p}"] = s.pop(f"{d}attn.to_out.0.{p}")
            out[f"{o}x_block.adaLN_modulation.1.{p}"] = s.pop(f"{d}norm1.linear.{p}")
            ctx = s.pop(f"{d}norm1_context.linear.{p}")
            out[f"{o}context_block.adaLN_modulation.1.{p}"] = _swap(ctx) if last else ctx
            out[f"{o}x_block.mlp.fc1.{p}"] = s.pop(f"{d}ff.net.0.proj.{p}")
            out[f"{o}x_block.mlp.fc2.{p}"] = s.pop(f"{d}ff.net.2.{p}")
            if not last:
                out[f"{o}context_block.attn.proj.{p}"] = s.pop(f"{d}attn.to_add_out.{p}")
                out[f"{o}context_block.mlp.fc1.{p}"] = s.pop(f"{d}ff_context.net.0.proj.{p}")
                out[f"{o}context_block.mlp.fc2.{p}"] = s.pop(f"{d}ff_context.net.2.{p}")
            if f"{d}attn2.to_q.{p}" in s:  # 3.5 medium's second attention (MMDiT-X)
                out[f"{o}x_block.attn2.qkv.{p}"] = torch.cat([s.pop(f"{d}attn2.to_{x}.{p}") for x in "qkv"])
                out[f"{o}x_block.attn2.proj.{p}"] = s.pop(f"{d}attn2.to_out.0.{p}")
        for ours, theirs in (("x_block.attn.ln_q", "attn.norm_q"), ("x_block.attn.ln_k", "attn.norm_k"),
                             ("context_block.attn.ln_q", "attn.norm_added_q"),
                             ("context_block.attn.ln_k", "attn.norm_added_k"),
                             ("x_block.attn2.ln_q", "attn2.norm_q"), ("x_block.attn2.ln_k", "attn2.norm_k")):
            if f"{d}{theirs}.weight" in s:  # SD3.5's q/k RMSNorm
                out[f"{o}{ours}.weight"] = s.pop(f"{d}{theirs}.weight")
    if s:
        raise KeyError(f"diffusers SD3 keys without an original name: {sorted(s)[:5]}")
    return out


def config_from_original(shapes: Mapping[str, Tuple[int, ...]], base: Mapping[str, Any]) -> Dict[str, Any]:
    """An SD3Transformer2DModel config corrected by the single file's shapes (unprefixed keys); attention heads keep
    the base's head width."""
    cfg = dict(base)
    inner, in_ch, patch, _ = shapes["x_embedder.proj.weight"]
    cfg.update(in_channels=int(in_ch), patch_size=int(patch),
               num_attention_heads=int(inner) // int(base.get("attention_head_dim", 64)),
               num_layers=1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("joint_blocks.")),
               caption_projection_dim=int(shapes["context_embedder.weight"][0]),
               joint_attention_dim=int(shapes["context_embedder.weight"][1]),
               pooled_projection_dim=int(shapes["y_embedder.mlp.0.weight"][1]),
               out_channels=int(shapes["final_layer.linear.weight"][0]) // int(patch) ** 2,
               pos_embed_max_size=int(round(int(shapes["pos_embed"][1]) ** 0.5)),
               qk_norm="rms_norm" if any(".attn.ln_q." in k for k in shapes) else None,
               dual_attention_layers=sorted({int(k.split(".")[1]) for k in shapes if ".x_block.attn2." in k}))
    return cfg
