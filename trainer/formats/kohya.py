"""kohya/ComfyUI LoRA files (``lora_down``/``lora_up``/``alpha``, ``dora_scale`` for DoRA) from and into peft layers.

diffusers' own LoRA converters silently write wrong kohya files (alpha forced to rank, text-encoder keys without
``text_model``, dropped keys with mixed targets: see LIBRARY-NOTES). A writer that reads the peft layers
directly is small and exact, so we write it ourselves. The key names come from the family's namer
(:data:`trainer.families.base.Namer`: slot -> (key prefix, module-path rename)); nothing here knows a family.
The layer helpers (:func:`lora_layers`, :func:`check_plain_lora`, :func:`kohya_alpha`) also serve the
diffusers/peft-layout writer of the transformer families and the LyCORIS writer.

torch, peft and safetensors are imported where they are used (see :mod:`trainer.formats.checkpoint`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from trainer.formats.checkpoint import dtype_from_name
from trainer.formats.dora import dora_magnitude_from, dora_scale_for
from trainer.formats.metadata import network_shape_metadata
from trainer.io import save_safetensors_atomic

if TYPE_CHECKING:  # the formats take a family's namer; they import nothing of the families
    from trainer.families.base import Namer

PEFT_PREFIXES = ("base_model.model.",)


def lora_layers(model: Any, adapter: str) -> Iterator[tuple[str, Any]]:
    """(module path, peft LoraLayer) for every layer that carries ``adapter``."""

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A):
            for prefix in PEFT_PREFIXES:
                name = name.removeprefix(prefix)
            yield name, module


def check_plain_lora(name: str, layer: Any, adapter: str) -> None:
    """Refuse what the kohya format cannot express instead of writing a file that loads wrong."""
    if adapter in layer.lora_embedding_A:
        raise NotImplementedError(f"{name}: LoRA on embedding layers has no kohya representation")
    if layer.lora_bias.get(adapter, False):
        raise NotImplementedError(f"{name}: LoRA with lora_bias=True has no kohya representation")
    variant = layer.lora_variant.get(adapter) if hasattr(layer, "lora_variant") else None
    if variant is not None and "Dora" not in type(variant).__name__:
        raise NotImplementedError(f"{name}: peft LoRA variant {type(variant).__name__} has no kohya representation")


def kohya_alpha(layer: Any, adapter: str) -> float:
    """kohya scales by alpha/rank; peft by alpha/rank, or alpha/sqrt(rank) with rsLoRA."""
    alpha = float(layer.lora_alpha[adapter])
    if layer.use_rslora.get(adapter, False):
        alpha *= math.sqrt(layer.r[adapter])
    return alpha


def _module_names(model: Any, prefix: str, adapter: str, rename,
                  layers=lora_layers) -> dict[str, tuple[str, Any]]:
    """kohya name → (module path, layer), checking that no two modules share a name."""
    out: dict[str, tuple[str, Any]] = {}
    for path, layer in layers(model, adapter):
        kohya = f"{prefix}_{rename(path).replace('.', '_')}"
        if kohya in out:
            raise RuntimeError(f"modules {out[kohya][0]!r} and {path!r} both map to kohya name {kohya!r}")
        out[kohya] = (path, layer)
    return out


def named_targets(modules: Mapping[str, Any], namer: Namer, adapter: str,
                  layers: Callable[[Any, str], Iterator[tuple[str, Any]]] = lora_layers
                  ) -> dict[str, tuple[str, Any]]:
    """kohya name -> (module path, layer) over ``modules`` (slot -> module, None skipped) with the family's
    ``namer`` (slot -> (key prefix, module-path rename)); ``layers`` finds the adapted layers of one module."""
    names: dict[str, tuple[str, Any]] = {}
    for slot, model in modules.items():
        if model is None:
            continue
        if slot not in namer:
            raise ValueError(f"the model family has no LoRA file names for its {slot} part")
        prefix, rename = namer[slot]
        for kohya, found in _module_names(model, prefix, adapter, rename, layers).items():
            if kohya in names:
                raise RuntimeError(f"modules {names[kohya][0]!r} and {found[0]!r} both map to kohya name {kohya!r}")
            names[kohya] = found
    return names


def kohya_lora_state_dict(modules: Mapping[str, Any], namer: Namer, adapter_name: str = "default", *,
                          dora_format: str = "lycoris") -> dict[str, "torch.Tensor"]:
    """Read the peft LoRA layers of ``modules`` (slot -> module) into a kohya-format state dict, named by the
    family's ``namer``.

    Per module: ``<name>.lora_down.weight`` (peft ``lora_A``), ``<name>.lora_up.weight``
    (``lora_B``), ``<name>.alpha`` (scalar), and ``<name>.dora_scale`` for DoRA in the loader
    convention ``dora_format`` (:func:`dora_scale_for`; ``lycoris``: ``lora_magnitude_vector`` reshaped
    to ``(out, 1[, 1, 1])``, what backups hold). Conv layers keep 4-D shapes
    (LoCon). Names: ``{prefix}_{rename(module path)}`` with dots as underscores (SD: ``lora_unet_…``,
    ``lora_te_text_model_…``; see the SD kit's ``sd_namer``).
    Tensors are detached CPU copies in the layers' dtype; alpha is float32.
    """

    names = named_targets(modules, namer, adapter_name)
    if not names:
        raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found in the given models")
    out: dict[str, torch.Tensor] = {}
    for kohya, (path, layer) in names.items():
        check_plain_lora(path, layer, adapter_name)
        out[f"{kohya}.lora_down.weight"] = layer.lora_A[adapter_name].weight.detach().cpu().clone()
        out[f"{kohya}.lora_up.weight"] = layer.lora_B[adapter_name].weight.detach().cpu().clone()
        out[f"{kohya}.alpha"] = torch.tensor(kohya_alpha(layer, adapter_name), dtype=torch.float32)
        if adapter_name in layer.lora_magnitude_vector:
            out[f"{kohya}.dora_scale"] = dora_scale_for(layer, adapter_name, dora_format)
    return out


def cast_adapter_tensors(state_dict: Mapping[str, "torch.Tensor"], dtype: str) -> dict[str, "torch.Tensor"]:
    """Adapter weights cast to ``dtype`` on the CPU; ``.alpha`` scalars stay float32 (loaders read them
    as exact numbers)."""
    target = dtype_from_name(dtype)
    out = {}
    for key, value in state_dict.items():
        value = value.detach().cpu()
        if key.endswith(".alpha"):
            out[key] = value.to(torch.float32)
        else:
            out[key] = value.to(target) if value.is_floating_point() else value
    return out


def save_lora_kohya(path: str | os.PathLike, state_dict: Mapping[str, "torch.Tensor"],
                    metadata: Mapping[str, Any] | None, dtype: str) -> None:
    """Write a kohya-format LoRA ``.safetensors`` atomically.

    Weights are cast to ``dtype``; ``.alpha`` scalars stay float32 so an alpha like 0.3 survives
    fp16. Header: rank/alpha read from the tensors, then ``metadata`` (e.g. from
    the family's ``lora_metadata``) on top.
    """
    if Path(path).suffix.lower() != ".safetensors":
        raise ValueError(f"kohya LoRA files are .safetensors; got {Path(path).name!r}")
    tensors = cast_adapter_tensors(state_dict, dtype)
    header = network_shape_metadata(state_dict)
    header.update({str(k): str(v) for k, v in (metadata or {}).items()})
    save_safetensors_atomic(tensors, path, header)


def load_lora_file(path_or_state_dict: str | os.PathLike | Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """The tensors of a ``.safetensors`` adapter file, or a copy of a state dict already read."""
    if isinstance(path_or_state_dict, Mapping):
        return dict(path_or_state_dict)

    return load_file(str(path_or_state_dict))


def _split_kohya_keys(state: Mapping[str, "torch.Tensor"]) -> tuple[dict[str, dict[str, "torch.Tensor"]], list[str]]:
    """Group ``name.lora_down.weight``/``.lora_up.weight``/``.alpha``/``.dora_scale`` by name."""
    suffixes = (".lora_down.weight", ".lora_up.weight", ".alpha", ".dora_scale")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        for suffix in suffixes:
            if key.endswith(suffix):
                groups.setdefault(key[: -len(suffix)], {})[suffix] = value
                break
        else:
            unknown.append(key)
    return groups, unknown


def assign_tensor(param: "torch.Tensor", value: "torch.Tensor", what: str) -> None:
    """Copy a file's tensor into a model parameter in place, refusing a shape mismatch (naming ``what``)."""

    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{what}: file has shape {tuple(value.shape)}, model expects {tuple(param.shape)} "
                         "(different rank or target layer?)")
    with torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def load_lora_kohya_into_peft(path: str | os.PathLike | Mapping[str, "torch.Tensor"], modules: Mapping[str, Any],
                              namer: Namer, *, adapter_name: str = "default", strict: bool = True,
                              dora_format: str = "lycoris") -> int:
    """Copy a kohya LoRA file (or its state dict) into the peft LoRA layers already added to ``modules``, named by
    the family's ``namer`` (resume, or ``lora.init_weights``). Returns the number of layers loaded.
    ``dora_format``: the convention the file's ``dora_scale`` was written in (its ``atelier_dora_format``
    header; LyCORIS/kohya files: lycoris).

    The file's alpha replaces the layer's (``lora_alpha`` and ``scaling``). Any file key without a
    matching peft layer raises, naming the keys; with ``strict`` (default) peft layers the file does
    not cover raise too, because they would keep their fresh initialisation unnoticed.
    """
    state = load_lora_file(path)
    names = named_targets(modules, namer, adapter_name)
    groups, unknown = _split_kohya_keys(state)
    unmatched = sorted(unknown + [f"{n}.*" for n in groups if n not in names])
    if unmatched:
        shown = ", ".join(unmatched[:10]) + (f" … ({len(unmatched)} in all)" if len(unmatched) > 10 else "")
        raise ValueError(f"LoRA file keys match no LoRA layer of the model (targets or family differ?): {shown}")
    missing = sorted(n for n in names if n not in groups)
    if strict and missing:
        shown = ", ".join(missing[:10]) + (f" … ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"model LoRA layers not in the file (pass strict=False to keep them as they are): {shown}")
    for name, parts in groups.items():
        _load_one(name, parts, names[name][1], adapter_name, dora_format)
    return len(groups)


def _load_one(name: str, parts: Mapping[str, "torch.Tensor"], layer: Any, adapter: str,
              dora_format: str = "lycoris") -> None:
    check_plain_lora(name, layer, adapter)
    for suffix in (".lora_down.weight", ".lora_up.weight"):
        if suffix not in parts:
            raise ValueError(f"LoRA file has no {name}{suffix}")
    assign_tensor(layer.lora_A[adapter].weight, parts[".lora_down.weight"], f"{name}.lora_down.weight")
    assign_tensor(layer.lora_B[adapter].weight, parts[".lora_up.weight"], f"{name}.lora_up.weight")
    rank = layer.r[adapter]
    alpha = float(parts[".alpha"].item()) if ".alpha" in parts else float(rank)  # kohya: no alpha = rank
    layer.scaling[adapter] = alpha / rank
    layer.lora_alpha[adapter] = alpha / math.sqrt(rank) if layer.use_rslora.get(adapter, False) else alpha
    has_dora = adapter in layer.lora_magnitude_vector
    if ".dora_scale" in parts and not has_dora:
        raise ValueError(f"{name}: the file is DoRA (dora_scale) but the model layer is plain LoRA (use_dora=False)")
    if has_dora:
        if ".dora_scale" not in parts:
            raise ValueError(f"{name}: the model layer is DoRA but the file has no dora_scale")
        magnitude = layer.lora_magnitude_vector[adapter].weight
        value = dora_magnitude_from(parts[".dora_scale"], layer, adapter, dora_format)
        assign_tensor(magnitude, value.reshape(magnitude.shape), f"{name}.dora_scale")
