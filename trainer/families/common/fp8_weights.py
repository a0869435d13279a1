"""fp8 base checkpoints as tensors: the file's fp8 weights made floats to build a model from
(:func:`dequantise_fp8`), and which of the model's layers they were, with which scales
(:func:`fp8_layer_scales`), so that fp8 storage (trainer/memory/precision.py) keeps those layers as the file had
them. Which files are fp8, torch-free: common/fp8_files.py.

The formula is ComfyUI's (``comfy/ops.py`` ``scaled_fp8_ops`` at commit a125cd84b054a57729b5eecab930ca9408719832,
``mixed_precision_ops`` at 003124c1f6ca4b93066c672cb3f247007c17a038): the weight is the
fp8 tensor upcast, times its scale; a scale is one value per tensor, or (other fp8 releases) one per output row.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from trainer.errors import ModelLoadError
from trainer.families.common.fp8_files import WEIGHT_SCALE_SUFFIXES, fp8_marker

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantise_fp8(state: Dict[str, Any], dtype: Any, where: str) -> Dict[str, Any]:
    """``state`` with its fp8 weights as ``dtype`` floats: ``fp8 · scale`` where the file has the weight's per-tensor
    scale (ComfyUI's ``scaled_fp8`` files: ``<layer>.scale_weight``; its mixed-precision ones and other releases:
    ``<layer>.weight_scale``), the fp8 value itself where it has none; each tensor in turn (one layer in fp32 at a
    time). The scales, input scales and tags go (common/fp8_files.py). A scaled weight that is not a float (ComfyUI's
    int8 layers) is refused, naming it. A file without fp8 tensors or scales comes back as it was."""
    if not any(t.dtype in FP8 for t in state.values()) and not any(fp8_marker(k) for k in state):
        return state
    scales = {k[: -len(suffix)]: state[k] for k in state for suffix in WEIGHT_SCALE_SUFFIXES if k.endswith(suffix)}
    out: Dict[str, Any] = {}
    for key in list(state):
        tensor = state.pop(key)  # the file's copy goes as its float one is made
        if fp8_marker(key):
            continue
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        scale = scales.get(layer) if layer is not None else None
        if scale is not None and not tensor.is_floating_point():
            raise ModelLoadError(f"model.path '{where}': {key} is stored as {str(tensor.dtype).replace('torch.', '')} "
                                 "with a scale (an int8 checkpoint for inference), which cannot be trained from. Use "
                                 "the model's bf16/fp16 or fp8 release.", key="model.path", value=where)
        if tensor.dtype in FP8 or scale is not None:
            tensor = tensor.float() if scale is None else tensor.float() * _broadcast(scale, tensor, key, where)
            tensor = tensor.to(dtype)
        out[key] = tensor
    return out


def fp8_layer_scales(state: Dict[str, Any], to_diffusers: Callable[[Dict[str, Any]], Dict[str, Any]] = dict
                     ) -> Dict[str, Any]:
    """Module name (the model's, after ``to_diffusers``) → the scale of each weight an fp8 file (``state``, before
    :func:`dequantise_fp8`) stores in fp8: a single value, one per output row, or 1 for plain fp8. Empty for a file
    without fp8 weights."""
    return fp8_layer_scales_from_maps(fp8_scale_maps(state), to_diffusers)


def fp8_scale_maps(state: Dict[str, Any]) -> Dict[str, Any]:
    """One value per output row of each tensor of a file's ``state``: its weight's scale where the tensor is an fp8
    weight (1 for plain fp8), 0 elsewhere; shaped ``(rows, 1, …)`` like the tensor. Empty without fp8 weights.

    The file's names are not the model's, and converters split fused layers (qkv → q, k, v) and reorder them by
    rows: these maps go through the same converter as the weights (:func:`fp8_layer_scales_from_maps`)."""
    if not any(t.dtype in FP8 for t in state.values()):
        return {}
    scales = {k[: -len(suffix)]: state[k] for k in state for suffix in WEIGHT_SCALE_SUFFIXES if k.endswith(suffix)}
    maps: Dict[str, Any] = {}
    for key, tensor in state.items():
        if fp8_marker(key):
            continue
        if tensor.ndim == 0:
            maps[key] = torch.zeros(())
            continue
        rows = (tensor.shape[0],) + (1,) * (tensor.ndim - 1)
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        scale = scales.get(layer) if layer is not None else None
        scale = torch.ones(()) if scale is None else scale.detach().float()
        if tensor.dtype not in FP8 or layer is None or scale.numel() not in (1, rows[0]):
            maps[key] = torch.zeros(rows)  # not fp8, or block-wise scales (refused by dequantise_fp8)
            continue
        maps[key] = scale.reshape(-1).expand(rows[0]).reshape(rows).clone()
    return maps


def fp8_layer_scales_from_maps(maps: Dict[str, Any], convert: Callable[[Dict[str, Any]], Dict[str, Any]] = dict
                               ) -> Dict[str, Any]:
    """The maps of :func:`fp8_scale_maps` through ``convert`` (the model's converter of the file's state dict), read
    back per converted weight whose rows are all scaled: module name → one scale, or one per output row. A converter
    that cannot take the maps (one reading a shape it needs) gives ``{}``: the layers stay as loaded."""
    if not maps:
        return {}
    try:
        converted = convert(dict(maps))
    except Exception:  # noqa: BLE001 - any converter failure only means: no scales carried
        return {}
    out: Dict[str, Any] = {}
    for key, value in converted.items():
        if not key.endswith(".weight") or not torch.is_tensor(value) or value.numel() == 0:
            continue
        value = value.reshape(value.shape[0], -1)[:, 0] if value.ndim else value.reshape(1)
        if not bool((value > 0).all()):
            continue
        uniform = bool((value == value[0]).all())
        out[key[: -len(".weight")]] = value[:1].reshape(()).clone() if uniform else value.clone()
    return out


def _broadcast(scale: Any, weight: Any, key: str, where: str) -> Any:
    """A weight's scale as a factor of it: one per tensor (ComfyUI's) or one per output row."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == weight.shape[0]:
        return scale.reshape(-1, *([1] * (weight.ndim - 1)))
    raise ModelLoadError(f"model.path '{where}': the scale of {key} has {scale.numel()} values for a weight of shape "
                         f"{tuple(weight.shape)} (block-wise scales), which Atelier does not read. Use the model's "
                         "bf16/fp16 release or an fp8 file with per-tensor scales.", key="model.path", value=where)
