"""``training.compile``: torch.compile of the denoiser's repeated blocks (regional compilation).

Compiling the whole UNet or transformer takes minutes and recompiles whenever a shape changes; its
repeated blocks (a UNet's ``BasicTransformerBlock``s, Flux's double and single blocks) share one
class, so compiling each of them in place (``nn.Module.compile``) costs one compile per block class and
input shape, and gives most of the speed-up (PyTorch's regional-compilation recipe; diffusers'
``ModelMixin.compile_repeated_blocks`` does the same from the model's ``_repeated_blocks``). LoRA layers,
fp8 storage and gradient checkpointing are inside the blocks' compiled regions and are traced with them (a
checkpointed block's checkpoint too: :func:`trainer.memory.checkpointing.compile_checkpointed`).

``training.compile_scope`` ``denoiser`` compiles the whole model instead (kohya's sd-scripts with
``--torch_compile`` hands accelerate a ``dynamo_backend``, which compiles the whole UNet): one graph for forward and
one for backward, so torch's guard checks and compiled-function wrappers run once a call instead of once a block,
the code between the blocks (a UNet's ResNets, the embeddings) is fused too, and the CUDA-graph modes record the
whole step's forward and backward; its compile takes longer, and any new input shape compiles the whole graph again,
so samples and validation run it eagerly (:func:`eager_outside_training`).

The block classes come from the model's own ``_repeated_blocks`` when diffusers defines it, else from
the model itself: the classes of modules that repeat in a ``ModuleList`` (PixArt's transformer blocks).

``training.compile_mode`` is torch.compile's ``mode``. The CUDA-graph ones (``reduce-overhead``,
``max-autotune``) record one graph per input shape of each block: a step's shapes are its (bucket, batch
size) pairs, so :func:`step_shapes` counts them and the setup warns above :data:`CUDAGRAPH_SHAPE_LIMIT`.
:func:`dynamo_counts` reads torch's own counters (graph breaks, frames compiled, graphs made), which
``bench/step_counts.py --compiled`` and the tests read per step. What a run compiles is cached in the workspace
(:func:`kernel_cache`): the next run of the same model and shapes loads it instead of compiling.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from trainer.memory.checkpointing import compile_checkpointed

# torch.compile's modes; "default" passes none
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# training.compile_dynamic → torch.compile's ``dynamic``
DYNAMIC = {"auto": None, "static": False, "dynamic": True}
# training.compile_scope: the repeated blocks (regional compilation) or the whole denoiser as one graph
SCOPES = ("blocks", "denoiser")
# graphs one block class may compile before torch falls back to running it eagerly (torch's own default is 8, which
# a UNet's levels, the first block's variant, buckets and the sampling's shapes can pass when sizes stay static;
# OneTrainer sets 8192, musubi-tuner recommends 32)
RECOMPILE_LIMIT = 64
# distinct step shapes above which CUDA graphs cost more memory and recording than they save (torch's own
# warning threshold, torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit, is 8 as well)
CUDAGRAPH_SHAPE_LIMIT = 8


def _sharded(module: Any) -> bool:
    """``module`` is a unit of torch's FSDP2 (``fully_shard`` swapped its class for a subclass ``FSDP<name>`` of
    ``FSDPModule`` and the class)."""
    cls = type(module)
    return cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule"


def class_name(module: Any) -> str:
    """``module``'s own class name, also for an FSDP unit (its ``FSDP<name>`` does not match the blocks' declared
    names)."""
    cls = type(module)
    return (cls.__bases__[1] if _sharded(module) else cls).__name__


def repeated_block_classes(model: Any) -> List[str]:
    """Class names of the model's repeated blocks."""
    declared = list(getattr(model, "_repeated_blocks", None) or [])
    if declared:
        return declared
    found = set()
    for module in model.modules():  # a list of >= 2 blocks of one class, each made of layers of its own
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {class_name(child) for child in module}
            if len(kinds) == 1 and any(True for _ in module[0].children()):
                found.add(class_name(module[0]))
    return sorted(found)


def compile_blocks(model: Any, mode: str = "default", dynamic: str = "auto", scope: str = "blocks",
                   entry: Any = None, **options: Any) -> Dict[str, int]:
    """Compile every repeated block of ``model`` in place with torch.compile's ``mode`` and ``dynamic`` (a
    ``training.compile_dynamic`` value; ``options``: the rest of torch.compile's arguments, e.g. ``backend="eager"``
    in tests); {class name: blocks compiled}. Lets a block class compile up to :data:`RECOMPILE_LIMIT` graphs.
    ``scope`` ``denoiser`` (``training.compile_scope``) compiles ``model`` itself in place instead, as one graph: its
    blocks' checkpoints, LoRA layers and the code between the blocks (a UNet's ResNets, the timestep embedding) are
    traced with it, and torch's guards and compiled-function wrappers run once a call instead of once a block;
    ``entry``: the module a training step calls to run ``model``'s forward when that is not ``model`` itself (DDP's
    entry on several processes, ``Strategy.training_entry``), compiled in its place."""
    if mode not in MODES:
        raise ValueError(f"training.compile_mode = {mode!r}: one of {', '.join(MODES)}")
    if dynamic not in DYNAMIC:
        raise ValueError(f"training.compile_dynamic = {dynamic!r}: one of {', '.join(DYNAMIC)}")
    if scope not in SCOPES:
        raise ValueError(f"training.compile_scope = {scope!r}: one of {', '.join(SCOPES)}")
    if mode != "default":
        options["mode"] = mode
    options["dynamic"] = DYNAMIC[dynamic]
    raise_recompile_limit()
    if scope == "denoiser":  # a checkpointed block inside is traced as torch's checkpoint (checkpointed: compiling)
        (model if entry is None else entry).compile(**options)
        return {class_name(model): 1}
    names = set(repeated_block_classes(model))
    done: Dict[str, int] = {}
    blocks = []
    for module in model.modules():
        name = class_name(module)
        if name in names:
            module.compile(**options)
            blocks.append(module)
            done[name] = done.get(name, 0) + 1
    if not done:
        raise ValueError(f"training.compile: {class_name(model)} has no repeated blocks to compile")
    # checkpointed, a block's checkpoint runs inside its compiled region; not an FSDP unit's, whose gathering hooks
    # (which torch does not trace) would run inside the checkpoint there, breaking the region back to eager: its
    # checkpoint stays around the compiled call, which runs the hooks as it does without checkpointing
    compile_checkpointed([b for b in blocks if not _sharded(b)], **options)
    return done


def eager_outside_training(cfg: Any) -> Any:
    """The context samples and validation run in: with ``training.compile_scope`` denoiser the compiled model runs
    eagerly there (``torch.compiler.set_stance("force_eager")``), since each of their calls (no gradients, the
    sampling's size and guidance batch) would otherwise compile the whole graph again, which costs more than the
    few eager calls it would speed; compiled blocks keep their no-grad graphs (a compile of a few blocks)."""
    t = getattr(cfg, "training", None)  # None: a config of sampling settings alone, nothing compiled
    if t is not None and t.get("compile", False) and t.get("compile_scope", "blocks") == "denoiser":
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """torch's graphs-per-function limit raised to at least ``limit`` (``recompile_limit``; ``cache_size_limit``
    before torch 2.6): past it torch runs the block eagerly, with a warning, for every shape not yet compiled."""
    import torch._dynamo.config as dynamo_config
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def describe(done: Dict[str, int]) -> str:
    return ", ".join(f"{n} × {name}" for name, n in sorted(done.items()))


def step_shapes(batches: Iterable[Any]) -> Set[Tuple[Tuple[int, int], int]]:
    """The distinct (bucket size, batch length) pairs of planned micro-batches: the input shapes the compiled
    blocks see (one CUDA graph each under the CUDA-graph modes)."""
    return {(tuple(b.size), len(b)) for b in batches}


def cudagraph_shape_warning(shapes: Set[Tuple[Tuple[int, int], int]]) -> str:
    """The warning for more step shapes than :data:`CUDAGRAPH_SHAPE_LIMIT` ('' when within it)."""
    if len(shapes) <= CUDAGRAPH_SHAPE_LIMIT:
        return ""
    return (f"training.compile_mode records a CUDA graph per step shape, and this data makes {len(shapes)} "
            f"(bucket, batch size) shapes, more than {CUDAGRAPH_SHAPE_LIMIT}: each costs a recording and its own "
            "memory. Fewer buckets (data.bucket_step larger, data.max_aspect_ratio smaller, or "
            "data.aspect_buckets off) or compile_mode default keep it small.")


def static_shape_warning(shapes: Set[Tuple[Tuple[int, int], int]], scope: str = "blocks") -> str:
    """The warning for ``training.compile_dynamic`` static with more step shapes than :data:`CUDAGRAPH_SHAPE_LIMIT`
    ('' when within it): each shape compiles every block class again (a UNet: once per level), or the whole
    denoiser under ``compile_scope`` denoiser."""
    if len(shapes) <= CUDAGRAPH_SHAPE_LIMIT:
        return ""
    what, who = ("the whole denoiser", "the denoiser") if scope == "denoiser" else ("the blocks", "a block class")
    return (f"training.compile_dynamic = static compiles {what} again for each step shape, and this data makes "
            f"{len(shapes)} (bucket, batch size) shapes, more than {CUDAGRAPH_SHAPE_LIMIT}: the first epoch pays a "
            f"compile for each, and past {RECOMPILE_LIMIT} graphs {who} runs uncompiled. compile_dynamic auto "
            "serves every size from one graph after the second; fewer buckets (data.bucket_step larger, "
            "data.max_aspect_ratio smaller, or data.aspect_buckets off) keep static small.")


# training.compile's cache of compiled graphs and kernels, a folder of the run's caches (kernel_cache)
KERNEL_CACHE = "torch-compile"
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def kernel_cache(folder: Path) -> Iterator[Optional[Path]]:
    """The compiled graphs and kernels of a ``training.compile`` run kept in ``folder`` (``<cache>/torch-compile``,
    beside the latent and text caches) while the run compiles: torch's own caches (inductor's FX-graph cache,
    AOTAutograd's cache, Triton's kernels under it on a GPU), so a later run of the same model, settings and step
    shapes loads what an earlier one compiled instead of compiling it again. torch keeps them in the system's temp
    folder by default, which a pod's restart or a new Colab session empties, and which lies outside the workspace.
    A ``TORCHINDUCTOR_CACHE_DIR`` the user set wins (yields None; torch itself sets it to its default folder once
    it has looked, which does not count). torch's keys cover the graph, its input shapes, the torch version and the
    device, so a changed model or setting compiles anew, never reuses a wrong kernel."""
    try:  # torch's own helpers (2.13); a torch without them keeps its caches where it keeps them
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir
    except ImportError:
        yield None
        return
    chosen = os.environ.get(CACHE_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        yield None
        return
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(folder)):
        yield folder


def backend_problem(device_type: str) -> Optional[str]:
    """Why torch.compile's inductor cannot make kernels for ``device_type`` on this machine, said with what to do
    (None when it can): on NVIDIA GPUs it writes Triton kernels (the package, and a GPU of compute capability 7.0 or
    newer, which Triton needs), on the CPU C++ that a compiler builds. Found at the start of the run, before a model
    loads, instead of in the first step's compile."""
    try:  # torch's private helpers: where they moved, compiling says what is missing itself
        from torch._inductor import cpp_builder
        from torch.utils import _triton
    except ImportError:
        return None
    if device_type == "cuda":
        if not _triton.has_triton_package():
            return ("training.compile makes Triton kernels on NVIDIA GPUs, and Triton is not installed here: "
                    "pip install triton (on Windows: pip install triton-windows), or turn training.compile off.")
        if not _triton.has_triton():
            import torch
            major, minor = torch.cuda.get_device_capability()
            return (f"training.compile makes Triton kernels, and Triton does not compile for this GPU (compute "
                    f"capability {major}.{minor}; it needs 7.0 or newer: Volta, Turing or later). Turn "
                    "training.compile off.")
    elif device_type == "cpu":
        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # torch's own error names the compilers it looked for
            return (f"training.compile on the CPU builds C++ kernels, and no C++ compiler was found ({exc}). Install "
                    "one (g++ or clang; on Windows Visual Studio's Build Tools), or turn training.compile off.")
    return None


def cache_counts() -> Dict[str, int]:
    """Compiled graphs inductor made (``misses``) and took from its cache (``hits``), and dynamo's graph breaks
    (``breaks``), so far in this process."""
    return {"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
            "breaks": dynamo_counts()["graph_breaks"]}


def graph_break_warning(breaks: int, reasons: Dict[str, int], scope: str) -> str:
    """The warning for a first compiled step whose graphs broke ``breaks`` times ('' for none): torch's most frequent
    reason, and what to change."""
    if breaks <= 0:
        return ""
    reason = " ".join(max(reasons, key=reasons.get).split())[:160] if reasons else "no reason given"
    hint = ("compile_scope blocks compiles the repeated blocks alone, where the breaks may not fall"
            if scope == "denoiser" else "the broken code runs eagerly between the compiled graphs")
    return (f"training.compile: the first step's graphs broke {breaks} time(s) (torch: {reason}); each break "
            f"leaves code outside the compiled graphs, and the model's code decides where: {hint}. Compare a few "
            "steps with training.compile off.")


def dynamo_counts() -> Dict[str, int]:
    """torch's compile counters so far in this process: graph breaks, frames compiled (a first compile or a
    recompile) and graphs made. Differences between two calls count what happened in between."""
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "frames_compiled": counters["frames"]["ok"],
            "graphs": counters["stats"]["unique_graphs"]}


def graph_break_reasons() -> Dict[str, int]:
    """Why each graph break happened so far (torch's own reason text), with its count."""
    return dict(counters["graph_break"])


__all__ = ["CACHE_ENV", "CUDAGRAPH_MODES", "CUDAGRAPH_SHAPE_LIMIT", "KERNEL_CACHE", "MODES", "SCOPES",
           "backend_problem", "cache_counts", "compile_blocks", "cudagraph_shape_warning", "describe", "dynamo_counts",
           "eager_outside_training", "graph_break_reasons", "graph_break_warning", "kernel_cache",
           "repeated_block_classes", "static_shape_warning", "step_shapes"]
