"""HunyuanImage 2.1 LoRA files in Tencent's original layout: ``diffusion_model.<original module>.lora_A.weight`` /
``.lora_B.weight`` (α/r baked into ``lora_B``, no ``.alpha``), as musubi-tuner's HunyuanImage LoRA names its modules.

Why this layout (read at ComfyUI a125cd84 ``comfy/lora.py`` ``model_lora_keys_unet``, ``comfy/supported_models.py``
``HunyuanImage21`` and ``comfy/ldm/hunyuan_video/model.py``, and diffusers 0.42.1):

- ComfyUI's HunyuanImage 2.1 is its HunyuanVideo model: it loads Tencent's original checkpoint (renaming it to Flux's
  layer names as it loads), and ``model_lora_keys_unet`` maps ``diffusion_model.<original module>`` (and
  ``transformer.<original module>``) to each weight: ``img_attn_qkv``/``txt_attn_qkv`` (q, k, v stacked) and a single
  block's ``linear1`` (q, k, v and the MLP's input stacked) are each one LoRA there.
- diffusers 0.42.1 has no LoRA loader for ``HunyuanImagePipeline`` and no converter from this layout; its transformer's
  ``load_lora_adapter`` reads the diffusers layout (``transformer.<module>``). :func:`to_diffusers` gives that layout
  of a file (each stacked part gets the shared A and its rows of B: exactly the file's B·A).

So Atelier's separate q/k/v (and MLP-input) LoRAs become one LoRA of the stacked Linear of their summed rank
(A stacked, B block-diagonal): ComfyUI then adds to each part exactly its own B·A.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set, Tuple

import torch

from trainer.families.hunyuanimage.keys import fused_parts, original_module

PREFIX = "diffusion_model."


def _pairs(state: Mapping[str, Any], prefix: str) -> Dict[str, Dict[str, Any]]:
    pairs: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        module, _, part = key[len(prefix):].rpartition(".lora_")
        pairs.setdefault(module, {})[part] = value
    return pairs


def _missing_rows(name: str, present, out_features: Optional[Mapping[str, int]]) -> Dict[int, int]:
    """{part index: its Linear's out features} of the parts of stacked ``name`` without an adapter (the LoRA targets
    took some of them: the ``attn`` targets take a single block's q, k, v but not its MLP input): their rows of the
    stacked B stay zero. ValueError when their sizes are not known."""
    missing = {i: p for i, p in enumerate(fused_parts(name)) if i not in present}
    unknown = [p for p in missing.values() if out_features is None or p not in out_features]
    if unknown:
        raise ValueError(f"a LoRA of {name} in the original layout needs the sizes of its parts without an adapter; "
                         f"{unknown} are not known")
    return {i: int(out_features[p]) for i, p in missing.items()}


def to_original(state: Mapping[str, Any], prefix: str = "transformer.",
                out_features: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    """A diffusers-layout LoRA (``{prefix}<module>.lora_A/lora_B.weight``, scale 1) in the original layout.
    ``out_features`` (diffusers module path -> its Linear's out features) sizes the zero rows of the stacked parts
    that have no adapter, so the stacked B has the stacked Linear's rows, as ComfyUI needs."""
    out: Dict[str, Any] = {}
    fused: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for module, pair in sorted(_pairs(state, prefix).items()):
        name, index, count = original_module(module)
        if count > 1:
            fused.setdefault(name, {})[index] = pair
            continue
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = pair["A.weight"], pair["B.weight"]
    for name, parts in fused.items():
        gaps = _missing_rows(name, parts, out_features)
        order = sorted(parts)
        big_a = torch.cat([parts[i]["A.weight"] for i in order])
        some = parts[order[0]]["B.weight"]
        rows = sum(parts[i]["B.weight"].shape[0] for i in order) + sum(gaps.values())
        big_b = some.new_zeros(rows, big_a.shape[0])
        row = col = 0
        for i in range(len(fused_parts(name))):
            if i in gaps:
                row += gaps[i]
                continue
            b = parts[i]["B.weight"]
            big_b[row:row + b.shape[0], col:col + b.shape[1]] = b
            row, col = row + b.shape[0], col + b.shape[1]
        out[f"{PREFIX}{name}.lora_A.weight"], out[f"{PREFIX}{name}.lora_B.weight"] = big_a, big_b
    return out


def from_original(state: Mapping[str, Any], shapes: Mapping[str, Tuple[int, int]],
                  prefix: str = "transformer.",
                  out_features: Optional[Mapping[str, int]] = None) -> Tuple[Dict[str, Any], Set[str]]:
    """An original-layout file as diffusers-layout tensors for the adapters of ``shapes`` (diffusers module path ->
    (rank, out features)): the inverse of :func:`to_original` (``out_features`` as there: the rows of the stacked
    parts without an adapter, skipped). Returns the tensors and the file keys read; ValueError when a stacked
    LoRA's rank is not the adapters' summed rank."""
    out: Dict[str, Any] = {}
    used: Set[str] = set()
    fused: Dict[str, Dict[int, Tuple[str, int, int]]] = {}
    for module, (rank, rows) in shapes.items():
        name, index, count = original_module(module)
        if count > 1:
            fused.setdefault(name, {})[index] = (module, rank, rows)
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
        total = sum(rank for _, rank, _ in parts.values())
        if a.shape[0] != total:
            raise ValueError(f"{PREFIX}{name} has rank {a.shape[0]}, not the summed rank {total} of its parts' "
                             "adapters")
        gaps = _missing_rows(name, parts, out_features) if len(parts) < len(fused_parts(name)) else {}
        row = col = 0
        for i in range(len(fused_parts(name))):
            if i in gaps:
                row += gaps[i]
                continue
            module, rank, rows = parts[i]
            out[f"{prefix}{module}.lora_A.weight"] = a[col:col + rank].clone()
            out[f"{prefix}{module}.lora_B.weight"] = b[row:row + rows, col:col + rank].clone()
            row, col = row + rows, col + rank
    return out, used


def to_diffusers(state: Mapping[str, Any], out_features: Mapping[str, int],
                 prefix: str = "transformer.") -> Dict[str, Any]:
    """An original-layout file in the diffusers layout ``load_lora_adapter`` reads: a stacked LoRA's A shared by its
    parts, each with its rows of B (``out_features``: diffusers module path -> its Linear's out features)."""
    out: Dict[str, Any] = {}
    for name, pair in _pairs(state, PREFIX).items():
        parts = fused_parts(name)
        row = 0
        for part in parts:
            rows = out_features[part] if len(parts) > 1 else pair["B.weight"].shape[0]
            out[f"{prefix}{part}.lora_A.weight"] = pair["A.weight"]
            out[f"{prefix}{part}.lora_B.weight"] = pair["B.weight"][row:row + rows]
            row += rows
    return out
