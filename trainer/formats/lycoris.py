"""LyCORIS LoHa / LoKr files (``hada_*`` / ``lokr_*`` and ``alpha`` per module), trained on peft's LoHaLayer /
LoKrLayer.

The LyCORIS file format (what A1111, ComfyUI and lycoris-lora load) uses kohya's module names
with per-module keys ``hada_w1_a … hada_t2`` (LoHa) or ``lokr_w1[_a/_b] … lokr_t2`` (LoKr) and
``.alpha``. peft's parameters carry the same names and shapes; the one difference is LoKr's
scale when neither factor is decomposed: LyCORIS/A1111/ComfyUI then take scale 1 whatever the
alpha, while peft always scales by alpha/r — so we bake peft's scale into ``lokr_w1`` and write
alpha = rank. Module names come from the family's namer, as for kohya LoRA files (:mod:`trainer.formats.kohya`).

torch and peft are imported where they are used (see :mod:`trainer.formats.checkpoint`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from peft.tuners.loha import LoHaLayer
from peft.tuners.lokr import LoKrLayer

from trainer.formats.kohya import PEFT_PREFIXES, assign_tensor, cast_adapter_tensors, load_lora_file, named_targets
from trainer.io import save_safetensors_atomic

if TYPE_CHECKING:  # the formats take a family's namer; they import nothing of the families
    from trainer.families.base import Namer

_LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
_LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def _lycoris_layers(model: Any, adapter: str) -> Iterator[tuple[str, Any]]:
    """(module path, peft LoHaLayer/LoKrLayer) for every layer that carries ``adapter``."""

    for name, module in model.named_modules():
        if isinstance(module, (LoHaLayer, LoKrLayer)) and adapter in module._available_adapters:
            for prefix in PEFT_PREFIXES:
                name = name.removeprefix(prefix)
            yield name, module


def _lycoris_algo(layer: Any) -> str:
    return "loha" if isinstance(layer, LoHaLayer) else "lokr"


def _lokr_full(layer: Any, adapter: str) -> bool:
    """Neither Kronecker factor is decomposed: LyCORIS loaders then use scale 1."""
    return adapter in layer.lokr_w1 and adapter in layer.lokr_w2


def lycoris_state_dict(modules: Mapping[str, Any], namer: Namer,
                       adapter_name: str = "default") -> dict[str, "torch.Tensor"]:
    """Read the peft LoHa/LoKr layers of ``modules`` (slot -> module) into a LyCORIS-format state dict with
    kohya names from the family's ``namer``.

    Per module ``<name>.hada_*`` or ``<name>.lokr_*`` (peft's tensors as they are) and
    ``<name>.alpha`` = scaling × rank, so that every loader's alpha/rank equals peft's scaling.
    LoKr layers with two full factors get the scaling baked into ``lokr_w1`` and alpha = rank.
    """

    names = named_targets(modules, namer, adapter_name, _lycoris_layers)
    if not names:
        raise ValueError(f"no peft LoHa/LoKr layers with adapter {adapter_name!r} found in the given models")
    out: dict[str, torch.Tensor] = {}
    for kohya, (path, layer) in names.items():
        keys = _LOHA_KEYS if _lycoris_algo(layer) == "loha" else _LOKR_KEYS
        rank = layer.r[adapter_name]
        scaling = float(layer.scaling[adapter_name])
        for key in keys:
            store = getattr(layer, key)
            if adapter_name in store:
                out[f"{kohya}.{key}"] = store[adapter_name].detach().cpu().clone()
        if _lycoris_algo(layer) == "lokr" and _lokr_full(layer, adapter_name):
            out[f"{kohya}.lokr_w1"] = out[f"{kohya}.lokr_w1"] * scaling
            scaling = 1.0
        out[f"{kohya}.alpha"] = torch.tensor(scaling * rank, dtype=torch.float32)
    return out


def _lycoris_rank(state: Mapping[str, "torch.Tensor"], name: str) -> int | None:
    """The rank a LyCORIS loader reads for one module (None: LoKr with two full factors)."""
    for key in (".hada_w1_b", ".lokr_w1_b", ".lokr_w2_b"):
        if name + key in state:
            return int(state[name + key].shape[0])
    return None


def lycoris_metadata(state_dict: Mapping[str, "torch.Tensor"], algo: str,
                     network_args: Mapping[str, Any] | None = None) -> dict[str, str]:
    """kohya-style header of a LyCORIS file: ``ss_network_module = lycoris.kohya``, the most common
    (rank, alpha) as ``ss_network_dim``/``ss_network_alpha``, and ``ss_network_args`` with the algo."""
    seen: Counter = Counter()
    for key, value in state_dict.items():
        if key.endswith(".alpha"):
            rank = _lycoris_rank(state_dict, key[: -len(".alpha")])
            if rank is not None:
                seen[(rank, float(value.item()))] += 1
    meta = {"ss_network_module": "lycoris.kohya",
            "ss_network_args": json.dumps({"algo": algo, **{k: str(v) for k, v in (network_args or {}).items()}})}
    if seen:
        (rank, alpha), _ = seen.most_common(1)[0]
        meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    return meta


def save_lycoris(path: str | os.PathLike, state_dict: Mapping[str, "torch.Tensor"],
                 metadata: Mapping[str, Any] | None, dtype: str, algo: str,
                 network_args: Mapping[str, Any] | None = None) -> None:
    """Write a LyCORIS LoHa/LoKr ``.safetensors`` atomically.

    Weights are cast to ``dtype``, ``.alpha`` stays float32; the header is ``metadata`` (e.g. from
    the family's ``lora_metadata``) with the LyCORIS keys of :func:`lycoris_metadata` on top.
    """
    if Path(path).suffix.lower() != ".safetensors":
        raise ValueError(f"LyCORIS files are .safetensors; got {Path(path).name!r}")
    tensors = cast_adapter_tensors(state_dict, dtype)
    header = {str(k): str(v) for k, v in (metadata or {}).items()}
    header.update(lycoris_metadata(state_dict, algo, network_args))
    save_safetensors_atomic(tensors, path, header)


def load_lycoris_into_peft(path: str | os.PathLike | Mapping[str, "torch.Tensor"], modules: Mapping[str, Any],
                           namer: Namer, *, adapter_name: str = "default", strict: bool = True) -> int:
    """Copy a LyCORIS LoHa/LoKr file (or its state dict) into peft LoHa/LoKr layers already added to ``modules``
    (``lora.init_weights``); the inverse of :func:`lycoris_state_dict`. Returns the layers loaded."""
    state = load_lora_file(path)
    names = named_targets(modules, namer, adapter_name, _lycoris_layers)
    suffixes = tuple("." + k for k in _LOHA_KEYS + _LOKR_KEYS) + (".alpha",)
    groups: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        name, dot, part = key.partition(".")
        if dot and "." + part in suffixes:
            groups.setdefault(name, {})[part] = value
        elif not key.startswith("bundle_emb."):
            unknown.append(key)
    unmatched = sorted(unknown + [f"{n}.*" for n in groups if n not in names])
    if unmatched:
        shown = ", ".join(unmatched[:10]) + (f" … ({len(unmatched)} in all)" if len(unmatched) > 10 else "")
        raise ValueError(f"LyCORIS file keys match no LoHa/LoKr layer of the model (algo, targets or family "
                         f"differ?): {shown}")
    missing = sorted(n for n in names if n not in groups)
    if strict and missing:
        shown = ", ".join(missing[:10]) + (f" … ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"model LoHa/LoKr layers not in the file (pass strict=False to keep them as they are): {shown}")
    for name, parts in groups.items():
        layer = names[name][1]
        keys = _LOHA_KEYS if _lycoris_algo(layer) == "loha" else _LOKR_KEYS
        for key in keys:
            store = getattr(layer, key)
            if (adapter_name in store) != (key in parts):
                raise ValueError(f"{name}: the file's {_lycoris_algo(layer)} factors differ from the model's "
                                 f"({key} {'missing in the file' if key not in parts else 'unexpected'}): "
                                 "rank, factor or decompose_both changed?")
            if key in parts:
                assign_tensor(store[adapter_name], parts[key], f"{name}.{key}")
        rank = layer.r[adapter_name]
        if _lycoris_algo(layer) == "lokr" and _lokr_full(layer, adapter_name):
            scaling = 1.0  # LyCORIS convention: alpha ignored, the scale is in the weights
        else:
            scaling = float(parts["alpha"].item()) / rank if "alpha" in parts else 1.0
        layer.scaling[adapter_name] = scaling
        layer.alpha[adapter_name] = scaling * rank
    return len(groups)
