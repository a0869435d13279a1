#!/usr/bin/env python3
"""Estimate the peak GPU memory of a preset's training without a GPU and without weights.

    .venv/bin/python bench/estimate_vram.py --preset sdxl-lora-8gb
    .venv/bin/python bench/estimate_vram.py --preset sdxl-lora-12gb --set training.batch_size=2
    .venv/bin/python bench/estimate_vram.py --all-memory-presets            # every *-8gb/-12gb/-16gb preset
    .venv/bin/python bench/estimate_vram.py --all-memory-presets --json     # one JSON object per preset

Why: the memory presets (``presets/*-8gb.yaml`` …) promise to fit a card, and no GPU is available to
check them. How: the real, full-size model is built from the shipped diffusers configs
(``trainer/families/common/sd_kit/configs/<family>``) under ``torch._subclasses.fake_tensor.FakeTensorMode`` — tensors
with shapes, dtypes and storages but no data, so an SDXL UNet costs no RAM — and the trainer's own code
runs on it: ``trainer.families.sources.load_model`` (only ``load_pipeline`` is swapped for a config-only
builder), ``trainer.methods.finetune.make_method`` (peft LoRA exactly as the trainer adds it, adapters
cast to fp32), gradient checkpointing as ``trainer.train.setup`` turns it on, ``trainer.optim.build.param_groups`` /
``build_optimizer`` (the real optimizer class, stepped: bitsandbytes' 8-bit ops have fake kernels,
Adafactor and AdamW run as is), ``trainer.memory.precision.apply_precision`` (fp8 storage of the frozen UNet),
and ``trainer.train.step.forward_loss`` for the step itself. :func:`live_tensor_tracker` (a
``TorchDispatchMode`` with the accounting model of torch's ``MemTracker``, without its per-module
statistics, which dominate its cost) counts the live tensor storages, rounded to the CUDA
caching allocator's 512-byte blocks, and records the peak, its breakdown and where it happened. An SDXL
preset takes 1-2 minutes and ~0.6 GB of RAM.

Phases, each with its own peak (the run's peak is the largest):

- ``load``: every component on the device in its storage dtype, before fp8 conversion (the SD/SDXL trainer
  moves the whole pipeline to the GPU first, then converts the UNet layer by layer; the transformer families
  quantise their denoiser layer by layer on its way to the GPU, so theirs counts it quantised);
- ``encode``: one VAE encode of a training batch (no grad) — the latent cache, or every step with
  ``data.cache_latents`` off — and the text-cache encode when captions are cached;
- with ``data.offload_text_encoders`` the text encoders leave the device after ``encode``: ``train`` counts
  them out, ``sample`` measures the prompt encoding (encoders in) and the denoising (encoders out) apart;
- ``train``: ``--steps`` optimizer steps (default 2, so the second runs with the optimizer state already
  there): forward with the preset's autocast, backward, gradient clipping, ``optimizer.step``,
  ``zero_grad``;
- ``sample``: one UNet call at the sampling size (batch 2 with classifier-free guidance) and one VAE
  decode, no grad, with the weights, adapters and optimizer state still on the device.

What fake mode cannot give, and what is done instead:

- torch 2.13's FakeTensorMode makes "cuda" fake tensors on a CPU-only build, but autograd on them aborts
  the process (no CUDA device guard is registered: ``c10::impl::ensureCUDADeviceGuardSet`` only covers
  CUDA builds without a device). So the model is faked on the CPU, and bytes are counted as CUDA would
  allocate them. Two CPU/CUDA differences matter for memory and are handled:
  * autocast: CPU autocast runs group_norm / layer_norm / softmax in bf16, CUDA autocast in fp32 (torch's
    "CUDA ops that can autocast to float32" list). :func:`cuda_autocast_fp32` casts those ops' inputs
    above autograd, so the fp32 copies are what autograd saves, as on CUDA.
  * attention: CPU SDPA picks its flash kernel (saves output + logsumexp), as CUDA's flash /
    memory-efficient kernels do, so attention never materialises the N×N matrix in either.
- not counted: the CUDA context and library handles (cuBLAS/cuDNN), cuDNN/cuBLAS workspaces, and the
  caching allocator's fragmentation (reserved − allocated). They are an allowance: ``--context-gib``
  (default 0.75 GiB) plus ``--fragmentation`` (default 15 %) of the peak's non-weight bytes
  (activations, gradients, optimizer state: what is allocated and freed step after step).

The method is checked in ``tests/test_estimate_vram.py`` on a small SDXL-shaped model: the fake estimate
equals, byte for byte, the same run on real CPU tensors, and on real tensors the tracked peak is 90-93 %
of the CPU allocator's own count (``torch.profiler`` allocation events; the rest are kernel-internal
temporaries such as mkldnn's convolution buffers, the CPU's counterpart of cuDNN workspaces).

Exit status: 0 when every estimate fits its card (or names none), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2 ** 30
BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
CONTEXT_GIB = 0.75  # CUDA context + cuBLAS/cuDNN handles: outside torch's allocator, not tracked
FRAGMENTATION = 0.15  # allocator slack (reserved - allocated) and kernel workspaces, x non-weight bytes
MEMORY_PRESET = re.compile(r"-(\d+)gb(?:[-.]|$)")
PHASES = ("load", "encode", "train", "sample")


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------

@dataclass
class Breakdown:
    """Bytes live at one moment, by what they are."""
    weights: int = 0       # frozen weights and buffers on the device
    trainable: int = 0     # trained weights (LoRA adapters in fp32, or the fine-tuned modules)
    grads: int = 0
    optimizer: int = 0
    activations: int = 0   # activations, their gradients and temporaries (incl. the batch)

    @property
    def total(self) -> int:
        return self.weights + self.trainable + self.grads + self.optimizer + self.activations


@dataclass
class Estimate:
    name: str
    card_gib: Optional[float]
    phases: Dict[str, Breakdown] = field(default_factory=dict)
    details: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    context_gib: float = CONTEXT_GIB
    fragmentation: float = FRAGMENTATION

    def phase_gib(self, phase: str) -> float:
        """A phase's tracked peak plus the allowance: ``fragmentation`` x its non-weight bytes (allocator
        fragmentation and kernel workspaces grow with activations, not with weights loaded once) plus
        the CUDA context."""
        b = self.phases[phase]
        dynamic = b.grads + b.optimizer + b.activations
        return (b.total + self.fragmentation * dynamic) / GiB + self.context_gib

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_gib)

    @property
    def tracked_peak(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def total_gib(self) -> float:
        """What the card must hold: the largest phase with its allowance."""
        return self.phase_gib(self.peak_phase)

    @property
    def margin_gib(self) -> Optional[float]:
        return None if self.card_gib is None else self.card_gib - self.total_gib

    @property
    def fits(self) -> Optional[bool]:
        return None if self.card_gib is None else self.margin_gib >= 0

    def to_dict(self) -> Dict[str, Any]:
        out = {"name": self.name, "card_gib": self.card_gib, "peak_phase": self.peak_phase,
               "tracked_peak_gib": round(self.tracked_peak / GiB, 3), "total_gib": round(self.total_gib, 3),
               "margin_gib": None if self.margin_gib is None else round(self.margin_gib, 3), "fits": self.fits,
               "context_gib": self.context_gib, "fragmentation": self.fragmentation,
               "phases": {k: {**{f: round(v / GiB, 3) for f, v in asdict(b).items()}, "total": round(b.total / GiB, 3)}
                          for k, b in self.phases.items()},
               "details": self.details, "notes": self.notes}
        return out


def card_gib_of(name: str) -> Optional[float]:
    """The card a memory preset is for, from its name: ``sdxl-lora-8gb`` → 8.0 (GiB: an "8 GB" card has
    8192 MiB)."""
    m = MEMORY_PRESET.search(name)
    return float(m.group(1)) if m else None


def memory_presets() -> List[str]:
    from trainer.config.load import preset_names
    return sorted((n for n in preset_names() if card_gib_of(n) is not None),
                  key=lambda n: (n.split("-")[0], card_gib_of(n) or 0, n))


# ----------------------------------------------------------------------------------------------
# the fake session: fake tensors, and the few patches the trainer's code needs under them
# ----------------------------------------------------------------------------------------------

#: families with their own UNet-shaped paths here (shipped SD configs, their sample phase); the others go through
#: the family interface and their ``full_size.py``
SD_LINEAGE = ("sd", "sdxl")


def _rounded(nbytes: int) -> int:
    """``nbytes`` in the allocator's blocks (``BLOCK``; the tests set 1 to compare with exact counts)."""
    return int(math.ceil(nbytes / BLOCK) * BLOCK) if nbytes else 0


class _Patches:
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


def _config_folder(source, mcfg, workspace: str, family: Optional[str]) -> Path:
    """The diffusers folder whose configs describe the model: the model's own folder, or the shipped
    config of its family (a hub id or single file is only read for its family)."""
    from trainer.families.common.sd_kit import sd_configs
    if source.kind == "folder":
        return Path(source.location)
    if getattr(mcfg, "config_path", ""):
        return Path(mcfg.config_path)
    from trainer.families import info_for
    if family and info_for(family).name not in SD_LINEAGE:  # the family's own full-size configs
        from trainer.families.common import full_size
        return full_size.config_folder(family, Path(workspace) / "cache")
    pred = getattr(mcfg, "prediction_type", "auto")
    name = sd_configs.default_config_for(family or "sd15", None if pred == "auto" else pred)
    return sd_configs.config_folder(name, Path(workspace) / "cache")


@contextlib.contextmanager
def _default_dtype(dtype) -> Iterator[None]:
    import torch
    if dtype is None or dtype not in (torch.float16, torch.bfloat16):
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


#: where :func:`config_only_pipeline` runs the random initialisation on real tensors (None: where torch puts
#: it, the CPU). ``bench/random_weights.py`` sets "cuda" on a GPU: torch's CPU RNG is serial, ~1 min for 12B
#: parameters, the GPU's a second.
INIT_DEVICE: Optional[str] = None


def config_only_pipeline(pipeline_cls: Any, source, mcfg, workspace: str, *, family: str, dtype: Any = None,
                         **common: Any):
    """Stands in for ``trainer.families.sources.load_pipeline``: the same pipeline class and components,
    built from the configs alone (random init; fake tensors under the fake session), in the dtypes
    ``load_pipeline`` would load them in — the trainer's own component loader with the weights left out."""
    from trainer.families.sources import load_components

    import torch

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
    import diffusers
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # may build the family's tiny model first: real tensors
        folder = _config_folder(source, mcfg, workspace, family)
    sched = folder / "scheduler" / "scheduler_config.json"
    if "scheduler" not in common and sched.is_file():  # schedulers compute their tables on real tensors
        with unset_fake_temporarily():
            cls = getattr(diffusers, json.loads(sched.read_text(encoding="utf-8"))["_class_name"])
            common["scheduler"] = cls.from_pretrained(str(folder), subfolder="scheduler")
    return load_components(pipeline_cls, folder, dtype, build_model=build, **common)


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
    import torch

    import importlib

    from trainer.families import infos
    patches = _Patches()
    mode = None
    try:
        import trainer.families.sources as models_base
        patches.set(models_base, "load_pipeline", config_only_pipeline)  # families that import it when loading
        for info in infos().values():  # and those that bound it at import
            family_module = importlib.import_module(info.family_class.split(":")[0])
            if hasattr(family_module, "load_pipeline"):
                patches.set(family_module, "load_pipeline", config_only_pipeline)
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            memo = mode.fake_tensor_converter.meta_converter.tensor_memo
            original_swap = torch.utils.swap_tensors

            def swap_tensors(t1, t2):
                for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
                    del memo[key]
                return original_swap(t1, t2)

            patches.set(torch.utils, "swap_tensors", swap_tensors)
            from torch._subclasses import fake_impls

            def nonzero_all(fake_mode, func, arg):  # noqa: ARG001
                """Boolean masks (text tokens kept) have no values here: count every element as kept, the
                most a mask can keep (the padded caption length), so memory is never under-estimated."""
                n = arg.numel()
                return arg.new_empty_strided((n, arg.dim()), (1, n), dtype=torch.int64)

            patches.set(fake_impls.op_implementations_dict, torch.ops.aten.nonzero.default, nonzero_all)
            try:
                import bitsandbytes.functional as bnb_functional
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
#: leaves in bf16/fp16, and that make activation-sized tensors in SD/SDXL UNets, CLIP and VAEs.
CUDA_FP32_OPS = ("group_norm", "layer_norm", "softmax", "log_softmax")


@contextlib.contextmanager
def cuda_autocast_fp32(enabled: bool = True) -> Iterator[None]:
    """While CPU autocast is on, run :data:`CUDA_FP32_OPS` in fp32 as CUDA autocast does.

    Done by wrapping ``torch.nn.functional.<op>`` and ``Tensor.softmax``/``log_softmax`` (the modules
    call those), not with a ``TorchFunctionMode``: the autograd engine runs backward — where
    checkpointed blocks are recomputed — with torch-function modes off, so a mode would cast in the
    forward and not in the recomputation (and checkpoint refuses the mismatch). The wrappers cast the
    inputs before autograd sees them, so the fp32 copies are what autograd saves, as on CUDA."""
    if not enabled:
        yield
        return
    import torch
    import torch.nn.functional as F
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

    patches = _Patches()
    try:
        for name in CUDA_FP32_OPS:
            patches.set(F, name, wrap(getattr(F, name)))
        for name in ("softmax", "log_softmax"):
            patches.set(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
        yield
    finally:
        patches.undo()


# ----------------------------------------------------------------------------------------------
# counting
# ----------------------------------------------------------------------------------------------

def _storages(tensors: Iterable[Any]) -> Dict[int, Any]:
    out: Dict[int, Any] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        out.setdefault(id(st), st)
    return out


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors``, in 512-byte blocks."""
    return sum(_rounded(st.nbytes()) for st in _storages(tensors).values())


def module_tensors(modules: Iterable[Any]) -> Iterator[Any]:
    for m in modules:
        if m is None:
            continue
        yield from m.parameters()
        yield from m.buffers()


def optimizer_state_tensors(optimizer) -> Iterator[Any]:
    import torch
    inner = [opt for _, _, opt in getattr(optimizer, "per_param", [])] or [optimizer]  # fused backward
    for opt in inner:
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield v


KINDS = ("weights", "trainable", "grads", "optimizer", "activations")


def live_tensor_tracker(modules: Sequence[Any], trainable: Sequence[Any], optimizer=None, extra: Sequence[Any] = ()):
    """A ``TorchDispatchMode`` that counts the bytes of live tensor storages by kind and keeps the peak.

    Why not torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which does the same: it
    also keeps per-module statistics — after every op it updates the peak of every module tracked so far
    (profiled: most of a tiny-model step's time, growing with the model) and snapshots memory at every
    module call — and it hooks the gradient of every parameter of a called module, which raises for
    frozen ones. This
    tracker keeps MemTracker's accounting model: storages are keyed by identity and released by a weak
    reference callback when the storage dies; every op's outputs are counted (views and in-place
    results share a storage and are counted once); what ``optimizer.step`` allocates is optimizer state
    (torch's global step hooks), what is made into ``.grad`` is a gradient (post-accumulate hooks), the
    rest is activations and temporaries. Bytes are rounded to the caching allocator's 512-byte blocks.
    ``peak_where`` names the op and the innermost module (forward hooks; recomputation of checkpointed
    blocks shows as "backward (recompute) in <module>") at the peak."""
    import weakref

    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    names = {id(m): n for root in modules if root is not None
             for n, m in root.named_modules(prefix=type(root).__name__)}

    class Tracker(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: Dict[int, list] = {}   # id(storage) -> [kind, bytes, weakref]
            self.now = dict.fromkeys(KINDS, 0)
            self.total = 0
            self.peak = 0
            self.at_peak = dict(self.now)
            self.peak_where = ""
            self.start = 0
            self._in_optimizer = False
            self._stack: List[str] = []
            self._handles: List[Any] = []

        # -- accounting --------------------------------------------------------------------------
        def _free(self, key: int) -> None:
            entry = self.live.pop(key, None)
            if entry is not None:
                self.now[entry[0]] -= entry[1]
                self.total -= entry[1]

        def track(self, t, kind: str, retag: bool = False) -> None:
            if not isinstance(t, torch.Tensor):
                return
            st = t.untyped_storage()
            key = id(st)
            entry = self.live.get(key)
            if entry is not None:
                size = _rounded(st.nbytes())
                if size != entry[1]:  # resized (aten.resize_, out= kernels): count the new size
                    self.now[entry[0]] += size - entry[1]
                    self.total += size - entry[1]
                    entry[1] = size
                if retag and entry[0] != kind:
                    self.now[entry[0]] -= entry[1]
                    self.now[kind] += entry[1]
                    entry[0] = kind
                return
            size = _rounded(st.nbytes())
            self.live[key] = [kind, size, weakref.ref(st, lambda _, k=key: self._free(k))]
            self.now[kind] += size
            self.total += size

        def _check_peak(self, where: str) -> None:
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = dict(self.now)
                self.peak_where = where

        def breakdown(self) -> Breakdown:
            return Breakdown(**self.at_peak)

        # -- the mode ----------------------------------------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            kind = "optimizer" if self._in_optimizer else "activations"
            for t in tree_flatten(out)[0]:
                self.track(t, kind)
            if self.total > self.peak:
                bw = torch._C._current_graph_task_id() != -1
                where = ("backward" + (" (recompute)" if bw and self._stack else "") if bw else "forward") + \
                    (f" in {self._stack[-1]}" if self._stack else "") + f", {func}"
                self._check_peak(where)
            return out

        def __enter__(self):
            for t in module_tensors(modules):
                self.track(t, "weights")
            for p in trainable:
                self.track(p, "trainable", retag=True)
                if p.grad is not None:
                    self.track(p.grad, "grads", retag=True)
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda q: self.track(q.grad, "grads", retag=True) if q.grad is not None else None))
            for t in list(optimizer_state_tensors(optimizer) if optimizer is not None else []) + list(extra):
                self.track(t, "optimizer", retag=True)
            self.start = self.peak = self.total
            self.at_peak = dict(self.now)

            def pre_step(opt, args, kwargs):  # noqa: ARG001
                self._in_optimizer = True

            def post_step(opt, args, kwargs):  # noqa: ARG001
                self._in_optimizer = False
                for t in optimizer_state_tensors(opt):
                    self.track(t, "optimizer", retag=True)

            def pre_forward(module, args):  # noqa: ARG001
                name = names.get(id(module))
                if name is not None:
                    self._stack.append(name)

            def post_forward(module, args, out):  # noqa: ARG001
                if names.get(id(module)) is not None and self._stack:
                    self._stack.pop()

            self._handles += [register_optimizer_step_pre_hook(pre_step), register_optimizer_step_post_hook(post_step),
                              register_module_forward_pre_hook(pre_forward), register_module_forward_hook(post_forward)]
            return super().__enter__()

        def __exit__(self, *exc):
            for h in self._handles:
                h.remove()
            self._handles = []
            return super().__exit__(*exc)

    return Tracker()


# ----------------------------------------------------------------------------------------------
# the run, as trainer.train sets it up and steps it
# ----------------------------------------------------------------------------------------------

def step_trainer(model, method, cfg, autocast, workspace: str):
    """A ``trainer.train.state.RunState`` (a run folder under ``workspace``, its defaults) with what
    ``trainer.train.setup.setup`` would have made that ``forward_loss`` reads: so the step is the trainer's own."""
    import torch

    from trainer.train.state import RunState
    loop = RunState(cfg, Path(workspace) / "runs" / "estimate-vram", progress=False)
    loop.model, loop.method = model, method
    loop.generator = torch.Generator().manual_seed(int(cfg.general.seed))
    loop.accelerator = type("Accelerator", (), {"autocast": staticmethod(autocast)})()
    loop.warn = lambda message: None
    return loop


def _autocast_factory(mixed_precision: str):
    """``accelerator.autocast()`` of the run, on the CPU (see :func:`cuda_autocast_fp32` for CUDA's policy)."""
    import torch
    if mixed_precision not in ("fp16", "bf16"):
        return contextlib.nullcontext
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return lambda: torch.autocast("cpu", dtype=dtype)


def train_size(cfg, resolution: Optional[str] = None) -> Tuple[int, int]:
    """(width, height) of the largest-area training bucket: the resolution (or the largest of a list)."""
    from trainer.data.buckets import parse_resolution
    sizes = parse_resolution(resolution or cfg.data.resolution)
    for concept in cfg.data.concepts or []:
        if concept.get("resolution"):
            sizes += parse_resolution(concept.resolution)
    return max(sizes, key=lambda s: (s[0] * s[1], s))


def latent_shape(model, size: Tuple[int, int]) -> Tuple[int, ...]:
    """The cached posterior's shape for one image of ``size`` (w, h), as the family's ``encode_pixels``
    makes it (packed, patchified or per-frame in some families): one encode, free on fake tensors."""
    import torch
    w, h = size
    if model.name in SD_LINEAGE:
        factor = 2 ** (len(model.vae.config.block_out_channels) - 1)
        return (int(model.vae.config.latent_channels), h // factor, w // factor)
    with torch.no_grad():
        return tuple(model.encode_pixels(torch.zeros(1, 3, h, w))["mean"].shape[1:])


def make_batch(model, method, cfg, size: Tuple[int, int], text_cached: bool, rows: Optional[int] = None,
               caption: str = "a photo of sks") -> Dict[str, Any]:
    """One data batch as ``trainer.data.pipeline`` hands it to the loop (cached latents' posterior;
    cached text outputs when the text cache serves this run)."""
    import torch

    from trainer.data.cache import as_text_dict
    b = int(cfg.training.batch_size) if rows is None else rows
    w, h = size
    lat = (b,) + latent_shape(model, size)
    captions = [caption] * b
    batch: Dict[str, Any] = {"latent_dist": {"mean": torch.zeros(lat), "std": torch.ones(lat)},
                             "loss_weights": torch.ones(b), "captions": captions, "sizes": [size] * b,
                             "original_sizes": [(h, w)] * b, "crop_top_lefts": [(0, 0)] * b,
                             "target_sizes": [(h, w)] * b}
    if cfg.data.masks:
        batch["mask"] = torch.ones(b, 1, lat[-2], lat[-1])
    if text_cached:
        with torch.no_grad():
            out = as_text_dict(model.encode_captions(method.expand_text(captions)))
        batch.update({k: v.detach().clone() for k, v in out.items()})
    if getattr(model, "inpainting", False):
        batch["inpaint_pixels"] = torch.zeros(b, 3, h, w)
    return batch


def _components(model, offloaded: Sequence[str] = ()) -> List[Any]:
    """The model's parts (denoiser, text encoders) and its VAE, less the parts in CPU RAM (``offloaded``
    slots: data.offload_text_encoders)."""
    return [m for slot, m in model.parts().items() if slot not in offloaded] + [getattr(model, "vae", None)]


def _tracker(model, method, optimizer, extra=(), offloaded: Sequence[str] = ()):
    modules = [m for m in _components(model, offloaded) if m is not None] + \
        [m for n, m in method.modules.items() if n not in model.parts()]
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    return live_tensor_tracker(modules, trained, optimizer, extra)


def run_estimate(cfg, name: str = "config", *, fake: bool = True, steps: int = 2, emulate_cuda_autocast: bool = True,
                 phases: Sequence[str] = PHASES, workspace: Optional[str] = None, resolution: Optional[str] = None,
                 card_gib: Optional[float] = None, context_gib: float = CONTEXT_GIB,
                 fragmentation: float = FRAGMENTATION, around_phase=None) -> Estimate:
    """Set up ``cfg``'s run as ``trainer.train.setup.setup`` does (on fake tensors unless ``fake`` is
    False) and measure each phase's peak; see the module docstring. ``around_phase(name)``, when given,
    is a context manager entered around each measured phase, inside the tracker (the tests put the
    profiler there); ``details[<phase>_start]`` is the tracked bytes at the phase's start."""
    around = around_phase or (lambda name: contextlib.nullcontext())
    import torch
    from omegaconf import OmegaConf

    from trainer.loss import prepare_noise_schedule
    from trainer.methods.make import make_method
    from trainer.families.sources import classify_source, load_model
    from trainer.optim.build import bitsandbytes_problem, build_optimizer, param_groups
    from trainer.optim.registry import optimizer_spec
    from trainer.memory.precision import apply_precision

    cfg = copy.deepcopy(cfg)
    workspace = workspace or str(Path(tempfile.gettempdir()) / "atelier-estimate-vram")
    OmegaConf.update(cfg, "general.workspace", workspace)
    OmegaConf.update(cfg, "model.hub_offline", True)  # only configs are read; never the network
    t = cfg.training
    est = Estimate(name=name, card_gib=card_gib if card_gib is not None else card_gib_of(name),
                   context_gib=context_gib, fragmentation=fragmentation)
    size = train_size(cfg, resolution)
    est.details.update(resolution=f"{size[0]}x{size[1]}", batch_size=int(t.batch_size),
                       gradient_accumulation_steps=int(t.gradient_accumulation_steps),
                       mixed_precision=t.mixed_precision, gradient_checkpointing=bool(t.gradient_checkpointing),
                       optimizer=t.optimizer.name, method=t.method, fp8_unet=bool(cfg.parts.denoiser.fp8),
                       unet_dtype=cfg.parts.denoiser.dtype, text_encoder_dtype=cfg.parts.text_encoder_1.dtype,
                       vae_dtype=cfg.model.vae_dtype, fake=fake, torch=torch.__version__)
    classify_source(cfg.model.path, workspace)  # builds a builtin:tiny-* model on disk (real tensors) first
    if optimizer_spec(t.optimizer.name).eight_bit:
        bitsandbytes_problem("cpu")  # the trainer's own check takes a real step: done here, outside fake mode

    with session(fake):
        model = load_model(cfg, workspace, "cpu")
        components = [m for m in _components(model) if m is not None]
        est.phases["load"] = Breakdown(weights=storage_bytes(module_tensors(components)))

        deferred = bool(getattr(model, "deferred", ()))  # quantised on the way to the device (never whole)
        method = make_method(model, cfg)
        from trainer.memory.offload import TEXT_SLOTS, plan_offload, text_frozen
        frozen_text = text_frozen(method)
        text_cached = frozen_text and bool(cfg.data.cache_text)
        offloaded: Tuple[str, ...] = ()
        if plan_offload(cfg, True, frozen_text, est.notes.append):  # the estimate's captions are cacheable
            offloaded = TEXT_SLOTS  # in CPU RAM except while they encode (trainer.memory.offload)
            est.details["text_encoders_offloaded"] = True
        from trainer.memory.precision import place_text_encoders
        place_text_encoders(model, cfg, bool(offloaded))  # fp8 text encoders, where trainer.train.setup places them
        from trainer.memory.block_swap import plan_block_swap
        swap = plan_block_swap(model, cfg, "cpu")  # blocks_to_swap, where trainer.train.setup plans it
        if deferred:
            from trainer.memory.precision import apply_storage
            apply_storage(model, method, cfg)  # where trainer.train.setup calls it
        if t.gradient_checkpointing:  # as trainer.train.setup.setup
            for m in method.modules.values():
                m.gradient_checkpointing_enable() if hasattr(m, "gradient_checkpointing_enable") else \
                    m.enable_gradient_checkpointing()
        for m in method.modules.values():
            m.train()
        groups = param_groups(method, cfg)
        optimizer = build_optimizer(groups, cfg)
        trained = [p for g in groups for p in g["params"]]
        trainable = storage_bytes(trained)
        est.details["trainable_params"] = sum(p.numel() for p in trained)
        before_fp8 = storage_bytes(module_tensors([m for m in _components(model, offloaded) if m is not None]
                                                  + list(method.modules.values())))
        est.phases["load"] = Breakdown(weights=before_fp8 - trainable, trainable=trainable)
        prepare_noise_schedule(model, cfg.loss, None)
        extra = []
        if cfg.ema.enabled and cfg.ema.device != "cpu":
            from trainer.train.ema import make_ema
            ema = make_ema(method, cfg.ema, "cpu")
            extra = list(ema.shadow_params)
        elif cfg.ema.enabled:
            est.notes.append("EMA is kept in CPU RAM (ema.device = cpu): not counted.")
        apply_precision(model, method, optimizer, cfg, lambda: 0, est.notes.append)
        est.details["weights_after_setup_gib"] = round(
            storage_bytes(module_tensors(components + list(method.modules.values()))) / GiB, 3)

        if "encode" in phases:
            w, h = size
            mt = _tracker(model, method, optimizer, extra, offloaded)
            with mt, torch.no_grad(), around("encode"):
                model.encode_pixels(torch.zeros(int(t.batch_size), 3, h, w))
                if text_cached and not offloaded:
                    model.encode_captions(["a photo of sks"] * 16)
            if text_cached and offloaded:  # the encoders in, the denoiser out (trainer.memory.offload)
                text = _tracker(model, method, optimizer, extra, ("unet",))
                with text, torch.no_grad(), around("encode"):
                    model.encode_captions(["a photo of sks"] * 16)
                saving = swap.bytes_swapped() if swap is not None else 0  # taken off the denoiser's phases below
                if text.breakdown().total > mt.breakdown().total - saving:
                    mt = text
                    est.details["encode_without_denoiser"] = True
            est.phases["encode"] = mt.breakdown()
            est.details.update(encode_peak_at=mt.peak_where, encode_start=mt.start)

        batch = make_batch(model, method, cfg, size, text_cached)
        autocast = _autocast_factory(t.mixed_precision)
        # for the whole phase, not only inside autocast: checkpointed blocks recompute in backward, under
        # the autocast state torch.utils.checkpoint restores, and must cast as the forward did
        policy = lambda: cuda_autocast_fp32(emulate_cuda_autocast)
        if "train" in phases:
            from trainer.train.step import forward_loss
            loop = step_trainer(model, method, cfg, autocast, workspace)
            accum = int(t.gradient_accumulation_steps)
            mt = _tracker(model, method, optimizer, extra, offloaded)
            with mt, policy(), around("train"):
                for _ in range(steps):
                    for _ in range(accum):
                        loss = forward_loss(loop, batch)
                        (loss / accum).backward()
                    if t.max_grad_norm > 0:
                        torch.nn.utils.clip_grad_norm_(trained, t.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            est.phases["train"] = mt.breakdown()
            est.details.update(train_peak_at=mt.peak_where, train_start=mt.start)
            est.details["optimizer_state_gib"] = round(storage_bytes(optimizer_state_tensors(optimizer)) / GiB, 4)

        prompts = list(cfg.sampling.prompts or [])
        sampling_on = prompts and (cfg.sampling.every_n_epochs or cfg.sampling.every_n_steps or cfg.sampling.at_end
                                   or cfg.sampling.at_start)
        if "sample" in phases and sampling_on:
            with policy():
                est.phases["sample"], est.details["sample_peak_at"], est.details["sample_start"] = _sample_phase(
                    model, method, optimizer, cfg, prompts, autocast, extra, around, offloaded,
                    swap.bytes_swapped() if swap is not None else 0)
            sp = max(prompts, key=lambda p: p.width * p.height)
            est.details["sample_size"] = f"{sp.width}x{sp.height}"
        if swap is not None:  # the swapped blocks' frozen weights are in CPU RAM, but for one block at a time
            saved = swap.bytes_swapped()
            est.details["blocks_swapped_gib"] = round(saved / GiB, 3)
            for phase, b in est.phases.items():
                if not (phase == "encode" and est.details.get("encode_without_denoiser")) and \
                        not getattr(b, "without_denoiser", False):
                    b.weights = max(0, b.weights - saved)
    return est


def _sample_phase(model, method, optimizer, cfg, prompts, autocast, extra, around,
                  offloaded: Sequence[str] = (), saving: int = 0) -> Tuple[Breakdown, str, int]:
    """One denoising step and one VAE decode of the largest sample, as the pipeline runs them (no grad,
    the trained modules in eval mode, batch 2 with classifier-free guidance)."""
    import torch
    sp = max(prompts, key=lambda p: p.width * p.height)
    if model.name not in SD_LINEAGE:
        return _sample_phase_generic(model, method, optimizer, cfg, sp, autocast, extra, around, offloaded, saving)
    for m in method.modules.values():
        m.eval()
    factor = 2 ** (len(model.vae.config.block_out_channels) - 1)
    n = 2 if sp.cfg_scale > 1 else 1
    unet = model.unet
    mt = _tracker(model, method, optimizer, extra)
    with mt, torch.no_grad(), autocast(), around("sample"):
        ids = model.tokenize([sp.prompt] * n)
        if model.family.startswith("sdxl"):
            embeds, pooled = model.encode_text(ids)
            added = {"text_embeds": pooled, "time_ids": model.add_time_ids([(sp.height, sp.width)] * n,
                                                                            [(0, 0)] * n, (sp.height, sp.width))}
        else:
            embeds, added = model.encode_text(ids), None
        latents = torch.zeros(n, unet.config.in_channels, sp.height // factor, sp.width // factor,
                              dtype=embeds.dtype)
        kwargs = {"added_cond_kwargs": added} if added is not None else {}
        pred = unet(latents, torch.tensor([500] * n), encoder_hidden_states=embeds, return_dict=False, **kwargs)[0]
        del pred
        image_latents = latents[:1].to(model.vae.dtype) / model.vae.config.scaling_factor
        model.vae.decode(image_latents, return_dict=False)
    for m in method.modules.values():
        m.train()
    return mt.breakdown(), mt.peak_where, mt.start


def _vae_latent(model, size: Tuple[int, int]):
    """A latent in the VAE's own layout (before the family packs or normalises it) for ``size``."""
    import torch
    w, h = size
    pixels = torch.zeros(1, 3, h, w, dtype=model.vae.dtype)
    if "QwenImage" in type(model.vae).__name__:  # a video VAE: one frame
        pixels = pixels.unsqueeze(2)
    with torch.no_grad():
        return model.vae.encode(pixels).latent_dist.mean


def _sample_phase_generic(model, method, optimizer, cfg, sp, autocast, extra, around,
                          offloaded: Sequence[str] = (), saving: int = 0) -> Tuple[Breakdown, str, int]:
    """The sample phase of a family through the family interface the training step uses: the prompt through
    the text encoders (twice with true CFG), one denoiser call on latents of the sample size, one VAE decode.
    With the text encoders offloaded (``offloaded`` slots) they are on the device only for the prompt: the two
    parts are measured apart (the encoders out of VRAM for the second) and the larger peak is the phase's."""
    import torch
    n = 2 if sp.cfg_scale > 1 and model.info.name not in ("flux", "flux2") else 1  # guidance-distilled: one pass
    size = (int(sp.width), int(sp.height))
    batch = make_batch(model, method, cfg, size, text_cached=False, rows=n, caption=sp.prompt)
    vae_latent = _vae_latent(model, size)
    dtype = model.denoiser.dtype
    for m in method.modules.values():
        m.eval()
    if offloaded:
        encode = _tracker(model, method, optimizer, extra, ("unet",))  # the denoiser out while they encode
        with encode, torch.no_grad(), autocast(), around("sample"):
            cond = model.batch_condition(batch, method.expand_text, set())
        held = [v for v in vars(cond).values() if isinstance(v, torch.Tensor)]  # the prompt's embeddings, kept
    mt = _tracker(model, method, optimizer, list(extra) + (held if offloaded else []), offloaded)
    with mt, torch.no_grad(), autocast(), around("sample"):
        if not offloaded:
            cond = model.batch_condition(batch, method.expand_text, set())
        latents = model.sample_latents(batch["latent_dist"])
        t = model.objective.sample_timesteps(n, cfg.loss, None, latents)
        pred = model.predict(model.model_input(latents, batch).to(dtype if dtype.is_floating_point and dtype.itemsize > 1
                                                                    else torch.bfloat16), t, cond)
        del pred, cond, latents
        model.vae.decode(vae_latent, return_dict=False)
    for m in method.modules.values():
        m.train()
    if offloaded and encode.breakdown().total > mt.breakdown().total - saving:  # saving: swapped blocks (below)
        out = encode.breakdown()
        out.without_denoiser = True  # the swapped blocks' saving is not taken off it
        return out, encode.peak_where, encode.start
    return mt.breakdown(), mt.peak_where, mt.start


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_table(estimates: Sequence[Estimate]) -> str:
    """A Markdown table: the peak phase's breakdown, every phase's tracked peak, total with allowance."""
    head = ("| preset | card | peak phase | weights | trainable | grads | optimizer | activations | tracked peak "
            "| load / encode / train / sample | + allowance = total | fits (margin) |")
    rows = [head, "|" + "---|" * 12]
    for e in estimates:
        b = e.phases[e.peak_phase]
        per = " / ".join(_gib(e.phases[p].total) if p in e.phases else "–" for p in PHASES)
        allowance = e.total_gib - e.tracked_peak / GiB
        fits = "–" if e.fits is None else f"{'yes' if e.fits else '**no**'} ({e.margin_gib:+.2f})"
        card = "–" if e.card_gib is None else f"{e.card_gib:g} GiB"
        rows.append(f"| {e.name} | {card} | {e.peak_phase} | {_gib(b.weights)} | {_gib(b.trainable)} | {_gib(b.grads)} "
                    f"| {_gib(b.optimizer)} | {_gib(b.activations)} | {_gib(e.tracked_peak)} | {per} "
                    f"| {allowance:.2f} = {e.total_gib:.2f} | {fits} |")
    return "\n".join(rows)


def format_report(e: Estimate) -> str:
    lines = [f"{e.name}: {e.details.get('method')} {e.details.get('resolution')} batch {e.details.get('batch_size')}"
             f" x{e.details.get('gradient_accumulation_steps')}, {e.details.get('optimizer')}, "
             f"unet {e.details.get('unet_dtype')}{' fp8 storage' if e.details.get('fp8_unet') else ''}, "
             f"autocast {e.details.get('mixed_precision')}, checkpointing "
             f"{'on' if e.details.get('gradient_checkpointing') else 'off'}"]
    lines.append(f"  {'phase':<8} {'weights':>8} {'trainable':>9} {'grads':>7} {'optim':>7} {'activ':>7} "
                 f"{'total':>7}  GiB")
    for p, b in e.phases.items():
        lines.append(f"  {p:<8} {_gib(b.weights):>8} {_gib(b.trainable):>9} {_gib(b.grads):>7} {_gib(b.optimizer):>7} "
                     f"{_gib(b.activations):>7} {_gib(b.total):>7}")
    allowance = e.total_gib - e.tracked_peak / GiB
    verdict = "" if e.fits is None else (f" -> fits {e.card_gib:g} GiB, margin {e.margin_gib:+.2f} GiB" if e.fits
                                          else f" -> does NOT fit {e.card_gib:g} GiB ({e.margin_gib:+.2f} GiB)")
    lines.append(f"  peak {e.peak_phase}: {_gib(e.tracked_peak)} tracked + {allowance:.2f} allowance "
                 f"({e.context_gib:g} context + {e.fragmentation:.0%} of non-weights) = {e.total_gib:.2f} GiB{verdict}")
    where = e.details.get(f"{e.peak_phase}_peak_at")
    if where:
        lines.append(f"  the {e.peak_phase} peak is reached {where}")
    for n in e.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", action="append", help="preset name (repeatable)")
    what.add_argument("--config", help="a run's config YAML (as the UI or a run folder has it)")
    what.add_argument("--all-memory-presets", action="store_true", help="every *-<N>gb preset")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    ap.add_argument("--card-gib", type=float, help="card size to check against (default: from the preset name)")
    ap.add_argument("--context-gib", type=float, default=CONTEXT_GIB, help="CUDA context allowance (GiB)")
    ap.add_argument("--fragmentation", type=float, default=FRAGMENTATION,
                    help="allocator fragmentation + kernel workspaces, as a fraction of the peak's non-weight bytes")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps measured (>= 2: state exists)")
    ap.add_argument("--resolution", help="override the training size for the estimate (e.g. 1024x1024)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma list of " + ", ".join(PHASES))
    ap.add_argument("--no-cuda-autocast", action="store_true", help="keep CPU autocast's op policy")
    ap.add_argument("--real", action="store_true", help="real tensors instead of fake (small models only!)")
    ap.add_argument("--workspace", help="where shipped configs are materialised (default: a temp folder)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per estimate")
    args = ap.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging
    import warnings
    logging.getLogger("atelier").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    from trainer.config.checks import load_config

    jobs: List[Tuple[str, Any]] = []
    if args.config:
        jobs.append((Path(args.config).stem, load_config(args.config, args.set)))
    else:
        for name in (memory_presets() if args.all_memory_presets else args.preset):
            jobs.append((name, load_config(None, args.set, preset=name)))
    results = []
    for name, cfg in jobs:
        est = run_estimate(cfg, name, fake=not args.real, steps=args.steps,
                           emulate_cuda_autocast=not args.no_cuda_autocast, phases=args.phases.split(","),
                           workspace=args.workspace, resolution=args.resolution, card_gib=args.card_gib,
                           context_gib=args.context_gib, fragmentation=args.fragmentation)
        results.append(est)
        print(json.dumps(est.to_dict()) if args.json else format_report(est), flush=True)
    if not args.json:
        print()
        print(format_table(results))
    return 0 if all(e.fits is not False for e in results) else 1


if __name__ == "__main__":
    sys.exit(main())
