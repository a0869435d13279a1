"""HunyuanImage 2.1 transformer keys: Tencent's original single file (``tencent/HunyuanImage-2.1``'s
``dit/hunyuanimage2.1.safetensors``, the file ComfyUI's diffusion-model loader reads, with or without
``model.diffusion_model.``) ↔ diffusers' ``HunyuanImageTransformer2DModel``.

The renames are diffusers' ``scripts/convert_hunyuan_image_to_diffusers.py`` (huggingface/diffusers 58eb52c0) both ways.
Three kinds of tensors are not one-to-one renames: the double blocks' ``img_attn_qkv``/``txt_attn_qkv`` and the token
refiner's ``self_attn_qkv`` hold q, k, v stacked (diffusers: three Linears); a single block's ``linear1`` holds q, k, v
and the MLP's input (``linear2`` is ``proj_out``); the final layer's ``adaLN_modulation.1`` is (shift, scale) where
diffusers' ``norm_out.linear`` is (scale, shift)."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Tuple

import torch

# hunyuanvideo-community/HunyuanImage-2.1-Diffusers transformer/config.json (the released base model)
CONFIG: Dict[str, Any] = {"_class_name": "HunyuanImageTransformer2DModel", "in_channels": 64, "out_channels": 64,
                          "num_attention_heads": 28, "attention_head_dim": 128, "num_layers": 20,
                          "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": [1, 1],
                          "qk_norm": "rms_norm", "guidance_embeds": False, "text_embed_dim": 3584,
                          "text_embed_2_dim": 1472, "rope_theta": 256.0, "rope_axes_dim": [64, 64],
                          "use_meanflow": False}

_TOP = {"img_in.proj": "x_embedder.proj", "txt_in.input_embedder": "context_embedder.proj_in",
        "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
        "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
        "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
        "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
        "byt5_in.layernorm": "context_embedder_2.norm", "byt5_in.fc1": "context_embedder_2.linear_1",
        "byt5_in.fc2": "context_embedder_2.linear_2", "byt5_in.fc3": "context_embedder_2.linear_3",
        "time_in.mlp.0": "time_guidance_embed.timestep_embedder.linear_1",
        "time_in.mlp.2": "time_guidance_embed.timestep_embedder.linear_2",
        "time_r_in.mlp.0": "time_guidance_embed.timestep_embedder_r.linear_1",
        "time_r_in.mlp.2": "time_guidance_embed.timestep_embedder_r.linear_2",
        "guidance_in.mlp.0": "time_guidance_embed.guidance_embedder.linear_1",
        "guidance_in.mlp.2": "time_guidance_embed.guidance_embedder.linear_2",
        "final_layer.linear": "proj_out"}
_REFINER = {"norm1": "norm1", "norm2": "norm2", "self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj",
            "mlp.fc2": "ff.net.2", "adaLN_modulation.1": "norm_out.linear"}
_DOUBLE = {"img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
           "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k", "img_attn_proj": "attn.to_out.0",
           "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2", "txt_attn_q_norm": "attn.norm_added_q",
           "txt_attn_k_norm": "attn.norm_added_k", "txt_attn_proj": "attn.to_add_out",
           "txt_mlp.fc1": "ff_context.net.0.proj", "txt_mlp.fc2": "ff_context.net.2"}
_SINGLE = {"modulation.linear": "norm.linear", "q_norm": "attn.norm_q", "k_norm": "attn.norm_k",
           "linear2": "proj_out"}
# fused original Linears -> the diffusers Linears they stack, in order
FUSED = {"refiner": {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")},
         "double": {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")},
         "single": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}}
_BLOCKS = {"refiner": ("txt_in.individual_token_refiner.blocks", "context_embedder.token_refiner.refiner_blocks",
                       _REFINER),
           "double": ("double_blocks", "transformer_blocks", _DOUBLE),
           "single": ("single_blocks", "single_transformer_blocks", _SINGLE)}
_ORIG = re.compile(r"^(txt_in\.individual_token_refiner\.blocks|double_blocks|single_blocks)\.(\d+)\.(.+)$")
_DIFF = re.compile(r"^(context_embedder\.token_refiner\.refiner_blocks|transformer_blocks|single_transformer_blocks)"
                   r"\.(\d+)\.(.+)$")
_KIND = {v[0]: k for k, v in _BLOCKS.items()}
_DKIND = {v[1]: k for k, v in _BLOCKS.items()}
_INV_TOP = {v: k for k, v in _TOP.items()}


def original_module(path: str) -> Tuple[str, int, int]:
    """A diffusers module path's original module, and the part of it it is (index, count: 0, 1 for a renamed one).
    KeyError: a module the original layout does not have."""
    m = _DIFF.match(path)
    if not m:
        return _INV_TOP[path], 0, 1
    kind = _DKIND[m.group(1)]
    orig_prefix, _, table = _BLOCKS[kind]
    inner = m.group(3)
    for fused, parts in FUSED[kind].items():
        if inner in parts:
            return f"{orig_prefix}.{m.group(2)}.{fused}", parts.index(inner), len(parts)
    return f"{orig_prefix}.{m.group(2)}.{({v: k for k, v in table.items()})[inner]}", 0, 1


def fused_parts(module: str) -> List[str]:
    """An original module's diffusers modules, in stacking order (one for a renamed module). KeyError: unknown."""
    m = _ORIG.match(module)
    if not m:
        return [_TOP[module]]
    kind = _KIND[m.group(1)]
    _, diff_prefix, table = _BLOCKS[kind]
    inner = m.group(3)
    if inner in FUSED[kind]:
        return [f"{diff_prefix}.{m.group(2)}.{p}" for p in FUSED[kind][inner]]
    return [f"{diff_prefix}.{m.group(2)}.{table[inner]}"]


def _split_sizes(state: Mapping[str, Any], parts: List[str], suffix: str) -> List[int]:
    return [int(state[f"{p}.{suffix}"].shape[0]) for p in parts]


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The original file's tensors (``model.diffusion_model.`` already removed) under diffusers' names."""
    out: Dict[str, Any] = {}
    hidden = int(state["img_in.proj.weight"].shape[0])
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        if module == "final_layer.adaLN_modulation.1":
            shift, scale = value.chunk(2, dim=0)
            out[f"norm_out.linear.{param}"] = torch.cat([scale, shift], dim=0)
            continue
        parts = fused_parts(module)
        if len(parts) == 1:
            out[f"{parts[0]}.{param}"] = value
            continue
        sizes = [hidden] * 3 + ([value.shape[0] - 3 * hidden] if len(parts) == 4 else [])
        for name, piece in zip(parts, torch.split(value, sizes, dim=0)):
            out[f"{name}.{param}"] = piece
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers`: the original single file's tensors."""
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, Any]] = {}
    counts: Dict[str, int] = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        if module == "norm_out.linear":
            scale, shift = value.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{param}"] = torch.cat([shift, scale], dim=0)
            continue
        name, index, count = original_module(module)
        if count == 1:
            out[f"{name}.{param}"] = value
            continue
        fused.setdefault(f"{name}.{param}", {})[index] = value
        counts[f"{name}.{param}"] = count
    for key, pieces in fused.items():
        out[key] = torch.cat([pieces[i] for i in range(counts[key])], dim=0)
    return out


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the original file's tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    hidden, in_ch = state["img_in.proj.weight"].shape[:2]
    head = int(state["double_blocks.0.img_attn_q_norm.weight"].shape[0])

    def count(prefix: str) -> int:
        found = [int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)]
        return 1 + max(found) if found else 0

    mlp = int(state["double_blocks.0.img_mlp.fc1.weight"].shape[0])
    cfg.update(in_channels=int(in_ch), out_channels=int(state["final_layer.linear.weight"].shape[0]),
               attention_head_dim=head, num_attention_heads=int(hidden) // head, mlp_ratio=mlp / int(hidden),
               num_layers=count("double_blocks."), num_single_layers=count("single_blocks."),
               num_refiner_layers=count("txt_in.individual_token_refiner.blocks."),
               text_embed_dim=int(state["txt_in.input_embedder.weight"].shape[1]),
               text_embed_2_dim=int(state["byt5_in.fc1.weight"].shape[1]) if "byt5_in.fc1.weight" in state else None,
               guidance_embeds="guidance_in.mlp.0.weight" in state, use_meanflow="time_r_in.mlp.0.weight" in state)
    if sum(cfg["rope_axes_dim"]) != head:  # rope axes fill the head (tiny models)
        cfg["rope_axes_dim"] = [head // 2, head - head // 2]
    return cfg
