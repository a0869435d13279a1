"""Ideogram 4 LoRA files in the original layout: ``diffusion_model.<original module>.lora_A.weight`` /
``.lora_B.weight`` (α/r baked into ``lora_B``, no ``.alpha``), as ai-toolkit writes them.

Why this layout (read at ComfyUI 2be2a9da ``comfy/ldm/ideogram4/model.py`` with ``comfy/lora.py``, and diffusers
0.42.1):

- ComfyUI's model is the original layout (``attention.qkv``, ``attention.o``, ``feed_forward.w1``-``w3``,
  ``adaln_modulation``), and ``model_lora_keys_unet`` maps ``diffusion_model.<module>`` to each of its weights: a LoRA
  of the fused ``qkv`` adds B·A to it.
- diffusers' ``Ideogram4Pipeline.load_lora_weights`` converts any file with ``diffusion_model.`` keys
  (``_convert_non_diffusers_ideogram4_lora_to_diffusers``): ``qkv``'s A goes to each of q/k/v and its B is cut in
  three equal row blocks; ``o`` becomes ``to_out.0``; ``w1``-``w3`` and the blocks' ``adaln_modulation`` keep their
  names. Modules a file leaves out are left alone (unlike Lumina 2's converter, nothing must be padded), but keys
  outside the blocks make it fail: the targets stay inside ``layers``.

So Atelier's q/k/v LoRAs become one LoRA of the fused ``qkv`` of their summed rank (A stacked, B block-diagonal): both
loaders then give each of q, k, v exactly its own B·A.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from trainer.families.ideogram4.keys import original_module

PREFIX = "diffusion_model."
_QKV = ("attention.to_q", "attention.to_k", "attention.to_v")


def _part(path: str) -> int:
    return next((i for i, end in enumerate(_QKV) if path.endswith(end)), -1)


def to_original(state: Mapping[str, Any], prefix: str = "transformer.") -> Dict[str, Any]:
    """A diffusers-layout LoRA (``{prefix}<module>.lora_A/lora_B.weight``, scale 1) in the original layout."""
    pairs: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        module, _, part = key[len(prefix):].rpartition(".lora_")
        pairs.setdefault(module, {})[part] = value
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for module, pair in sorted(pairs.items()):
        name = original_module(module)
        if _part(module) >= 0:
            fused.setdefault(name, {})[_part(module)] = pair
            continue
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = pair["A.weight"], pair["B.weight"]
    for name, parts in fused.items():
        some = next(iter(parts.values()))
        rows, rank = some["B.weight"].shape[0], sum(p["A.weight"].shape[0] for p in parts.values())
        big_a = torch.cat([parts[i]["A.weight"] for i in sorted(parts)])
        big_b = some["B.weight"].new_zeros(3 * rows, rank)
        col = 0
        for i in sorted(parts):
            r = parts[i]["A.weight"].shape[0]
            big_b[i * rows:(i + 1) * rows, col:col + r] = parts[i]["B.weight"]
            col += r
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = big_a, big_b
    return out


def from_original(state: Mapping[str, Any], ranks: Mapping[str, int],
                  prefix: str = "transformer.") -> Tuple[Dict[str, Any], set]:
    """An original-layout file as diffusers-layout tensors for the adapters of ``ranks`` (diffusers module path -> its
    rank): the inverse of :func:`to_original`; a fused ``qkv`` with one A shared by q/k/v (the rank of each part, as
    diffusers reads it) is read too. Returns the tensors and the file keys read; ValueError when a fused LoRA fits
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
        rows, total, col = b.shape[0] // 3, sum(rank for _, rank in parts.values()), 0
        for i in sorted(parts):
            module, rank = parts[i]
            block = slice(i * rows, (i + 1) * rows)
            if a.shape[0] == total:
                part_a, part_b = a[col:col + rank], b[block, col:col + rank]
            elif a.shape[0] == rank:
                part_a, part_b = a, b[block]
            else:
                raise ValueError(f"{PREFIX}{name} has rank {a.shape[0]}: neither the adapters' summed rank {total} nor "
                                 f"their rank {rank}")
            out[f"{prefix}{module}.lora_A.weight"] = part_a.clone()
            out[f"{prefix}{module}.lora_B.weight"] = part_b.clone()
            col += rank
    return out, used
