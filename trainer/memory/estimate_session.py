"""The VRAM estimate's session: the trainer's model loading on fake tensors (shapes, dtypes and storages, no data),
with the few patches the trainer's code needs under them, and CUDA's autocast policy on the CPU.

The model is built from its configs alone (:func:`config_only_pipeline` stands in for
``trainer.families.sources.load_pipeline``): the model's own diffusers folder, or the shipped configs of its
family, so a hub id or single file costs nothing to read. ``bench/random_weights.py`` uses the same loader on
real tensors to train real-size models with random weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

import diffusers
import torch
import torch.nn.functional as F
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

import trainer.families.sources as sources
from trainer.families.common import full_size

#: families with their own UNet-shaped paths in the estimate (shipped SD configs, their sample phase); the others
#: go through the family interface and their ``full_size.py``

#: where :func:`config_only_pipeline` runs the random initialisation on real tensors (None: where torch puts
#: it, the CPU). ``bench/random_weights.py`` sets "cuda" on a GPU: torch's CPU RNG is serial, ~1 min for 12B
#: parameters, the GPU's a second.
INIT_DEVICE: Optional[str] = None


class Patches:
    """Attribute patches undone in reverse order."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: Any, value: Any) -> None:
        """``obj.name = value`` (``obj[name]`` for a dict)."""
        if isinstance(obj, dict):
            self._undo.append((obj, name, obj[name]))
            obj[name] = value
            return
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            if isinstance(obj, dict):
                obj[name] = value
            else:
                setattr(obj, name, value)


def config_folder(source, mcfg, workspace: str, family: Optional[str], prediction_type: Optional[str] = None) -> Path:
    """The diffusers folder whose configs describe the model: the model's own folder, or the shipped
    config of its family (a hub id or single file is only read for its family)."""
    if source.kind == "folder":
        return Path(source.location)
    if getattr(mcfg, "config_path", ""):
        return Path(mcfg.config_path)
    pred = prediction_type or getattr(mcfg, "prediction_type", "auto")
    return full_size.config_folder(family or "sd15", Path(workspace) / "cache", None if pred == "auto" else pred)


@contextlib.contextmanager
def _default_dtype(dtype) -> Iterator[None]:
    if dtype is None or dtype not in (torch.float16, torch.bfloat16):
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def config_only_pipeline(pipeline_cls: Any, source, mcfg, workspace: str, *, family: str, dtype: Any = None,
                         prediction_type: Optional[str] = None, **common: Any):
    """Stands in for ``trainer.families.sources.load_pipeline``: the same pipeline class and components,
    built from the configs alone (random init; fake tensors under the fake session), in the dtypes
    ``load_pipeline`` would load them in — the trainer's own component loader with the weights left out."""

    def build(cls: Any, sub: Path, dt: Any) -> Any:
        init_device = torch.device(INIT_DEVICE) if INIT_DEVICE else contextlib.nullcontext()
        with _default_dtype(dt), init_device:  # built in its dtype: real tensors never need fp32 RAM
            if hasattr(cls, "load_config"):  # diffusers model
                module = cls.from_config(cls.load_config(str(sub)))
            else:  # transformers model
                module = cls(cls.config_class.from_pretrained(str(sub)))
        if dt is not None:
            module.to(dtype=dt)
        if INIT_DEVICE:  # initialised there (fast), handed to the trainer in CPU RAM as from a file
            module.to("cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()  # the build is not the trainer's memory
        return module.eval()
    with unset_fake_temporarily():  # may build the family's tiny model first: real tensors
        folder = config_folder(source, mcfg, workspace, family, prediction_type)
    sched = folder / "scheduler" / "scheduler_config.json"
    if "scheduler" not in common and sched.is_file():  # schedulers compute their tables on real tensors
        with unset_fake_temporarily():
            cls = getattr(diffusers, json.loads(sched.read_text(encoding="utf-8"))["_class_name"])
            common["scheduler"] = cls.from_pretrained(str(folder), subfolder="scheduler")
    return sources.load_components(pipeline_cls, folder, dtype, build_model=build, **common)


@contextlib.contextmanager
def session(fake: bool = True) -> Iterator[Any]:
    """Fake tensors (or real ones, for validation), with the trainer's model loading patched:

    - ``load_pipeline`` → :func:`config_only_pipeline` in the model families;
    - ``torch.utils.swap_tensors`` (``nn.Module.to`` swaps fake parameters): the fake-tensor converter's
      memo holds weak references to fake tensors it made, and ``swap_tensors`` refuses tensors with weak
      references; the memo entries of the two tensors are dropped first (they only serve conversions of
      the same real tensor again);
    - bitsandbytes' ``create_dynamic_map`` (its 8-bit code book) reads values, which fake tensors have
      not: computed on real tensors, 256 floats.
    Yields the FakeTensorMode (or None)."""
    patches = Patches()
    mode = None
    try:
        patches.set(sources, "load_pipeline", config_only_pipeline)  # the families call it through the module
        if fake:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            memo = mode.fake_tensor_converter.meta_converter.tensor_memo
            original_swap = torch.utils.swap_tensors

            def swap_tensors(t1, t2):
                for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
                    del memo[key]
                return original_swap(t1, t2)

            patches.set(torch.utils, "swap_tensors", swap_tensors)

            def nonzero_all(fake_mode, func, arg):  # noqa: ARG001
                """Boolean masks (text tokens kept) have no values here: count every element as kept, the
                most a mask can keep (the padded caption length), so memory is never under-estimated."""
                n = arg.numel()
                return arg.new_empty_strided((n, arg.dim()), (1, n), dtype=torch.int64)

            patches.set(fake_impls.op_implementations_dict, torch.ops.aten.nonzero.default, nonzero_all)
            try:
                import bitsandbytes.functional as bnb_functional  # optional: only its 8-bit optimizers need it
            except Exception:  # not installed: 8-bit optimizers fail later with the trainer's own message
                bnb_functional = None
            if bnb_functional is not None:
                real_map = bnb_functional.create_dynamic_map

                def create_dynamic_map(*args, **kwargs):
                    with unset_fake_temporarily():
                        return real_map(*args, **kwargs)

                patches.set(bnb_functional, "create_dynamic_map", create_dynamic_map)
            with mode:
                yield mode
        else:
            yield None
    finally:
        patches.undo()


#: Ops CUDA autocast runs in fp32 (torch docs, "CUDA Ops that can autocast to float32") that CPU autocast
#: leaves in bf16/fp16, and that make activation-sized tensors in SD/SDXL UNets, CLIP and VAEs, and in the
#: transformers' q/k norms (``torch.nn.RMSNorm``, unless ``training.norms_in_compute_dtype`` runs it outside autocast).
CUDA_FP32_OPS = ("group_norm", "layer_norm", "rms_norm", "softmax", "log_softmax")


class RmsNormAsCuda(torch.autograd.Function):
    """``F.rms_norm`` keeping for backward what CUDA's fused kernel keeps (``aten::_fused_rms_norm``: the input in
    its own dtype and the fp32 reciprocal RMS per row), where the CPU's composite keeps an fp32 copy of the input and
    its products: in a transformer's q/k norms that is an activation-sized fp32 tensor per norm. Same values."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        dims = tuple(range(-len(shape), 0))
        xf = x.float()
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        y = xf * rstd if weight is None else xf * rstd * weight.float()
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        gw = g if weight is None else g * weight.float()
        dx = rstd * gw - xf * rstd.pow(3) * (gw * xf).mean(ctx.dims, keepdim=True)
        dw = None
        if weight is not None and ctx.needs_input_grad[2]:
            dw = (g * xf * rstd).reshape(-1, *weight.shape).sum(0).to(weight.dtype)
        return dx.to(x.dtype), None, dw, None


def rms_norm_as_cuda(x, normalized_shape, weight=None, eps=None):
    return RmsNormAsCuda.apply(x, tuple(normalized_shape), weight, eps)


@contextlib.contextmanager
def cuda_autocast_fp32(enabled: bool = True) -> Iterator[None]:
    """While CPU autocast is on, run :data:`CUDA_FP32_OPS` in fp32 as CUDA autocast does, and ``F.rms_norm`` with
    what CUDA's fused kernel keeps for backward (:class:`RmsNormAsCuda`).

    Done by wrapping ``torch.nn.functional.<op>`` and ``Tensor.softmax``/``log_softmax`` (the modules
    call those), not with a ``TorchFunctionMode``: the autograd engine runs backward — where
    checkpointed blocks are recomputed — with torch-function modes off, so a mode would cast in the
    forward and not in the recomputation (and checkpoint refuses the mismatch). The wrappers cast the
    inputs before autograd sees them, so the fp32 copies are what autograd saves, as on CUDA."""
    if not enabled:
        yield
        return
    low = (torch.float16, torch.bfloat16)

    def up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x

    def wrap(fn):
        def fp32(*args, **kwargs):
            if kwargs.get("dtype") is None and torch.is_autocast_enabled("cpu"):
                args = tuple(up(a) for a in args)
                kwargs = {k: up(v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)
        return fp32

    patches = Patches()
    try:
        for name in CUDA_FP32_OPS:
            patches.set(F, name, wrap(rms_norm_as_cuda if name == "rms_norm" else getattr(F, name)))
        for name in ("softmax", "log_softmax"):
            patches.set(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
        yield
    finally:
        patches.undo()


def cpu_autocast(mixed_precision: str) -> Callable[[], Any]:
    """``accelerator.autocast()`` of the run, on the CPU (see :func:`cuda_autocast_fp32` for CUDA's policy)."""
    if mixed_precision not in ("fp16", "bf16"):
        return contextlib.nullcontext
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return lambda: torch.autocast("cpu", dtype=dtype)


__all__ = ["CUDA_FP32_OPS", "INIT_DEVICE", "Patches", "config_folder", "config_only_pipeline",
           "cpu_autocast", "cuda_autocast_fp32", "session"]
