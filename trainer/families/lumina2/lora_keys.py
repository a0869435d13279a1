"""Lumina 2 LoRA files in the original layout: ``diffusion_model.<original module>.lora_A.weight`` / ``.lora_B.weight``
(α/r baked into ``lora_B``, no ``.alpha``).

Why this layout (read at ComfyUI 3cd7b32f, 2026-01-07, and diffusers 0.42.1):

- ComfyUI (comfy/lora.py ``model_lora_keys_unet``) maps ``diffusion_model.<module>`` to every weight of its own model,
  whose keys are the original layout. Its diffusers-name table for the Lumina2 model class is Z-Image's
  (comfy/utils.py ``z_image_to_diffusers``): ``attention.to_q/to_k/to_v`` slices of ``qkv`` each ``hidden`` rows wide,
  which misplaces Lumina 2's grouped k/v (768 rows each) and has no ``feed_forward.linear_N`` or ``attn.`` names: a file
  in the diffusers layout would lose or corrupt most adapters there.
- diffusers' ``Lumina2Pipeline.load_lora_weights`` converts any file whose keys start with ``diffusion_model.``
  (``_convert_non_diffusers_lumina2_lora_to_diffusers``): it gives each of q/k/v the whole ``qkv`` A and its rows of B
  (split at the released model's 2304/768/768), and it expects ``qkv``, ``out``, ``w1``-``w3`` in every block and
  ``adaLN_modulation.1`` in the modulated ones (``layers``, ``noise_refiner``); anything else fails it.

So Atelier's q/k/v LoRAs become one LoRA of the fused ``qkv`` of their summed rank (A stacked, B block-diagonal), as
Flux.2's BFL files do: ComfyUI adds B·A to the fused weight, diffusers' split gives each part its own rows, whose zero
columns cancel the other parts' A. A block module the run did not adapt but diffusers' converter expects is written
as a zero LoRA of rank 1 (it changes nothing anywhere); reading a file back skips such zero entries.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from trainer.families.lumina2.keys import original_module

PREFIX = "diffusion_model."
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
# the block modules diffusers' converter pops from every block (modulated blocks also norm1.linear)
REQUIRED = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "feed_forward.linear_1", "feed_forward.linear_2",
            "feed_forward.linear_3", "norm1.linear")

Shapes = Mapping[str, Tuple[int, int]]  # diffusers Linear path -> (out, in)


def _part(path: str) -> int:
    return next((i for i, end in enumerate(_QKV) if path.endswith(end)), -1)


def _qkv(path: str) -> list:
    """The three diffusers paths of the q/k/v Linears of ``path``'s block."""
    block = path.rsplit(".", 2)[0]
    return [f"{block}.{end}" for end in _QKV]


def to_original(state: Mapping[str, Any], linears: Shapes, prefix: str = "transformer.") -> Dict[str, Any]:
    """A diffusers-layout Lumina 2 LoRA (``{prefix}<module>.lora_A/lora_B.weight``, scale 1) in the original layout,
    with zero LoRAs for the block modules of ``linears`` (the transformer's Linears) that diffusers expects."""
    pairs: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        module, _, part = key[len(prefix):].rpartition(".lora_")
        pairs.setdefault(module, {})[part] = value
    like = next(iter(state.values()))
    wanted = {p for p in linears if p.split(".", 2)[-1] in REQUIRED and p.split(".", 1)[0] in
              ("layers", "noise_refiner", "context_refiner")}
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, str]] = {}
    for module in sorted(set(pairs) | wanted):
        name = original_module(module)
        if _part(module) >= 0:
            fused.setdefault(name, {})[_part(module)] = module
            continue
        if module in pairs:
            a, b = pairs[module]["A.weight"], pairs[module]["B.weight"]
        else:
            rows, cols = linears[module]
            a, b = like.new_zeros(1, cols), like.new_zeros(rows, 1)
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = a, b
    for name, parts in fused.items():
        modules = _qkv(next(iter(parts.values())))
        rows = [linears[m][0] if m in linears else pairs[m]["B.weight"].shape[0] for m in modules]
        trained = [m for m in modules if m in pairs]
        ranks = [pairs[m]["A.weight"].shape[0] for m in trained]
        cols = linears[modules[0]][1] if modules[0] in linears else pairs[trained[0]]["A.weight"].shape[1]
        big_a = torch.cat([pairs[m]["A.weight"] for m in trained]) if trained else like.new_zeros(1, cols)
        big_b = like.new_zeros(sum(rows), max(1, sum(ranks)))
        col = 0
        for i, m in enumerate(modules):
            if m in pairs:
                r = pairs[m]["A.weight"].shape[0]
                big_b[sum(rows[:i]):sum(rows[:i + 1]), col:col + r] = pairs[m]["B.weight"]
                col += r
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = big_a, big_b
    return out


def from_original(state: Mapping[str, Any], ranks: Mapping[str, int], linears: Shapes,
                  prefix: str = "transformer.") -> Tuple[Dict[str, Any], set]:
    """An original-layout file as diffusers-layout tensors for the adapters of ``ranks`` (diffusers module path -> its
    rank): the inverse of :func:`to_original`; a fused ``qkv`` of the parts' rank (shared A, as diffusers reads it and
    other trainers write it) is read too. Returns the tensors and the file keys read; ValueError when a fused LoRA fits
    neither."""
    out: Dict[str, Any] = {}
    used: set = set()
    fused: Dict[str, Dict[int, Tuple[str, int]]] = {}
    for module, rank in ranks.items():
        name = original_module(module)
        if _part(module) >= 0:
            fused.setdefault(name, {})[_part(module)] = (module, rank)
            continue
        keys = (f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight")
        if all(k in state for k in keys):
            out[f"{prefix}{module}.lora_A.weight"], out[f"{prefix}{module}.lora_B.weight"] = (state[k] for k in keys)
            used.update(keys)
    for name, parts in fused.items():
        keys = (f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight")
        if not all(k in state for k in keys):
            continue
        a, b = (state[k] for k in keys)
        used.update(keys)
        modules = _qkv(next(iter(parts.values()))[0])
        rows = [linears[m][0] for m in modules] if all(m in linears for m in modules) else [b.shape[0] // 3] * 3
        total = sum(rank for _, rank in parts.values())
        col = 0
        for i in range(3):
            if i not in parts:
                continue
            module, rank = parts[i]
            row = slice(sum(rows[:i]), sum(rows[:i + 1]))
            if a.shape[0] == total:
                part_a, part_b = a[col:col + rank], b[row, col:col + rank]
            elif a.shape[0] == rank:
                part_a, part_b = a, b[row]
            else:
                raise ValueError(f"{PREFIX}{name} has rank {a.shape[0]}: neither the adapters' summed rank {total} nor "
                                 f"their rank {rank}")
            out[f"{prefix}{module}.lora_A.weight"] = part_a.clone()
            out[f"{prefix}{module}.lora_B.weight"] = part_b.clone()
            col += rank
    return out, used


def zero_entries(state: Mapping[str, Any]) -> set:
    """The keys of zero LoRAs (the padding :func:`to_original` writes for diffusers' converter)."""
    zero = set()
    for key, value in state.items():
        if key.endswith(".lora_B.weight") and not torch.count_nonzero(value):
            zero.update({key, key.replace(".lora_B.", ".lora_A.")})
    return zero
