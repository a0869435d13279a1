"""fp8 base checkpoints: what marks a single file as stored in float8, torch-free (detection and ``validate`` read
it from the file's header).

Two kinds are published, and both load as the frozen base of a LoRA, for every family that reads single files: the
loader dequantises each tensor to build the model (:func:`trainer.families.common.fp8_weights.dequantise_fp8`) and
records each fp8 layer's scale, and once the adapters exist those layers go back to fp8 with their scales and are
upcast per layer (trainer/memory/precision.py ``store_fp8``):

- plain fp8: the Linear weights are ``float8_e4m3fn`` (safetensors ``F8_E4M3``), nothing else; the value is the
  weight.
- scaled fp8, as ComfyUI writes and reads it: each quantised weight has a per-tensor scale (some releases: one per
  output row), and the weight is ``fp8 · scale``. ComfyUI's first layout (``comfy/model_detection.py`` and
  ``comfy/ops.py`` ``scaled_fp8_ops``, commit a125cd84b054a57729b5eecab930ca9408719832) marks the file with a
  ``scaled_fp8`` key and names the scales ``<layer>.scale_weight`` (and ``<layer>.scale_input`` for fp8 matmuls); its
  mixed-precision layout (``comfy/ops.py`` ``mixed_precision_ops``, commit 003124c1f6ca4b93066c672cb3f247007c17a038)
  names them ``<layer>.weight_scale`` / ``<layer>.input_scale`` with a ``<layer>.comfy_quant`` JSON tag, as other fp8
  releases do. The input scales only feed fp8 matmuls at inference: the weights do not depend on them.

What stays refused (by :data:`trainer.families.PREQUANTISED` and the loader): NF4/FP4/int8 packs (bitsandbytes,
torchao/quanto, NVFP4's ``weight_scale_2``, ComfyUI's int8 layers) and GGUF files, whose weights are not floats.
"""

from __future__ import annotations

from typing import Any, Dict

#: safetensors dtype names of float8 tensors
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: a weight's per-tensor scale: ComfyUI's first layout, then its mixed-precision one (and other fp8 releases)
WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
#: what only fp8 matmuls at inference read (dropped on load): input scales and ComfyUI's per-layer tag
INFERENCE_ONLY_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
#: ComfyUI's whole-file marker of its first layout (a 0- or 2-element tensor of the fp8 dtype)
SCALED_MARKER = "scaled_fp8"


def fp8_marker(key: str) -> bool:
    """Whether ``key`` is an fp8 file's bookkeeping (a scale, a tag, the file marker), not a weight of the model."""
    return (key == SCALED_MARKER or key.endswith("." + SCALED_MARKER) or key.endswith(WEIGHT_SCALE_SUFFIXES)
            or key.endswith(INFERENCE_ONLY_SUFFIXES))


def fp8_kind(header: Dict[str, Any]) -> str:
    """What a .safetensors header (:func:`trainer.families.checks.read_safetensors_header`) holds: ``""`` (no fp8
    tensor), ``"fp8"`` (float8 weights) or ``"scaled fp8"`` (float8 weights with per-tensor scales)."""
    entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    if not any(str(v.get("dtype", "")) in FP8_DTYPES for v in entries.values()):
        return ""
    scaled = any(k == SCALED_MARKER or k.endswith(("." + SCALED_MARKER, *WEIGHT_SCALE_SUFFIXES)) for k in entries)
    return "scaled fp8" if scaled else "fp8"
