"""Flux.2 LoRA files in the original BFL layout: ``diffusion_model.<BFL module>.lora_A.weight`` / ``.lora_B.weight``
(α/r baked into ``lora_B``, no ``.alpha``).

Why this layout: ComfyUI maps a LoRA key ``diffusion_model.<module>`` to every weight of its own (BFL-named) model
(comfy/lora.py ``model_lora_keys_unet``, its generic entries), while its diffusers → BFL table for the Flux models
(comfy/utils.py ``flux_to_diffusers``, read at upstream 3cd7b32f, 2026-01-07) has no Flux.2 entries: a file in the
diffusers layout loses its ``ff.linear_in/out``, ``ff_context.*``, ``to_qkv_mlp_proj`` and single-block ``to_out``
adapters there. diffusers reads this layout too: ``Flux2LoraLoaderMixin.lora_state_dict`` converts any file whose
keys start with ``diffusion_model.`` (``_convert_non_diffusers_flux2_lora_to_diffusers``).

The names are those of diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` (one-to-one but for the
double blocks' fused q/k/v). Atelier trains q, k and v as three LoRAs; BFL has one ``qkv`` Linear, so the three are
written as one LoRA of their summed rank: ``lora_A`` the parts' A stacked, ``lora_B`` block-diagonal (part i's B in
rows i·h…(i+1)·h and its own columns). ComfyUI adds B·A to the fused weight, which is each part's B·A in its rows;
diffusers gives each of q/k/v the whole A and its third of B's rows, whose zero columns cancel the other parts' A.
The final norm's Linear stores (shift, scale) in BFL and (scale, shift) in diffusers: its B's row halves swap.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

PREFIX = "diffusion_model."
_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
           "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
           "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
        "norm_out.linear": "final_layer.adaLN_modulation.1",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin"}
_SWAPPED = "norm_out.linear"  # AdaLayerNormContinuous: BFL (shift, scale), diffusers (scale, shift)
_PART_OF = {part: (bfl, i) for bfl, parts in _FUSED.items() for i, part in enumerate(parts)}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_module(path: str) -> Tuple[str, Optional[int]]:
    """A diffusers ``Flux2Transformer2DModel`` module path -> (its BFL module, its index among the fused q/k/v or
    None). KeyError for a module BFL has no Linear for."""
    m = _BLOCK.match(path)
    if m is None:
        return _TOP[path], None
    kind, index, rest = m.groups()
    if kind == "single_transformer_blocks":
        return f"single_blocks.{index}.{_SINGLE[rest]}", None
    if rest in _PART_OF:
        bfl, part = _PART_OF[rest]
        return f"double_blocks.{index}.{bfl}", part
    return f"double_blocks.{index}.{_DOUBLE[rest]}", None


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def to_bfl(state: Mapping[str, Any], prefix: str = "transformer.") -> Dict[str, Any]:
    """A diffusers-layout Flux.2 LoRA (``{prefix}<module>.lora_A/lora_B.weight``, scale 1) in the BFL layout."""
    pairs: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        module, _, part = key[len(prefix):].rpartition(".lora_")
        pairs.setdefault(module, {})[part] = value
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, Tuple[Any, Any]]] = {}
    for module, ab in sorted(pairs.items()):
        a, b = ab["A.weight"], ab["B.weight"]
        name, part = bfl_module(module)
        if part is not None:
            fused.setdefault(name, {})[part] = (a, b)
            continue
        out[f"{PREFIX}{name}.lora_A.weight"] = a
        out[f"{PREFIX}{name}.lora_B.weight"] = _swap_halves(b) if module == _SWAPPED else b
    for name, parts in fused.items():
        a0, b0 = next(iter(parts.values()))
        rows, ranks = b0.shape[0], sum(a.shape[0] for a, _ in parts.values())
        big_b = b0.new_zeros(3 * rows, ranks)
        col = 0
        for i in sorted(parts):
            a, b = parts[i]
            big_b[i * rows:(i + 1) * rows, col:col + a.shape[0]] = b
            col += a.shape[0]
        out[f"{PREFIX}{name}.lora_A.weight"] = torch.cat([parts[i][0] for i in sorted(parts)], dim=0)
        out[f"{PREFIX}{name}.lora_B.weight"] = big_b
    return out


def from_bfl(state: Mapping[str, Any], ranks: Mapping[str, int], prefix: str = "transformer.") -> Dict[str, Any]:
    """A BFL-layout Flux.2 LoRA as diffusers-layout tensors for the modules of ``ranks`` (diffusers module path ->
    the rank of its fresh adapter): the inverse of :func:`to_bfl`. A fused q/k/v LoRA is split by those ranks (the
    layout :func:`to_bfl` writes), or, when its rank is each part's rank, shared as diffusers shares it (other
    trainers' files). Keys the modules do not ask for are left out; ValueError when a fused LoRA fits neither."""
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, Tuple[str, int]]] = {}
    for module, rank in ranks.items():
        name, part = bfl_module(module)
        if part is not None:
            fused.setdefault(name, {})[part] = (module, rank)
            continue
        a, b = state.get(f"{PREFIX}{name}.lora_A.weight"), state.get(f"{PREFIX}{name}.lora_B.weight")
        if a is None or b is None:
            continue
        out[f"{prefix}{module}.lora_A.weight"] = a
        out[f"{prefix}{module}.lora_B.weight"] = _swap_halves(b) if module == _SWAPPED else b
    for name, parts in fused.items():
        a, b = state.get(f"{PREFIX}{name}.lora_A.weight"), state.get(f"{PREFIX}{name}.lora_B.weight")
        if a is None or b is None:
            continue
        rows = b.shape[0] // 3
        total = sum(rank for _, rank in parts.values())
        col = 0
        for i in sorted(parts):
            module, rank = parts[i]
            if a.shape[0] == total:
                part_a, part_b = a[col:col + rank], b[i * rows:(i + 1) * rows, col:col + rank]
            elif a.shape[0] == rank:
                part_a, part_b = a, b[i * rows:(i + 1) * rows]
            else:
                raise ValueError(f"{PREFIX}{name} has rank {a.shape[0]}: neither the adapters' summed rank {total} nor "
                                 f"their rank {rank}")
            out[f"{prefix}{module}.lora_A.weight"] = part_a.clone()
            out[f"{prefix}{module}.lora_B.weight"] = part_b.clone()
            col += rank
    return out


def used_keys(state: Mapping[str, Any], ranks: Mapping[str, int]) -> set:
    """The BFL file keys the modules of ``ranks`` read."""
    names = {bfl_module(module)[0] for module in ranks}
    return {k for k in state if k.startswith(PREFIX) and k[len(PREFIX):].rpartition(".lora_")[0] in names}
