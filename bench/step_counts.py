#!/usr/bin/env python3
"""Count the host work of one optimizer step on the CPU: aten ops, device syncs, blocking host-to-device copies and
Python calls, each by call site.

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_counts.py demo demo-sdxl demo-flux
    OMP_NUM_THREADS=1 .venv/bin/python bench/step_counts.py sd15        # real-size SD 1.5 topology, random weights
    OMP_NUM_THREADS=1 .venv/bin/python bench/step_counts.py demo --sites 15 --set training.batch_size=4
    OMP_NUM_THREADS=1 .venv/bin/python bench/step_counts.py --compiled sd15 demo demo-sdxl demo-flux   # compile counts
    OMP_NUM_THREADS=1 .venv/bin/python bench/step_counts.py flux-depth-bf16 bare-flux-depth  # against diffusers' script

A step's GPU time is only as good as the host's ability to queue it: every aten op is a kernel launch (or host work
around one: the "of them kernels" count leaves out views, allocations and host reads, which launch none), every
device sync drains the GPU's queue, every copy from unpinned memory (or without ``non_blocking``) waits for the copy.
These counts do not depend on the machine, so they are taken here, on the CPU, through the
trainer's own ``python -m trainer train`` in this process: steps after the warm-up ones are counted one by one
(the boundary is the loop's end-of-step hook) and the median is printed.

On the CPU the training device *is* the host, so "on the device" is tracked, as CUDA would have it:

- a tensor is on the device when it is a weight or buffer of the model, the result of ``.to(<a torch.device>)``
  (or ``copy_`` into a device tensor), a factory given ``device=<a torch.device>`` (a ``torch.Generator``'s
  ``.device`` included), or computed from one of those; everything else (the data pipeline's batches, draws
  without ``device=``, ``torch.tensor`` of Python numbers) is on the host;
- a **sync** is an op that must read a device tensor's value on the host: ``item``/``_local_scalar_dense``,
  ``is_nonzero`` (``bool(t)``), ``nonzero``, ``masked_select``, ``unique``, boolean indexing, ``equal``, and
  ``tolist``/``cpu``/``numpy`` of a device tensor;
- a **blocking copy** is a host tensor moved to the device without ``non_blocking=True`` (on CUDA the trainer pins
  what it moves with ``non_blocking``), and ``torch.tensor(<Python data>, device=…)``.

Python calls are counted in separate steps (``sys.setprofile``, 'call' events; the counter's own frames left out),
so the op counting's hooks do not inflate them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
# PYTHONPATH=<another checkout> counts that checkout's trainer; a PYTHONPATH without one (carried wheels) counts this
if importlib.util.find_spec("trainer") is None:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: E402

import bare_diffusers_step  # noqa: E402  (bench/'s own modules, beside this file)
import bare_flux_step  # noqa: E402
from trainer.train import compile as compile_counts  # noqa: E402

THIS = os.path.abspath(__file__)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
DEMO_DATA = ROOT / "presets" / "demo-data"

# what each case trains: a preset and its settings (the data: the demo images, one repeat, no samples, no backups)
COMMON = ["sampling.prompts=[]", "sampling.every_n_epochs=0", "sampling.at_end=false",
          "backup.every_n_epochs=0", "backup.every_n_steps=0", "output.save_every_n_epochs=0",
          "general.tensorboard=false", "general.dataloader_workers=0"]
CASES: Dict[str, Dict[str, Any]] = {
    "demo": {"preset": "demo", "sets": []},
    "demo-sdxl": {"preset": "demo-sdxl", "sets": []},
    "demo-flux": {"preset": "demo-flux", "sets": []},
    # SD 1.5's real topology and widths (the shipped full-size configs, random weights) at 64 px: the ops, syncs and
    # copies of a 512 px step, at a CPU's pace. bf16 autocast, batch 4, LoRA rank 16, no checkpointing
    "sd15": {"preset": "sd15-lora", "random_weights": True,
             "sets": ["data.resolution=64", "training.batch_size=4", "training.mixed_precision=bf16",
                      "parts.denoiser.dtype=bf16", "parts.text_encoder_1.dtype=bf16", "model.vae_dtype=bf16",
                      "training.gradient_checkpointing=false", "lora.rank=16", "training.lr_warmup_steps=0"]},
}
# Flux.1 [dev] at real size from the 24 GB preset (fp8 base, checkpointing), the side-by-side's settings: for a GPU
# (--profile there); the CPU lacks the RAM for its 12B random weights
CASES["flux"] = {"preset": "flux-lora-24gb", "random_weights": True,
                 "sets": ["training.batch_size=1", "lora.rank=16", "lora.alpha=16", "training.optimizer.name=adamw",
                          "training.lr_warmup_steps=0", "data.resolution=1024",
                          "data.max_upscale=0"]}  # the 96 px demo images enlarged to the 1024 px bucket
# Flux.1 [dev]'s real depth (19 double and 38 single blocks, every layer and LoRA of them) at widths a CPU holds: a
# step's ops, syncs, copies and Python calls do not depend on the widths, so these are the real step's host work.
# The 24 GB preset's settings (fp8 storage, checkpointing, LoRA rank 16), the image at 256 px (the ops of 1024 px)
CASES["flux-depth"] = {"preset": "flux-lora-24gb", "random_weights": True,
                       "narrow": {"transformer": {"attention_head_dim": 16, "num_attention_heads": 2,
                                                  "axes_dims_rope": [4, 6, 6], "joint_attention_dim": 32,
                                                  "pooled_projection_dim": 32},
                                  "text_encoder": {"hidden_size": 32, "intermediate_size": 64,
                                                   "num_hidden_layers": 2, "num_attention_heads": 2,
                                                   "projection_dim": 32},
                                  "text_encoder_2": {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2,
                                                     "num_layers": 2, "num_decoder_layers": 2}},
                       "sets": ["training.batch_size=1", "lora.rank=16", "lora.alpha=16",
                                "training.optimizer.name=adamw", "training.lr_warmup_steps=0",
                                "data.resolution=256", "data.max_upscale=0", "parts.denoiser.dtype=bf16"]}
# every demo preset (each family's tiny model), by its name: `step_counts.py demo-wan demo-qwen-image …`
for _demo in sorted((ROOT / "presets").glob("demo*.yaml")):
    CASES.setdefault(_demo.stem, {"preset": _demo.stem, "sets": []})
# the flux-depth case with the transformer stored in bf16, as diffusers' example script stores it (the side-by-side's
# flux-bf16 rows; bare-flux-depth is that script's step)
CASES["flux-depth-bf16"] = {**CASES["flux-depth"], "sets": CASES["flux-depth"]["sets"] + ["parts.denoiser.fp8=false"]}
# not Atelier: diffusers' example steps with peft at a case's settings (count_bare). bare-sd15: the sd15 case's;
# bare-flux-depth: flux-depth-bf16's (the same LoRA layers); bare-flux-depth-example-targets: the script's default
# --lora_layers, which adds the double blocks' feed-forwards (what the side-by-side's example rows ran until 2026-11-28)
BARES = {"bare-sd15": lambda cache: bare_diffusers_step.build(cache),
         "bare-flux-depth": lambda cache: bare_flux_step.build(CASES["flux-depth"]["narrow"]["transformer"]),
         "bare-flux-depth-example-targets": lambda cache: bare_flux_step.build(
             CASES["flux-depth"]["narrow"]["transformer"], targets=bare_flux_step.EXAMPLE_TARGETS)}
BARE = "bare-sd15"
CASES["sd15-checkpointing"] = {**CASES["sd15"], "sets": CASES["sd15"]["sets"][:-3]
                               + ["training.gradient_checkpointing=true", "lora.rank=16",
                                  "training.lr_warmup_steps=0"]}

SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "equal", "nonzero_static"}
FACTORIES = {"randn", "rand", "randint", "normal", "randperm", "zeros", "ones", "empty", "full", "arange",
             "linspace", "logspace", "eye", "tensor", "as_tensor", "zeros_like", "ones_like", "empty_like",
             "full_like", "rand_like", "randn_like", "randint_like", "scalar_tensor"}
# no kernel on a GPU: besides the view ops (``OpOverload.is_view``: view, t, detach, expand, slice …), these
NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_",
             "_local_scalar_dense"}  # the last: a read of a device value (counted as a sync)
FROM_PYTHON = {"tensor", "as_tensor"}  # data copied from Python objects (pageable): a blocking copy to a device


def call_site() -> str:
    """The first frame outside torch and this file: who asked."""
    f = sys._getframe(2)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if name != THIS and not name.startswith(TORCH_DIR) and "contextlib" not in name:
            short = name
            for anchor in ("site-packages" + os.sep, str(ROOT) + os.sep):
                if anchor in short:
                    short = short.split(anchor, 1)[1]
            return f"{short}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class Tally:
    """What the counted steps did (every counter is cumulative; the steps' boundaries take snapshots)."""

    def __init__(self) -> None:
        self.ops = 0
        self.kernels = 0  # ops that run a kernel on a GPU (not views, allocations or host reads)
        self.op_names: Counter = Counter()
        self.syncs: Counter = Counter()  # (what, site)
        self.copies: Counter = Counter()  # (blocking?, site)
        self.late: Counter = Counter()  # non-blocking copies to the host (read a step later)
        self.calls = 0

    def snapshot(self) -> dict:
        return {"ops": self.ops, "kernel_ops": self.kernels, "syncs": sum(self.syncs.values()),
                "blocking_copies": sum(n for (blocking, _), n in self.copies.items() if blocking),
                "async_copies": sum(n for (blocking, _), n in self.copies.items() if not blocking),
                "late_reads": sum(self.late.values()),
                "python_calls": self.calls, "sync_sites": Counter(self.syncs), "copy_sites": Counter(self.copies),
                "op_names": Counter(self.op_names)}


class DeviceTracker(TorchFunctionMode):
    """Which tensors are on the (pretend) device, the host reads of device tensors and the copies to it, at the
    level of torch's Python functions (``tolist``/``cpu`` do not reach the dispatcher on the CPU)."""

    def __init__(self, tally: Tally, on_device: WeakTensorKeyDictionary) -> None:
        super().__init__()
        self.tally = tally
        self.dev = on_device

    def is_dev(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        from_dev = any(self.is_dev(t) for t in tensors)
        target = None  # where a move goes: True device, False host, None not a move
        if name in ("to", "cuda", "cpu", "copy_") and tensors:
            src = tensors[0] if name != "copy_" else (args[1] if len(args) > 1 else kwargs.get("src"))
            if name == "cpu":
                target = False
            elif name == "cuda":
                target = True
            elif name == "copy_":
                target = self.is_dev(args[0])
            else:
                for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
                    if isinstance(a, torch.device):
                        target = True
                    elif isinstance(a, str):
                        target = a != "cpu"
                    elif isinstance(a, torch.Tensor):
                        target = self.is_dev(a)
            blocking = not (kwargs.get("non_blocking") or (len(args) > 3 and args[3] is True and name == "to")
                            or (name == "copy_" and (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))))
            if target is True and isinstance(src, torch.Tensor) and not self.is_dev(src):
                self.tally.copies[(blocking, call_site())] += 1
            elif target is False and self.is_dev(src):
                if blocking:
                    self.tally.syncs[(name, call_site())] += 1
                else:  # into host memory without blocking: read later, after waiting for its own step's event
                    self.tally.late[call_site()] += 1
        elif name in ("tolist", "numpy") and from_dev:
            self.tally.syncs[(name, call_site())] += 1
        out = func(*args, **kwargs)
        if target is not None and isinstance(src, torch.Tensor) and out is src and self.is_dev(src) != target:
            # on CUDA a move between host and device makes a new tensor and leaves the one moved where it was; on the
            # CPU it is the same object, which would then count as on both sides: a copy of it (made outside the
            # counting) is the moved tensor
            with _disable_current_modes():
                out = out.clone()
        if name in FACTORIES and not from_dev:
            device = kwargs.get("device")
            gen = kwargs.get("generator")
            made_on_dev = isinstance(device, torch.device) or (isinstance(device, str) and device != "cpu") \
                or (device is None and isinstance(gen, torch.Generator) and gen.device.type != "cpu")
            if made_on_dev and name in FROM_PYTHON and not tensors:
                self.tally.copies[(True, call_site())] += 1
            mark = made_on_dev
        elif target is not None:
            mark = target
        else:
            mark = from_dev
        if mark:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.dev[o] = True
        return out


class OpCounter(TorchDispatchMode):
    """Every aten op, and the ones that read a device tensor's value on the host."""

    def __init__(self, tally: Tally, on_device: WeakTensorKeyDictionary) -> None:
        super().__init__()
        self.tally = tally
        self.dev = on_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.tally.ops += 1
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_KERNEL):
            self.tally.kernels += 1
        self.tally.op_names[name] += 1
        first = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), None)
        sync = name in SYNC_OPS
        if name in ("index", "index_put_", "index_put") and len(args) > 1:  # x[mask]: a nonzero inside
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if sync and first is not None and first in self.dev:
            self.tally.syncs[(name, call_site())] += 1
        return func(*args, **(kwargs or {}))


class Counting:
    """The loop's end-of-step hook: steps 1..warmup run plain (the last of them tracked, not counted), the next
    ``count`` steps under the op and device counters, the next ``count`` under ``sys.setprofile``; a snapshot at
    every boundary."""

    def __init__(self, warmup: int, count: int) -> None:
        self.warmup, self.count = warmup, count
        self.tally = Tally()
        self.dev = WeakTensorKeyDictionary()
        self.step = 0
        self.snaps: List[dict] = []
        self.modes: List[Any] = []
        self.state = None

    def seed_device(self) -> None:
        """The model's weights and buffers are on the device (found through the live RunState)."""
        import gc
        from trainer.train.state import RunState
        for obj in gc.get_objects():
            if isinstance(obj, RunState) and obj.model is not None:
                self.state = obj
        if self.state is None:
            return
        for name in dir(self.state.model):
            m = getattr(self.state.model, name, None)
            if isinstance(m, torch.nn.Module):
                for t in list(m.parameters()) + list(m.buffers()):
                    self.dev[t] = True

    def profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename != THIS:
            self.tally.calls += 1

    def start(self) -> None:
        """After the run's set-up, before its first step: where tensors are is tracked from here (what a step moves
        to the device at its first use, a scheduler's table or a family's rotary tables, is known to be there when
        counting starts); the counting starts after the warm-up."""
        self.seed_device()
        self.modes = [DeviceTracker(self.tally, self.dev)]
        self.modes[0].__enter__()

    def __call__(self) -> None:
        self.step += 1
        if self.step == self.warmup - 1:  # one step tracked before counting
            if not self.modes:  # not started after the set-up (a bare step): tracked from here
                self.seed_device()
                self.modes = [DeviceTracker(self.tally, self.dev)]
                self.modes[0].__enter__()
            self.modes.append(OpCounter(self.tally, self.dev))
            self.modes[-1].__enter__()
        elif self.step == self.warmup + self.count:
            for m in reversed(self.modes):
                m.__exit__(None, None, None)
            self.modes = []
            sys.setprofile(self.profile)
        elif self.step == self.warmup + 2 * self.count:
            sys.setprofile(None)
        if self.warmup <= self.step <= self.warmup + 2 * self.count:
            self.snaps.append(self.tally.snapshot())


class Profiling:
    """The loop's end-of-step hook for ``--profile``: one step after the warm-up under ``torch.profiler`` (CPU and,
    on a GPU, CUDA activity): the top kernels (or CPU ops) by time and, on a GPU, how long it sat idle between
    kernels in that step (host gaps: the GPU waiting for the host to queue work)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.step = 0
        self.prof = None
        self.result: Dict[str, Any] = {}

    def __call__(self) -> None:
        self.step += 1
        cuda = torch.cuda.is_available()
        if self.step == self.warmup:
            if cuda:
                torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        elif self.step == self.warmup + 1 and self.prof is not None:
            if cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.result = summarise(self.prof, cuda)
            self.prof = None


class CompileCounting:
    """The loop's end-of-step hook for ``--compiled``: torch's compile counters at every step's end (no op counting:
    its modes would be guarded on and recompile the blocks), and the Python calls of the last of ``steps`` steps
    (``sys.setprofile``, which dynamo does not guard on; the counter's own frames left out)."""

    def __init__(self, steps: int = 0) -> None:
        self.snaps: List[Dict[str, int]] = [compile_counts.dynamo_counts()]
        self.steps = steps
        self.calls: Optional[int] = None
        self.counting = 0
        try:  # the profile function runs inside compiled blocks: dynamo would look at its frame, counted as a frame
            torch._dynamo.eval_frame.skip_code(CompileCounting.count.__code__)
        except AttributeError:  # a torch without it: one frame more in the counted step
            pass

    def count(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename != THIS:
            self.counting += 1

    def __call__(self) -> None:
        self.snaps.append(compile_counts.dynamo_counts())
        done = len(self.snaps) - 1
        if self.steps and done == self.steps:
            sys.setprofile(None)
            self.calls = self.counting
        elif self.steps and done == self.steps - 1:
            sys.setprofile(self.count)


def run_compiled(case: str, extra: List[str], steps: int, workspace: Path, backend: str = "eager",
                 run_name: str = "") -> dict:
    """Train ``case`` with training.compile (torch.compile ``backend``: eager traces as inductor does without
    generating kernels) for ``steps`` steps: graph breaks (and why), frames compiled in the first step and in each
    later one (recompiles), the graphs made and the blocks compiled; the backends but inductor also tell how many
    of the graphs have symbolic sizes (``training.compile_dynamic``)."""
    from compile_shapes import has_symbolic_sizes
    from torch._dynamo.backends.registry import lookup_backend

    from trainer.train import setup
    hook = CompileCounting(steps)
    blocks: Dict[str, int] = {}
    lora = [0]
    symbolic: List[bool] = []
    original = setup.compile_blocks
    torch._dynamo.reset()  # another case's compiled blocks (the same classes) would be guarded on and recompiled

    def recording(gm, example_inputs):  # the backend, noting whether the graph's sizes are symbolic
        symbolic.append(has_symbolic_sizes(gm))
        return lookup_backend(backend)(gm, example_inputs)

    def compile_with(model, mode="default", *args, **options):
        if backend != "inductor":  # a mode is inductor's; the other backends take none
            mode = "default"
        blocks.update(original(model, mode, *args, backend=backend if backend == "inductor" else recording,
                               **options))
        lora[0] = sum(1 for m in model.modules() if type(m).__name__ in blocks  # peft's layers inside the blocks
                      for sub in m.modules() if hasattr(sub, "lora_A"))
        return blocks
    setup.compile_blocks = compile_with
    before = dict(compile_counts.graph_break_reasons())
    try:
        train_case(case, ["training.compile=true", *extra], steps, workspace, run_name or f"{case}-compiled", hook)
    finally:
        setup.compile_blocks = original
    s = hook.snaps
    if len(s) < steps + 1:
        raise SystemExit(f"{case}: the compiled run stopped after {len(s) - 1} steps")
    later = [s[i + 1]["frames_compiled"] - s[i]["frames_compiled"] for i in range(1, steps)]
    reasons = {k: v - before.get(k, 0) for k, v in compile_counts.graph_break_reasons().items()
               if v > before.get(k, 0)}
    return {"graph_breaks": s[-1]["graph_breaks"] - s[0]["graph_breaks"], "break_reasons": reasons,
            "first_step_frames": s[1]["frames_compiled"] - s[0]["frames_compiled"],
            "recompiles_per_step": statistics.median(later) if later else 0, "recompiles_after_first": sum(later),
            "graphs": s[-1]["graphs"] - s[0]["graphs"], "blocks": compile_counts.describe(blocks),
            "lora_layers_in_blocks": lora[0], "python_calls_last_step": hook.calls,
            "symbolic_graphs": None if backend == "inductor" else sum(symbolic)}


def summarise(prof: Any, cuda: bool, top: int = 15) -> Dict[str, Any]:
    """Top kernels (CUDA) or ops (CPU) by total time, and the GPU's busy and idle time over the profiled step."""
    key = "cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    out: Dict[str, Any] = {"table": table}
    if cuda:
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        busy, end = 0.0, None
        for a, b in spans:
            if end is None or a > end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        window = (spans[-1][1] - spans[0][0]) if spans else 0.0
        out.update(kernels=len(spans), gpu_window_ms=round(window / 1000, 2), gpu_busy_ms=round(busy / 1000, 2),
                   gpu_idle_ms=round((window - busy) / 1000, 2))
    return out


def per_step(snaps: List[dict], count: int) -> dict:
    """Medians over the counted steps (op steps: snapshots 0..count, Python steps: count..2·count)."""
    def diffs(key, lo, hi):
        return [snaps[i + 1][key] - snaps[i][key] for i in range(lo, hi)]
    out = {k: statistics.median(diffs(k, 0, count)) for k in ("ops", "kernel_ops", "syncs", "blocking_copies",
                                                                  "async_copies", "late_reads")}
    out["python_calls"] = statistics.median(diffs("python_calls", count, 2 * count))
    first, last = snaps[0], snaps[count]
    for key in ("sync_sites", "copy_sites", "op_names"):
        out[key] = {(k if isinstance(k, str) else " ".join(str(x) for x in k)): v / count
                    for k, v in (last[key] - first[key]).most_common()}
    return out


@contextlib.contextmanager
def narrowed(narrow: Optional[Dict[str, Dict[str, Any]]]):
    """The Flux.1 full-size configs with ``narrow``'s values laid over their components (a case's real depth at
    small widths), for the run inside."""
    if not narrow:
        yield
        return
    from trainer.families.flux import full_size
    saved = full_size.FULL_SIZE
    full_size.FULL_SIZE = {variant: {**spec, "configs": {part: {**cfg, **narrow.get(part, {})}
                                                         for part, cfg in spec["configs"].items()}}
                           for variant, spec in saved.items()}
    try:
        yield
    finally:
        full_size.FULL_SIZE = saved


def train_case(case: str, extra: List[str], steps: int, workspace: Path, run_name: str, hook: Any) -> None:
    """Train ``case`` for ``steps`` steps in this process, ``hook`` called at each step's end; SystemExit with the
    log's tail when the run fails."""
    from trainer import __main__ as cli
    from trainer.train import loop
    spec = CASES[case]
    sets = [*COMMON, f"data.concepts=[{{path: {DEMO_DATA}}}]", f"training.max_steps={steps}", *spec["sets"], *extra]
    argv = ["train", "--preset", spec["preset"], "--no-progress", "--set", f"general.workspace={workspace}",
            "--set", f"general.run_name={run_name}", *[x for s in sets for x in ("--set", s)]]
    original, original_setup = loop.resume_gc, loop.setup
    loop.resume_gc = lambda: (original(), hook())
    if hasattr(hook, "start"):  # device tracking from the first step on (counting after the warm-up)
        loop.setup = lambda state: (original_setup(state), hook.start())
    try:
        ctx = contextlib.nullcontext()
        if spec.get("random_weights"):
            from trainer.memory import estimate_session
            if torch.cuda.is_available():  # random init on the GPU (fast), then in CPU RAM as a loaded file's
                estimate_session.INIT_DEVICE = "cuda"
            ctx = estimate_session.session(fake=False)
        with ctx, narrowed(spec.get("narrow")):
            rc = cli.main(argv)
    finally:
        loop.resume_gc, loop.setup = original, original_setup
        sys.setprofile(None)
    if rc != 0:
        log = workspace / "runs" / run_name / "train.log"
        raise SystemExit(f"{case}: the run failed (rc {rc})\n" + (log.read_text()[-3000:] if log.exists() else ""))


def run_case(case: str, extra: List[str], warmup: int, count: int, workspace: Path, run_name: str = "",
             profile: bool = False) -> dict:
    """Train ``case`` in this process and count its steps after ``warmup``: per-step medians and per-site means
    (``profile``: one step under torch.profiler instead, see :class:`Profiling`)."""
    hook = Profiling(warmup) if profile else Counting(warmup, count)
    train_case(case, extra, warmup + 2 * count + 1, workspace, run_name or case, hook)
    if profile:
        if not hook.result:
            raise SystemExit(f"{case}: the profiled run made no profile")
        return hook.result
    if len(hook.snaps) < 2 * count + 1:
        raise SystemExit(f"{case}: the run stopped early ({len(hook.snaps)} boundaries)")
    return per_step(hook.snaps, count)


def count_bare(workspace: Path, warmup: int, count: int, case: str = BARE) -> dict:
    """A bare case's counts (:data:`BARES`: bench/bare_diffusers_step.py's or bare_flux_step.py's step, diffusers'
    example loop with peft), as :func:`run_case` counts Atelier's."""
    step, resident = BARES[case](workspace / "bare-cache")
    hook = Counting(warmup, count)
    for _ in range(warmup + 2 * count + 1):
        if hook.step == warmup - 1:  # the hook's seeding looks for a RunState; here the resident tensors are known
            for t in resident():
                hook.dev[t] = True
        step()
        hook()
    sys.setprofile(None)
    return per_step(hook.snaps, count)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", default=["demo", "demo-sdxl", "demo-flux"], choices=sorted([*CASES, *BARES]))
    ap.add_argument("--set", action="append", default=[], help="one more setting for every case (key=value)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before counting (at least 2)")
    ap.add_argument("--count", type=int, default=3, help="steps counted (ops), then as many (Python calls)")
    ap.add_argument("--sites", type=int, default=8, help="call sites shown for syncs and copies")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="profile one step after the warm-up with torch.profiler instead of counting (on a GPU: top "
                         "kernels and the GPU's idle time between kernels)")
    ap.add_argument("--compiled", action="store_true",
                    help="train with training.compile and count torch.compile's work instead: graph breaks (and "
                         "why), recompiles per step after the first, graphs made, blocks compiled")
    ap.add_argument("--backend", default="eager", choices=["eager", "aot_eager", "inductor"],
                    help="--compiled: torch.compile's backend (eager: dynamo's tracing alone, no kernels made; the "
                         "graph breaks and recompiles are inductor's)")
    ap.add_argument("--workspace", help="workspace to train in (default: a temporary folder)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            try:
                if args.compiled:
                    rows[case] = run_compiled(case, args.set, args.warmup + args.count, Path(args.workspace or tmp),
                                              backend=args.backend)
                elif case in BARES:
                    rows[case] = count_bare(Path(args.workspace or tmp), args.warmup, args.count, case)
                else:
                    rows[case] = run_case(case, args.set, args.warmup, args.count, Path(args.workspace or tmp),
                                          profile=args.profile)
            except SystemExit as exc:
                print(exc, file=sys.stderr)
                traceback.print_exc()
                return 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if args.compiled:
        print(f"\n| case (training.compile, backend {args.backend}) | blocks compiled | graph breaks | frames compiled "
              "in step 1 | recompiles per later step | graphs | LoRA layers inside | Python calls (last step) |"
              "\n|---|---|---|---|---|---|---|---|")
        for case, r in rows.items():
            print(f"| {case} | {r['blocks']} | {r['graph_breaks']} | {r['first_step_frames']} "
                  f"| {r['recompiles_per_step']:g} | {r['graphs']} | {r['lora_layers_in_blocks']} "
                  f"| {r['python_calls_last_step']} |")
            for reason, n in r["break_reasons"].items():
                print(f"  graph break {n} x {reason}")
        return 0
    if args.profile:
        for case, r in rows.items():
            gaps = {k: v for k, v in r.items() if k != "table"}
            print(f"\n== {case}: one step under torch.profiler {json.dumps(gaps)}\n{r['table']}")
        return 0
    for case, r in rows.items():
        print(f"\n== {case}: per optimizer step (median of {args.count})")
        print(f"aten ops {r['ops']:.0f} ({r['kernel_ops']:.0f} running a kernel on a GPU)  device syncs "
              f"{r['syncs']:g}  blocking H2D copies {r['blocking_copies']:g}  non-blocking copies "
              f"{r['async_copies']:g}  late reads {r['late_reads']:g}  Python calls {r['python_calls']:.0f}")
        for title, key in (("syncs", "sync_sites"), ("copies (blocking? site)", "copy_sites")):
            for site, n in list(r[key].items())[:args.sites]:
                print(f"  {title}: {n:g} x {site}")
        print("  top ops: " + ", ".join(f"{k} {v:g}" for k, v in list(r["op_names"].items())[:8]))
    print("\n| case | aten ops | of them kernels | syncs | blocking copies | late reads | Python calls |\n"
          "|---|---|---|---|---|---|---|")
    for case, r in rows.items():
        print(f"| {case} | {r['ops']:.0f} | {r['kernel_ops']:.0f} | {r['syncs']:g} | {r['blocking_copies']:g} "
              f"| {r['late_reads']:g} | {r['python_calls']:.0f} |")
    for ours, bare, goal in (("sd15", BARE, " (goal <= 0.85x)"), ("flux-depth-bf16", "bare-flux-depth", "")):
        if ours in rows and bare in rows:
            print(f"\n{ours} / {bare}: aten ops {rows[ours]['ops'] / rows[bare]['ops']:.3f}x{goal}, of them kernels "
                  f"{rows[ours]['kernel_ops'] / rows[bare]['kernel_ops']:.3f}x, Python calls "
                  f"{rows[ours]['python_calls'] / rows[bare]['python_calls']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
