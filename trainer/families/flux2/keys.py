"""Flux.2 transformer files: its config from its weights, and the original (BFL) layout both ways.

Fine-tunes are written in BFL's layout (``img_in``, ``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1`` …,
no prefix), as BFL's released files are: ComfyUI's model detection (``comfy/model_detection.py``) tells Flux.2 by
``double_stream_modulation_img.lin.weight`` and sizes it from ``img_in``/``txt_in`` and the block counts, and
diffusers' ``Flux2Transformer2DModel.from_single_file`` converts it
(``convert_flux2_transformer_checkpoint_to_diffusers``). A file under diffusers' names fails ComfyUI's detection.
Files in either layout load here; :func:`to_diffusers` is diffusers' own converter, :func:`diffusers_to_bfl` its
inverse (the Linear names of ``lora_keys.bfl_module``, the q/k/v norms' ``.scale``, q/k/v fused by rows, the final
norm's (scale, shift) halves swapped to (shift, scale))."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping

import torch
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from trainer.families.flux2.lora_keys import bfl_module

# black-forest-labs/FLUX.2-klein-4B transformer/config.json
CONFIG: Dict[str, Any] = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128,
                          "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128, "num_attention_heads": 24,
                          "joint_attention_dim": 7680, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
                          "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": False}

BFL_MARKER = "double_stream_modulation_img.lin.weight"  # what ComfyUI and diffusers tell a BFL Flux.2 file by
_NORMS = {"transformer_blocks": {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                                 "attn.norm_added_q": "txt_attn.norm.query_norm",
                                 "attn.norm_added_k": "txt_attn.norm.key_norm"},
          "single_transformer_blocks": {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}}
_BLOCKS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks"}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_SWAPPED = "norm_out.linear"  # AdaLayerNormContinuous: BFL (shift, scale), diffusers (scale, shift)


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)), default=-1)


def to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """A transformer file's tensors under diffusers' names: a BFL file through diffusers' own converter, a file
    already under diffusers' names as it is."""
    if BFL_MARKER not in state:
        return dict(state)
    return convert_flux2_transformer_checkpoint_to_diffusers(dict(state))  # (it empties the dict it is given)


def diffusers_to_bfl(state: Mapping[str, Any]) -> Dict[str, Any]:
    """A ``Flux2Transformer2DModel`` state dict in BFL's layout, the inverse of diffusers' converter."""
    out: Dict[str, Any] = {}
    fused: Dict[str, List[Any]] = {}
    for key, tensor in state.items():
        module, param = key.rsplit(".", 1)
        m = _BLOCK.match(module)
        if m is not None and m.group(3) in _NORMS[m.group(1)]:
            out[f"{_BLOCKS[m.group(1)]}.{m.group(2)}.{_NORMS[m.group(1)][m.group(3)]}.scale"] = tensor
            continue
        bfl, part = bfl_module(module)
        if part is not None:
            fused.setdefault(f"{bfl}.{param}", [None, None, None])[part] = tensor
        elif module == _SWAPPED:
            scale, shift = tensor.chunk(2, dim=0)
            out[f"{bfl}.{param}"] = torch.cat([shift, scale], dim=0)
        else:
            out[f"{bfl}.{param}"] = tensor
    for key, parts in fused.items():
        if any(p is None for p in parts):
            raise KeyError(f"{key}: q, k and v are fused in BFL's layout, and the state has only some of them")
        out[key] = torch.cat(parts, dim=0)
    return out


def config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the tensors tell (either layout)."""
    if BFL_MARKER in state:
        state = to_diffusers(state)
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
