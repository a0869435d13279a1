"""Precision options that need more than a dtype: fp8 and NF4 weight storage and bf16 stochastic rounding.

- fp8 storage: the frozen Linear/Conv2d weights of the UNet are kept in float8_e4m3fn and upcast for
  each layer's op (a storage format; works on CPU and GPU with torch ≥ 2.1; the Linear products in fp8 are
  ``parts.denoiser.fp8_matmul``'s, :mod:`trainer.memory.fp8_matmul`). Applied
  after the LoRA adapters exist; the adapters, conv_in/conv_out and the time embedding stay as they
  are. See ``enable_fp8_storage`` for why this is not diffusers' ``enable_layerwise_casting``. A base
  read from an fp8 file keeps the file's fp8 values with their scale (per tensor or per output row):
  each layer computes with fp8 · scale (:func:`store_fp8`); ``parts.denoiser.fp8_scaled`` gives the others a
  scale per output row too (:func:`row_scale`), or per block of inputs in each row (``fp8_scale_block``,
  :func:`block_scale`).
- bf16 stochastic rounding: with bf16 weights an optimizer update smaller than half of bf16's step
  (2⁻⁸ relative) rounds back to the old value and is lost. Optimizer hooks hand the optimizer fp32
  copies of the bf16 weights (so its state is fp32 too), and after the step round each weight to bf16
  up or down with probability proportional to the distance — unbiased, so small updates survive on
  average. The random bits come from a generator seeded by (seed, step): a resumed run rounds the
  same way without any extra state in the backup. Works with any ``torch.optim.Optimizer`` subclass
  whose ``step`` is called (not with per-parameter fused-backward updates).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.config.fields import PART_OF_SLOT
from trainer.errors import ConfigError
from trainer.memory import fp8_matmul


def stochastic_round_to_bf16(x, generator=None):
    """Round fp32 ``x`` to bf16, up or down with probability by distance (adds 16 random low bits,
    then truncates: E[result] = x)."""
    x32 = x.detach().to(torch.float32).contiguous()
    noise = torch.randint(0, 1 << 16, x32.shape, dtype=torch.int32, generator=generator,
                          device=x32.device)
    bits = (x32.view(torch.int32) + noise) & -65536  # 0xFFFF0000 as a signed int32
    out = bits.view(torch.float32)
    finite = torch.isfinite(x32)
    return torch.where(finite, out, x32).to(torch.bfloat16)


class StochasticRounding:
    """Optimizer hooks: fp32 step for bf16 weights, stochastic rounding back to bf16 afterwards."""

    def __init__(self, optimizer, seed_for_step: Callable[[], int]):
        self.optimizer = optimizer
        self.seed_for_step = seed_for_step
        self.params: List[Any] = [p for g in optimizer.param_groups for p in g["params"]
                                  if p.dtype == torch.bfloat16]
        self._generators: dict = {}
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step),
                         optimizer.register_load_state_dict_pre_hook(self._pre_load),
                         optimizer.register_load_state_dict_post_hook(self._post_load)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _upcast(self) -> None:
        for p in self.params:
            p.data = p.data.to(torch.float32)
            if p.grad is not None:
                p.grad = p.grad.to(torch.float32)

    def _pre_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002
        self._upcast()
        for p in self.params:  # state loaded or made while the weight was bf16 → fp32
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dtype == torch.bfloat16:
                    optimizer.state[p][k] = v.to(torch.float32)

    def _post_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002
        seed = int(self.seed_for_step()) & 0x7FFF_FFFF_FFFF_FFFF
        for p in self.params:
            gen = self._generator(p.device)
            gen.manual_seed(seed)
            seed += 1
            p.data = stochastic_round_to_bf16(p.data, gen)
            if p.grad is not None:
                p.grad = p.grad.to(torch.bfloat16)

    def _generator(self, device):
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        return self._generators[key]

    # load_state_dict casts state to each weight's dtype: make that fp32, so fp32 state survives resume
    def _pre_load(self, optimizer, state_dict):  # noqa: ARG002
        for p in self.params:
            p.data = p.data.to(torch.float32)
        return None

    def _post_load(self, optimizer) -> None:  # noqa: ARG002
        for p in self.params:
            p.data = p.data.to(torch.bfloat16)  # exact: the values came from bf16


def fp8_available() -> bool:
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    try:
        torch.zeros(2).to(torch.float8_e4m3fn).to(torch.float32)
        return True
    except Exception:
        return False


E4M3_MAX = 448.0  # float8_e4m3fn's largest value
FP8_SKIP = ("conv_in", "conv_out", "time_embedding", "lora_")  # precision-critical ends; the adapters


def fp8_weight(module: torch.nn.Module, compute_dtype: torch.dtype) -> torch.Tensor:
    """The weight an fp8-stored layer computes with: its fp8 weight upcast, times its ``weight_scale`` where it has
    one (one value, one per output row shaped ``(out, 1[, 1, 1])``, or one per block of a row's inputs shaped
    ``(out, blocks, 1)``: :func:`block_scale`), in ``compute_dtype``. ComfyUI's
    ``scaled_fp8_ops`` (``comfy/ops.py``, commit a125cd84b054a57729b5eecab930ca9408719832) multiplies the weight cast
    to the compute dtype by the scale; here the product is taken in fp32 and then cast (the same up to the cast's
    rounding)."""
    return _upcast_fp8(module.weight, getattr(module, "weight_scale", None), compute_dtype)


class _StoredLinear(torch.autograd.Function):
    """``F.linear(x, upcast(stored, scale, dtype), bias)`` for a frozen weight stored narrower than it computes (fp8
    times its scale, NF4): the upcast is made for the forward and made again for the input's gradient in backward,
    and never kept. Nothing else is saved: the weight is frozen (no weight gradient), so backward needs no ``x``.

    What a non-reentrant checkpoint around the upcast and the op does (the op itself is not recomputed there either:
    its inputs are saved before it runs, so the recomputation stops at them), without the checkpoint's per-call
    machinery: on a CPU it added ~135 µs of host time to a layer's forward and backward, this adds ~27
    (``bench/stored_linear.py``), in each of a Flux.1 transformer's ~500 stored layers per step. Backward computes the input
    gradient as autograd does for ``F.linear``: the output gradient times the weight, in the dtype the forward's
    product ran in (autocast's), cast to ``x``'s dtype; a trainable bias gets the output gradient summed."""

    @staticmethod
    def forward(ctx, x, stored, scale, bias, upcast, dtype, cast_input):
        w = upcast(stored, scale, dtype)
        b = None if bias is None else bias.to(dtype)
        y = F.linear(x.to(dtype) if cast_input else x, w, b)
        ctx.save_for_backward(stored, scale)
        ctx.upcast, ctx.dtype, ctx.x_dtype, ctx.mm_dtype = upcast, dtype, x.dtype, y.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = ctx.upcast(stored, scale, ctx.dtype).to(ctx.mm_dtype)
            grad_x = grad.to(ctx.mm_dtype).matmul(w).to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None, None


def _upcast_fp8(weight, scale, dtype):
    """:func:`fp8_weight` of a layer's stored weight and scale (None: none)."""
    if scale is None:
        return weight.to(dtype)
    scale = scale.to(weight.device, torch.float32)
    if scale.dim() == 3 and weight.dim() != 3:  # a scale per block of each row's (flattened) inputs
        return (weight.float().reshape(scale.shape[0], scale.shape[1], -1) * scale).reshape(weight.shape).to(dtype)
    return (weight.float() * scale).to(dtype)


def _stored_forward(module, run, upcast, dtype, cast_input, scale=lambda: None):
    """The forward of a Linear/Conv2d whose frozen weight is stored narrower than it computes (``run(x)``: upcast
    and op). Where a gradient flows to the input: a Linear takes :class:`_StoredLinear`; a Conv2d, and a Linear
    inside a compiled region (dynamo traces the checkpoint, and its partitioner decides what backward recomputes;
    the compiled figures in docs/performance.md ran it), run inside a non-reentrant checkpoint, so backward
    recomputes the upcast instead of keeping it alive."""
    is_linear = isinstance(module, torch.nn.Linear)

    def forward(x):
        if not (torch.is_grad_enabled() and x.requires_grad):
            return run(x)
        if is_linear and not torch.compiler.is_compiling():
            return _StoredLinear.apply(x, module.weight, scale(), module.bias, upcast, dtype, cast_input)
        return checkpoint(run, x, use_reentrant=False, preserve_rng_state=False)

    return forward


def _fp8_forward(module, compute_dtype):
    """Forward of an fp8-stored Linear/Conv2d: upcast the weight (times its scale) for the op, and (when a gradient
    will flow through) make that upcast again in backward instead of keeping it alive until then."""

    is_linear = isinstance(module, torch.nn.Linear)

    def run(x):
        w = fp8_weight(module, compute_dtype)
        b = None if module.bias is None else module.bias.to(compute_dtype)
        return F.linear(x, w, b) if is_linear else module._conv_forward(x, w, b)

    return _stored_forward(module, run, _upcast_fp8, compute_dtype, False,
                           scale=lambda: getattr(module, "weight_scale", None))


def store_fp8(module: torch.nn.Module, weight: torch.Tensor, scale: Optional[torch.Tensor],
              compute_dtype: torch.dtype, matmul: bool = False) -> None:
    """Make ``module`` (a Linear or Conv2d, which keeps its class) hold ``weight`` (float8_e4m3fn) and ``scale``
    (None, one value, or one per output row: the ``weight_scale`` buffer, not in the state dict) and compute with
    :func:`fp8_weight`, made again from the fp8 weight in backward rather than kept (:func:`_stored_forward`).

    What reads a base weight for anything but this forward must take :func:`fp8_weight` (``module.dequantize()``):
    peft's DoRA does (it asks a layer that has ``W_q`` for ``dequantize()``, as for HQQ's layers: both are set
    here), and so do Atelier's DoRA export and OFT. ``matmul`` (``parts.denoiser.fp8_matmul``): a Linear the fp8
    kernel takes multiplies in fp8 (:mod:`trainer.memory.fp8_matmul`)."""
    if scale is not None:
        scale = _scale_shape(scale.detach().to(torch.float32), weight)
    module.weight.data = weight
    module.register_buffer("weight_scale", None if scale is None else scale.to(weight.device), persistent=False)
    # the fp8 products take one scale per output row at most (a block's scale: validate refuses the pair)
    fast = module.fp8_products = matmul and fp8_matmul.takes(module) and (scale is None or scale.dim() < 3)
    module.forward = fp8_matmul.forward_of(module, compute_dtype) if fast else _fp8_forward(module, compute_dtype)
    module.dequantize = lambda: fp8_weight(module, compute_dtype)
    # the Parameter itself, outside nn.Module's bookkeeping (assigning it normally would register a second name)
    object.__setattr__(module, "W_q", module.weight)


def quantise_with_scale(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``weight`` as float8_e4m3fn values of ``weight / scale`` (per tensor or per output row). When ``weight`` is
    an fp8 file's ``fp8 · scale`` upcast (to fp32, bf16 or fp16) this gives the file's fp8 values back exactly: the
    upcast's rounding error (at most 2⁻¹¹ relative) is far below fp8's step (2⁻³)."""
    if scale is None:
        return weight.to(torch.float8_e4m3fn)
    factor = _scale_shape(scale.detach().float().to(weight.device), weight)
    if factor.dim() == 3 and weight.dim() != 3:  # per block: at most 448 by construction, clamped for the rounding
        blocks = weight.float().reshape(factor.shape[0], factor.shape[1], -1) / factor
        return blocks.clamp(-E4M3_MAX, E4M3_MAX).reshape(weight.shape).to(torch.float8_e4m3fn)
    return (weight.float() / factor).to(torch.float8_e4m3fn)


def _scale_shape(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A scale shaped to multiply ``weight``: ``()`` for one value, ``(out, 1[, 1, 1])`` for one per output row; a
    scale per block (``(out, blocks, 1)``, :func:`block_scale`) stays as it is."""
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == 3 and weight.dim() != 3 and scale.shape[1] > 1:
        return scale
    return scale.reshape(-1, *([1] * (weight.ndim - 1)))


def row_scale(weight: torch.Tensor) -> torch.Tensor:
    """One fp32 scale per output row of ``weight`` (Linear ``[out, in]``, Conv ``[out, in, kh, kw]``) that maps the
    row's largest magnitude to float8_e4m3fn's largest value (448): ``weight / scale`` then uses fp8's whole range,
    where small weights stored as they are fall among fp8's subnormals (below 2⁻⁶) and lose their precision. musubi-
    tuner's ``--fp8_scaled`` in its per-channel mode; a row of zeros gets the smallest positive scale."""
    top = weight.detach().float().flatten(1).abs().amax(dim=1)
    return (top / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def block_scale(weight: torch.Tensor, block: int) -> torch.Tensor:
    """One fp32 scale per block of ``block`` consecutive inputs in each output row (``(out, in / block, 1)``; a
    Conv's inputs flattened with its kernel), each mapping its block's largest magnitude to fp8's 448: musubi-tuner's
    default ``--fp8_scaled`` (blocks of 64; read at commit 0c9905bebdf8a20c69f391679a01fa170205a8a3,
    ``fp8_optimization_utils.py``). A few large inputs then cost only their own block's precision, not the whole
    row's. A layer whose inputs do not divide into blocks, or make one block, gets :func:`row_scale` (musubi falls
    back to one scale for the tensor)."""
    inputs = weight[0].numel() if weight.dim() > 1 else 0
    if block < 1 or inputs % block or inputs // block < 2:
        return row_scale(weight)
    top = weight.detach().float().reshape(weight.shape[0], inputs // block, block).abs().amax(dim=2, keepdim=True)
    return (top / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def scaled_as(block: int) -> str:
    """The run log's words for ``fp8_scaled`` with ``fp8_scale_block``."""
    return f", scaled per block of {block} inputs" if block else ", scaled per output row"


def enable_fp8_storage(unet, compute_dtype, skip=FP8_SKIP, device=None, in_ram=frozenset(),
                       scales: Optional[Dict[str, torch.Tensor]] = None, only_scaled: bool = False,
                       matmul: bool = False, scaled: bool = False, block: int = 0) -> int:
    """Store the frozen Linear/Conv2d weights of ``unet`` in float8_e4m3fn; returns how many layers.

    ``scales`` (module name → scale, the names of ``unet.named_modules()``): the layers of a base loaded from an
    fp8 file with scales (see :func:`trainer.families.common.fp8_weights.dequantise_fp8`). Each is stored as
    the file stored it, its fp8 values and its scale (:func:`quantise_with_scale`); the others without a scale,
    or (``only_scaled``: the file's base without ``parts.denoiser.fp8``) not at all, as the file kept them.
    ``scaled`` (``parts.denoiser.fp8_scaled``): the layers without a file's scale get one per output row
    (:func:`row_scale`) instead of none, or with ``block`` (``fp8_scale_block``) one per block of that many inputs
    in each row (:func:`block_scale`).
    peft's wrappers name their base layer ``<layer>.base_layer``: that suffix is looked through.

    Not diffusers' ``enable_layerwise_casting``: its hooks swap each weight back to fp8 after the
    layer's forward, and a Conv2d then meets an fp8 weight in backward ("expected scalar type Float
    but found Float8_e4m3fn"); for Linear layers the upcast copy stays alive until backward, so
    training would keep a full-precision copy of the UNet anyway. Here each layer makes the upcast for its
    forward and again for its backward from the fp8 weight (:func:`_stored_forward`).
    """
    if not fp8_available():
        raise ConfigError(f"parts.denoiser.fp8 is on, but this PyTorch ({torch.__version__}) cannot store "
                          "float8_e4m3fn tensors. Update PyTorch (2.1 or newer) or turn parts.denoiser.fp8 off and "
                          "use parts.denoiser.dtype = fp16/bf16.", key="parts.denoiser.fp8")
    scales = scales or {}
    count = 0
    for name, module in unet.named_modules():
        if type(module) not in (torch.nn.Linear, torch.nn.Conv2d) or any(s in name for s in skip):
            continue
        if module.weight.requires_grad or module.weight.dtype == torch.float8_e4m3fn:
            continue
        layer = name[: -len(".base_layer")] if name.endswith(".base_layer") else name
        if only_scaled and layer not in scales:
            continue
        scale = scales.get(layer)
        weight = module.weight.data if device is None else module.weight.data.to(device)  # one layer at a time
        if scale is None and scaled:
            scale = block_scale(weight, block) if block else row_scale(weight)
        stored = _home(quantise_with_scale(weight, scale), module, in_ram)
        store_fp8(module, stored, scale, compute_dtype, matmul)
        count += 1
    return count


def _home(tensor, module, in_ram):
    """``tensor`` back in CPU RAM when ``module`` is one of the swapped blocks' (``in_ram``: their module ids)."""
    return tensor.to("cpu") if id(module) in in_ram and tensor.device.type != "cpu" else tensor


def _nf4_forward(module, state, compute_dtype):
    """Forward of an NF4-stored Linear: dequantize the packed weight for the op (bitsandbytes), recomputed in
    backward instead of kept alive until then."""
    # optional: only NF4 storage needs bitsandbytes (start-up hides it otherwise)
    from bitsandbytes.functional import dequantize_4bit

    def upcast(packed, _scale, dtype):
        return dequantize_4bit(packed.detach(), state).to(dtype)

    def run(x):
        w = upcast(module.weight, None, compute_dtype)
        b = None if module.bias is None else module.bias.to(compute_dtype)
        return F.linear(x.to(compute_dtype), w, b)

    return _stored_forward(module, run, upcast, compute_dtype, True)


def enable_nf4_storage(denoiser, compute_dtype, skip=FP8_SKIP, device=None, in_ram=frozenset()) -> int:
    """Store the frozen Linear weights of ``denoiser`` as 4-bit NF4 (bitsandbytes ``quantize_4bit``, blocks of 64
    with double-quantised statistics, as QLoRA does); returns how many layers. Like fp8 storage, a storage format:
    each layer dequantizes for its forward and again in backward (:func:`_stored_forward`) and runs in
    ``compute_dtype``; peft's LoRA layers around it see an ordinary Linear. Convolutions keep their dtype."""
    try:
        # optional: only NF4 storage needs bitsandbytes (start-up hides it otherwise)
        from bitsandbytes.functional import quantize_4bit
    except Exception as exc:  # bitsandbytes missing or without a backend for this device
        raise ConfigError(f"parts.denoiser.nf4 needs bitsandbytes, which could not be loaded here "
                          f"({type(exc).__name__}: {exc}). Install it (pip install bitsandbytes) or turn "
                          "parts.denoiser.nf4 off.", key="parts.denoiser.nf4") from None
    count = 0
    for name, module in denoiser.named_modules():
        if type(module) is not torch.nn.Linear or any(s in name for s in skip) or module.weight.requires_grad:
            continue
        if module.weight.dtype == torch.uint8:
            continue  # already packed
        weight = module.weight.data if device is None else module.weight.data.to(device)  # quantised where it runs
        packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        module.weight.data = _home(packed, module, in_ram)  # the quant state (small) stays where it was made
        module.forward = _nf4_forward(module, state, compute_dtype)
        count += 1
    return count


TEXT_FP8_SKIP = ("vision", "visual", "multi_modal_projector", "patch", "lora_")  # image towers: never run on text


def place_text_encoders(model, cfg, offloading: bool) -> None:
    """The text encoders the family left in CPU RAM (``model.deferred``: offloaded, fp8 or NF4): stored in fp8 / NF4
    where ``parts.text_encoder_N.fp8`` / ``.nf4`` asks (layer by layer on the device, back to RAM when they are
    offloaded; NF4's small quant state stays where it was made), then moved to the device unless ``offloading``
    (trainer.memory.offload moves them in only while they encode)."""

    info = getattr(model, "info", None)
    if info is None:
        return
    for slot, part_name in PART_OF_SLOT.items():
        part = info.part(slot)
        if slot == "unet" or part is None or getattr(model, part.attr, None) is None:
            continue
        module, attr = getattr(model, part.attr), part.attr
        deferred = attr in getattr(model, "deferred", ())
        kind = "nf4" if cfg.parts[part_name].get("nf4", False) else "fp8" if cfg.parts[part_name].get("fp8", False) else ""
        stored = any(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in module.parameters())
        if kind and not stored:
            device = model.device if deferred and torch.device(model.device).type != "cpu" else None
            # offloaded: the stored weights go back to RAM (the offload hooks move them in to encode); else they stay
            # where they were made (a family that placed its encoders on the device at load keeps them there)
            in_ram = frozenset(id(m) for m in module.modules()) if offloading else frozenset()
            dtype = module.dtype
            # a Linear sharing its weight with an embedding (tied lm_head) stays: the embedding must keep its dtype
            shared = {id(p) for m in module.modules() if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
                      for p in m.parameters(recurse=False)}
            tied = tuple(n for n, m in module.named_modules()
                         if isinstance(m, torch.nn.Linear) and id(m.weight) in shared)
            # what the model keeps in full precision itself (T5's wo: it casts its input to wo's dtype)
            keep = tuple(f".{n}" for n in (getattr(module, "_keep_in_fp32_modules", None) or ()))
            skip = TEXT_FP8_SKIP + tied + keep
            scaled = kind == "fp8" and bool(cfg.parts[part_name].get("fp8_scaled", False))  # row or block scales
            block = int(cfg.parts[part_name].get("fp8_scale_block", 0) or 0)
            count = (enable_nf4_storage(module, dtype, skip, device, in_ram) if kind == "nf4" else
                     enable_fp8_storage(module, dtype, skip, device, in_ram, scaled=scaled, block=block))
            logging.getLogger("atelier").info("%s storage: %d layers of %s%s", "NF4" if kind == "nf4" else "fp8", count,
                                              attr, scaled_as(block) if scaled else "")
        if deferred:
            if not offloading:
                module.to(model.device)
            model.deferred = tuple(n for n in model.deferred if n != attr)


def apply_storage(model, method, cfg) -> None:
    """fp8 / NF4 storage of the denoiser's frozen weights (once; call it as soon as the method has added its
    adapters). A denoiser the family left in CPU RAM (``model.deferred``) is quantised layer by layer on its way
    to the device, then moved there whole: its full-precision weights never sit on the GPU together (Flux.1 in
    bf16 is 22 GiB: it could not be loaded on a 24 GB card to be converted there)."""
    if getattr(model, "_storage_applied", False):
        return
    model._storage_applied = True
    denoiser = model.denoiser
    attr = model.info.part("unet").attr if hasattr(model, "info") else None
    device = model.device if attr in getattr(model, "deferred", ()) else None
    swap = getattr(model, "block_swap", None)  # parts.denoiser.blocks_to_swap: those blocks' weights stay in RAM
    in_ram = swap.members if swap is not None else frozenset()
    # a base read from an fp8 file keeps the file's fp8 values and scales (``fp8_file_scales``, set by the loader on
    # the denoiser: trainer.families.common.fp8_weights.fp8_layer_scales), with or without parts.denoiser.fp8
    file_scales = getattr(denoiser, "fp8_file_scales", None)
    if cfg.parts.denoiser.fp8 or file_scales:
        if "unet" in method.modules and cfg.training.method == "finetune":
            raise ConfigError("parts.denoiser.fp8 stores the denoiser's frozen weights in fp8, but this run trains "
                              "the whole denoiser (training.method = finetune). Use LoRA, or turn "
                              "parts.denoiser.fp8 off.", key="parts.denoiser.fp8")
        matmul = bool(cfg.parts.denoiser.get("fp8_matmul", False))  # the device: checked in the run's set-up
        scaled = bool(cfg.parts.denoiser.get("fp8_scaled", False))
        block = int(cfg.parts.denoiser.get("fp8_scale_block", 0) or 0)
        count = enable_fp8_storage(denoiser, denoiser.dtype, getattr(model, "fp8_skip", None) or FP8_SKIP, device,
                                   in_ram, file_scales, only_scaled=not cfg.parts.denoiser.fp8, matmul=matmul,
                                   scaled=scaled, block=block)
        products = sum(1 for m in denoiser.modules() if getattr(m, "fp8_products", False))
        logging.getLogger("atelier").info("fp8 storage: %d denoiser layers%s%s", count,
                                          scaled_as(block) if scaled and cfg.parts.denoiser.fp8 else "",
                                          f", {products} of them multiplying in fp8" if matmul else "")
    if cfg.parts.denoiser.get("nf4", False):
        count = enable_nf4_storage(denoiser, denoiser.dtype, getattr(model, "fp8_skip", None) or FP8_SKIP, device,
                                   in_ram)
        logging.getLogger("atelier").info("NF4 storage: %d denoiser layers", count)
    if device is not None:
        if swap is not None:  # all but the swapped blocks' frozen tensors, which get their pinned CPU copies
            swap.place(denoiser, device)
        else:
            denoiser.to(device)  # the rest: skipped layers, biases, norms, the adapters
        model.deferred = tuple(n for n in model.deferred if n != attr)
    if swap is not None:
        swap.capture()


def apply_precision(model, method, optimizer, cfg, seed_for_step: Callable[[], int],
                    warn: Optional[Callable[[str], None]] = None) -> Optional[StochasticRounding]:
    """Set up fp8/NF4 storage (when :func:`apply_storage` has not yet) and stochastic rounding for a run;
    returns the rounding hooks (or None)."""
    pc = cfg.precision
    apply_storage(model, method, cfg)
    if not pc.stochastic_rounding:
        return None
    if not any(p.dtype == torch.bfloat16 for g in optimizer.param_groups for p in g["params"]):
        if warn is not None:
            warn("precision.stochastic_rounding is on, but no trained weight is bf16 (LoRA adapters and fp32 "
                 "weights train in fp32), so it has no effect. It matters for fine-tunes with "
                 "parts.denoiser.dtype = bf16.")
        return None
    if not hasattr(optimizer, "register_step_post_hook"):
        raise ConfigError(f"precision.stochastic_rounding hooks into torch.optim.Optimizer.step, and "
                          f"{type(optimizer).__name__} is not one. Turn stochastic rounding off or pick another "
                          "optimizer.", key="precision.stochastic_rounding")
    return StochasticRounding(optimizer, seed_for_step)
