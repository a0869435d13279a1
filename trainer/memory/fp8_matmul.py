"""``parts.denoiser.fp8_matmul``: the fp8-stored frozen Linear layers multiply on fp8 tensor cores.

fp8 storage alone (``parts.denoiser.fp8``, :mod:`trainer.memory.precision`) saves memory and costs time: each layer
upcasts its weight to bf16 and multiplies in bf16 (the 24 GB Flux.1 preset ran 1.09 steps/s on an H200 against 1.25
with the weights in bf16, docs/performance.md). GPUs with fp8 tensor cores (compute capability 8.9 and up: Ada, RTX
40xx, L4/L40; Hopper, H100/H200; Blackwell) multiply fp8 by fp8 at twice their bf16 rate. With this switch a frozen
Linear's forward product runs there, as ComfyUI's ``fp8_e4m3fn_fast`` and musubi-tuner's ``--fp8_fast`` do at
inference and diffusers' Flux fp8 training example does through torchao's float8 layers:

- the input is quantised to float8_e4m3fn with one scale for the tensor (its largest magnitude maps to just under
  448, e4m3's largest value; torchao's default "tensorwise" recipe), the stored fp8 weight is used as it is, and
  ``torch._scaled_mm`` multiplies with fp32 accumulation into the compute dtype; a weight scale per output row
  (fp8 files with scales) multiplies the output columns, one per tensor goes into the product;
- backward computes the input's gradient as fp8 storage does (the output gradient times the upcast weight, in the
  compute dtype: :class:`trainer.memory.precision._StoredLinear`): gradients are not quantised, and the weight, frozen,
  has none;
- the LoRA adapters beside each layer compute as before.

The difference is the input's rounding to 3 mantissa bits in the forward product (the weight already had it).
Layers whose sizes the kernel cannot take (both dimensions must be multiples of 16) and Conv2d layers keep fp8
storage's upcast."""

from __future__ import annotations

from typing import Any, Optional

import torch

from trainer.errors import ConfigError

E4M3_MAX = 448.0  # the largest float8_e4m3fn value
CAPABILITY = (8, 9)  # the first CUDA architecture with fp8 tensor cores (Ada)


def why_not(device: Any) -> Optional[str]:
    """Why ``device`` cannot run fp8 products, or None. The CPU runs ``torch._scaled_mm`` (slowly: for tests)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"{device.type} has no fp8 matrix products"
    if getattr(torch.version, "hip", None):
        return "ROCm's fp8 types are not float8_e4m3fn"
    if not torch.cuda.is_available():
        return None  # no GPU here (the VRAM estimate's fake CUDA device): the run checks its own
    name = torch.cuda.get_device_name(device)
    cap = torch.cuda.get_device_capability(device)
    if cap < CAPABILITY:
        return (f"the {name} (compute capability {cap[0]}.{cap[1]}) has no fp8 tensor cores (Ada, RTX 40xx, L4, L40, "
                "Hopper H100/H200 and Blackwell have)")
    return None


def check_device(device: Any) -> None:
    """Refuse ``parts.denoiser.fp8_matmul`` on a device without fp8 products (the run's set-up calls it before a
    model loads)."""
    why = why_not(device)
    if why:
        raise ConfigError(f"parts.denoiser.fp8_matmul is on, but {why}. Turn it off (fp8 storage alone still saves "
                          "the memory).", key="parts.denoiser.fp8_matmul", value=True)


def takes(module: torch.nn.Module) -> bool:
    """Whether ``module`` can multiply in fp8: a Linear whose both dimensions are multiples of 16."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def input_factor(rows: torch.Tensor) -> torch.Tensor:
    """The factor (in ``rows``' dtype) that maps the largest magnitude of ``rows`` a little under 448, so that its
    rounding and the product's in ``rows``' dtype cannot carry a value past e4m3's range (casts beyond it are NaN on
    CUDA)."""
    amax = torch.linalg.vector_norm(rows, float("inf"), dtype=torch.float32).clamp(min=1e-12)
    return (E4M3_MAX * (1 - 2 ** -7) / amax).to(rows.dtype)


def quantise_input(x: torch.Tensor):
    """``x`` as float8_e4m3fn rows ``[tokens, features]`` and the fp32 scale to multiply back (one for the tensor).
    Computed in ``x``'s dtype (no fp32 copy of the activations), in three passes over them (the largest magnitude,
    the scaling, the cast); no device read."""
    rows = x.reshape(-1, x.shape[-1])
    factor = input_factor(rows)
    q = (rows * factor).to(torch.float8_e4m3fn)
    return q if q.is_contiguous() else q.contiguous(), factor.float().reciprocal()  # CUDA's kernel: row-major


def fp8_linear(x: torch.Tensor, stored: torch.Tensor, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, stored · scale, bias)`` computed as an fp8 product: ``x`` quantised per tensor, the stored fp8
    weight as it is, fp32 accumulation, the output in ``dtype``."""
    q, x_scale = quantise_input(x.to(dtype))
    per_tensor = scale is not None and scale.numel() == 1
    w_scale = scale.reshape(()).to(q.device, torch.float32) if per_tensor else torch.ones((), device=q.device)
    y = torch._scaled_mm(q, stored.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype)
    if scale is not None and not per_tensor:  # one scale per output row: per output column here
        y = y * scale.reshape(1, -1).to(y.device, dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y.reshape(*x.shape[:-1], stored.shape[0])


class Fp8MatmulLinear(torch.autograd.Function):
    """:func:`fp8_linear` forward; backward the input's gradient from the upcast weight in ``dtype`` (nothing saved
    but the stored weight and its scale) and a trainable bias's gradient."""

    @staticmethod
    def forward(ctx, x, stored, scale, bias, dtype):
        ctx.save_for_backward(stored, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return fp8_linear(x, stored, scale, bias, dtype)

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = stored.to(ctx.dtype) if scale is None else (stored.float() * scale.float()).to(ctx.dtype)
            grad_x = grad.to(ctx.dtype).matmul(w).to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None


def forward_of(module: torch.nn.Linear, dtype: torch.dtype):
    """The forward of an fp8-stored Linear that multiplies in fp8 (its ``weight`` float8_e4m3fn, its
    ``weight_scale`` None, one value or one per output row)."""

    def forward(x):
        scale = getattr(module, "weight_scale", None)
        if torch.is_grad_enabled() and (x.requires_grad or (module.bias is not None and module.bias.requires_grad)):
            return Fp8MatmulLinear.apply(x, module.weight, scale, module.bias, dtype)
        return fp8_linear(x, module.weight, scale, module.bias, dtype)

    return forward
