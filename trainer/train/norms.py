"""The denoiser's RMSNorms in the compute dtype (``training.norms_in_compute_dtype``).

The transformer families normalise queries and keys (and some their streams) with RMSNorm: torch's
``nn.RMSNorm`` (Flux.1, Flux.2, Chroma, Wan, HiDream, ERNIE-Image) or diffusers' own ``RMSNorm`` (Qwen-Image,
Z-Image, Lumina 2, Krea 2, Ideogram 4, ERNIE-Image). Under the training's autocast both cost more than they need:

- CUDA's autocast runs ``rms_norm`` in fp32 (torch's "CUDA ops that can autocast to float32"): the bf16 input
  and the weight are cast up, the output is fp32 until attention casts it back, and backward keeps the fp32 copy
  of the input, twice the bytes of the bf16 one. BFL's reference code, ComfyUI and kohya's Flux trainer normalise
  in fp32 and hand back the input's dtype (read: black-forest-labs/flux 0130c274, comfyanonymous/ComfyUI 04d5cdb6,
  kohya-ss/sd-scripts 0047bb1f).
- diffusers' ``RMSNorm`` computes with separate ops (cast, square, mean, rsqrt, two products, a cast: about eight
  kernels forward and more backward, fp32 in between, an fp32 copy of the input kept for backward) where
  ``torch.nn.functional.rms_norm`` is one fused kernel forward and one backward on CUDA (``aten::_fused_rms_norm``,
  which keeps the input in its dtype and the fp32 reciprocal RMS per row; a CPU build computes it op by op).

A norm whose weight is stored in the input's dtype (or that has none) here computes ``F.rms_norm`` outside
autocast: fp32 inside the kernel, the input's dtype out, as at inference. Norms with weights in another dtype
(an fp32 fine-tune), a bias, or subclasses with their own formula keep their forward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm


def _in_compute_dtype(weight: Any, x: torch.Tensor) -> bool:
    return (weight is None or weight.dtype == x.dtype) and x.device.type != "npu"  # diffusers' NPU kernel stays


def _fused(x: torch.Tensor, shape: Any, weight: Any, eps: Any) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, shape, weight, eps)


class TorchRMSNormInComputeDtype(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` without autocast's fp32 when its weight has the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _in_compute_dtype(self.weight, x):
            return _fused(x, self.normalized_shape, self.weight, self.eps)
        return super().forward(x)


class DiffusersRMSNormInComputeDtype(DiffusersRMSNorm):
    """diffusers' ``RMSNorm`` as one fused ``F.rms_norm`` when its weight has the input's dtype."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.bias is None and _in_compute_dtype(self.weight, hidden_states):
            return _fused(hidden_states, self.dim, self.weight, self.eps)
        return super().forward(hidden_states)


_SWAPS = {torch.nn.RMSNorm: TorchRMSNormInComputeDtype, DiffusersRMSNorm: DiffusersRMSNormInComputeDtype}


def norms_in_compute_dtype(module: Any) -> int:
    """Give ``module``'s RMSNorms (of exactly those two classes) the forward above; their parameters, names and
    state dict stay. Returns how many."""
    count = 0
    for m in module.modules():
        swap = _SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
            count += 1
    return count
