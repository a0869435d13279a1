"""DoRA in kohya files: one trained layer, three loader formulas for the same ``dora_scale`` key.

peft (what trains) and LyCORIS compute W' = m · V / ‖V‖ with V = W + (α/r)·up·down and the norm taken
per output row of V. Loaders read the same ``dora_scale`` key differently (their published code):
- ComfyUI and Forge (comfy/weight_adapter/base.py ``weight_decompose``): a dora_scale with one value
  per output row is divided by the norm of the *original* W (+ eps): W' = V · s / (‖W‖ + eps).
- AUTOMATIC1111 v1.10 (extensions-builtin/Lora/network.py ``apply_weight_decompose``, and ComfyUI/Forge
  before the output-axis branch): the norm over the *input* axis of V: W' = V · s / ‖V‖_col.
- LyCORIS / kohya sd-scripts / OneTrainer: W' = V · s / ‖V‖_row, s = m as trained.
A file can satisfy one of them; ``output.dora_format`` picks which. Each is exact for its loader. The model
tools read a file's ``dora_scale`` back with the same conventions (``COMFY_EPS`` included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DORA_FORMATS = ("comfyui", "a1111", "lycoris")
COMFY_EPS = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps: ComfyUI adds it to the norm


def _dora_norms(layer: Any, adapter: str) -> tuple:
    """(‖W‖ per output row, ‖V‖ per output row, ‖V‖ per input channel, W's shape), float32, on CPU."""
    base_layer = layer.get_base_layer()
    # an fp8-stored base (trainer.memory.precision.store_fp8) computes with fp8 · scale: the norms are of that
    base = base_layer.dequantize() if hasattr(base_layer, "W_q") else base_layer.weight
    base = base.detach().float().cpu()
    down = layer.lora_A[adapter].weight.detach().float().cpu()
    up = layer.lora_B[adapter].weight.detach().float().cpu()
    delta = (up.flatten(1) @ down.flatten(1)).reshape(base.shape) * float(layer.scaling[adapter])
    merged = base + delta
    rows_w = base.flatten(1).norm(dim=1)
    rows_v = merged.flatten(1).norm(dim=1)
    cols_v = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
    return rows_w, rows_v, cols_v, base.shape


def dora_scale_for(layer: Any, adapter: str, dora_format: str = "comfyui") -> "torch.Tensor":
    """The ``dora_scale`` tensor that makes ``dora_format``'s loader rebuild this layer's trained weight."""
    if dora_format not in DORA_FORMATS:
        raise ValueError(f"output.dora_format = {dora_format!r}: choose one of {', '.join(DORA_FORMATS)}")
    magnitude = layer.lora_magnitude_vector[adapter].weight.detach().float().cpu().reshape(-1)
    ndim = layer.get_base_layer().weight.ndim
    if dora_format == "lycoris":
        return magnitude.reshape(-1, *([1] * (ndim - 1))).clone()
    rows_w, rows_v, cols_v, shape = _dora_norms(layer, adapter)
    if dora_format == "comfyui":
        return (magnitude * (rows_w + COMFY_EPS) / rows_v).reshape(-1, *([1] * (ndim - 1)))
    # a1111: s / ‖V‖_col must equal m / ‖V‖_row for every entry, so s holds one value per (out, in) pair
    full = (magnitude / rows_v)[:, None] * cols_v[None, :]
    return full.reshape(shape[0], shape[1], *([1] * (ndim - 2)))


def dora_magnitude_from(scale: "torch.Tensor", layer: Any, adapter: str, dora_format: str) -> "torch.Tensor":
    """peft's magnitude from a file's ``dora_scale`` (the inverse of :func:`dora_scale_for`); the layer's
    up/down weights and scaling must already be the file's. A scale with one value per (out, in) pair is
    the a1111 form whatever the header says; one value per output row is read as ``dora_format``."""
    scale = scale.detach().float().cpu()
    per_row = scale.numel() == scale.shape[0]
    if per_row and dora_format != "comfyui":
        return scale.reshape(-1)
    rows_w, rows_v, cols_v, shape = _dora_norms(layer, adapter)
    if per_row:
        return scale.reshape(-1) * rows_v / (rows_w + COMFY_EPS)
    per = scale.reshape(shape[0], shape[1], -1)[:, :, 0] / cols_v[None, :]
    return per.mean(dim=1) * rows_v
