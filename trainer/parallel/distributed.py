"""Several training processes (DDP through ``accelerate launch`` or ``torchrun``).

Why it is shaped like this:

- **One global batch plan.** Every process plans the epoch with the *global* micro-batch
  (``training.batch_size`` × processes) and loads only its slice of each planned batch. Together the
  processes therefore see exactly the batches a single process with the global batch would see.
- **Batch-position-stable randomness.** Every random draw of a step (latent sampling noise, noise,
  timesteps, perturbation) is made for the whole global micro-batch from the shared generator on
  every process, and each process keeps its rows (:func:`expand_rows` / :func:`take_rows`). The
  generators never diverge, and an N-process run equals a 1-process run with N× the batch.
- **Gradients are averaged by torch's DDP** (:class:`DDPGradients`): every trained module gets a
  ``DistributedDataParallel`` wrapper (bucketed all-reduce overlapped with backward; ``no_sync`` on the
  micro-batches of an accumulation but the last), without being replaced: its ``forward`` goes through
  the wrapper while gradients are on, so peft LoRA, text encoders, sampling and the optimizer state (a
  backup resumes on any number of processes) see the plain modules. :class:`GradientSync` carries the
  step's loss, the stop flag and the few weights no module's forward owns (an embedding's token vectors)
  in one small all-reduce; with ``training.fused_backward`` it is the per-weight average in the hooks.
- **Rank 0 writes**, everybody else computes; a failing process writes ``rank-K-error.json`` into
  the run folder so rank 0 (or the launcher) can name it in the ``failed`` event (:mod:`trainer.parallel.launch`).
- **FSDP for full fine-tunes** (``general.distributed = fsdp``): the UNet is sharded instead, see
  :mod:`trainer.parallel.fsdp`; the other trained modules are still DDP-wrapped.

Launching the processes and reading how they ended is :mod:`trainer.parallel.launch` (torch-free).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.utils import InitProcessGroupKwargs
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.data.buckets import PlannedBatch
from trainer.data.cache import map_ahead

Rows = Tuple[int, int, int]  # (first row, end row, global micro-batch size)


# ------------------------------------------------------------------------------------------------
# process group
# ------------------------------------------------------------------------------------------------

def choose_backend(cpu: bool, warn) -> str:
    """NCCL for GPUs when this torch has it, else gloo (CPU, Windows, torch without NCCL)."""
    if cpu:
        return "gloo"
    if dist.is_nccl_available():
        return "nccl"
    warn("NCCL is not available in this PyTorch (e.g. on Windows): the processes talk through gloo, "
         "which works but is slower. Use Linux with a CUDA build of PyTorch for NCCL.")
    return "gloo"


def accelerator_kwargs(cfg, cpu: bool, world: int, warn, sharded: bool = False) -> List[Any]:
    """kwargs_handlers for ``Accelerator``: the backend and a bounded process-group timeout, so a
    process that hangs or dies cannot keep the others waiting forever. FSDP on GPUs also gets gloo for
    CPU tensors (offloaded shards are gathered on the CPU), as accelerate does."""
    if world <= 1:
        return []

    timeout = int(getattr(cfg.general, "dist_timeout_s", 1800) or 1800)
    backend = choose_backend(cpu, warn)
    if sharded and backend == "nccl":
        backend = "cuda:nccl,cpu:gloo"
    return [InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(seconds=timeout))]


# ------------------------------------------------------------------------------------------------
# data: each process takes its slice of the global batch
# ------------------------------------------------------------------------------------------------

def shard_plan(plan, rank: int, world: int):
    """This process's part of a planned global micro-batch (same positions, so same data choices)."""
    n = len(plan.indices)
    if n % world:
        raise RuntimeError(f"a planned batch of {n} does not split over {world} processes")
    per = n // world
    lo, hi = rank * per, (rank + 1) * per
    return PlannedBatch(tuple(plan.indices[lo:hi]), tuple(plan.positions[lo:hi]), plan.size), (lo, hi, n)


def iter_shard(data, epoch: int, start: int, stop: int, rank: int, world: int) -> Iterator[Tuple[int, Dict]]:
    """Like ``DataPipeline.iter_batches`` but yields this process's slice of each global batch,
    marked with ``batch["global_rows"] = (lo, hi, global_size)`` for :func:`trainer.train.step.forward_loss`."""
    batches = data.epoch_batches(epoch)
    selected = list(range(start, min(stop, len(batches))))
    parts = {bi: shard_plan(batches[bi], rank, world) for bi in selected}
    workers = int(getattr(data, "workers", 0) or 0)
    if getattr(data, "_renders_pixels", lambda: True)():
        workers = 0  # batch() VAE-encodes rendered pixels: keep that in this thread
    ahead = map_ahead(lambda bi: data.batch(parts[bi][0], epoch), selected, workers)
    try:
        for bi, batch in zip(selected, ahead):
            batch["global_rows"] = parts[bi][1]
            yield bi, batch
    finally:
        ahead.close()


def expand_rows(x, rows: Optional[Rows]):
    """A tensor (or dict of tensors) of this process's rows, placed in a zero tensor of the global
    batch size: draws made from it have the global shape."""
    if rows is None:
        return x
    if isinstance(x, dict):
        return {k: expand_rows(v, rows) for k, v in x.items()}
    lo, hi, n = rows
    out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    out[lo:hi] = x
    return out


def take_rows(x, rows: Optional[Rows]):
    """This process's rows of a global-batch tensor (None and non-tensors pass through)."""
    if rows is None or x is None:
        return x
    return x[rows[0]:rows[1]]


# ------------------------------------------------------------------------------------------------
# gradients
# ------------------------------------------------------------------------------------------------

class GradientSync:
    """Averages the gradients of ``params`` over all processes in one flat all-reduce, together with
    a few scalars (the step's loss, the stop flag). A parameter without a gradient on every process
    keeps ``grad = None`` (as on one process: optimizers skip it). With FSDP, ``params`` leaves out the
    sharded UNet (FSDP averages its gradients in backward) and may be empty; ``device`` is then where
    the scalars travel."""

    def __init__(self, params: Sequence[Any], world: int, device: Any = None):
        self.params = [p for p in params]
        self.world = world
        self.device = device

    def broadcast_from_main(self) -> None:
        """Start every process from rank 0's trainable weights (as DDP does at wrap time)."""
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=0)

    def step(self, loss: float, stop: bool, touched: bool = False) -> Tuple[float, bool, bool]:
        """Average the gradients; (the mean loss, any process asked to stop, any process swapped its
        weights): every process learns all three from the same all-reduce."""
        ref = next((p.grad for p in self.params if p.grad is not None), None)
        device = ref.device if ref is not None else self.params[0].device if self.params else self.device
        dtype = torch.float32
        pieces, has = [], []
        for p in self.params:
            if p.grad is None:
                pieces.append(torch.zeros(p.numel(), device=device, dtype=dtype))
                has.append(0.0)
            else:
                pieces.append(p.grad.detach().reshape(-1).to(device, dtype))
                has.append(1.0)
        extras = torch.tensor([*has, float(loss), 1.0 if stop else 0.0, 1.0 if touched else 0.0],
                              device=device, dtype=dtype)
        flat = torch.cat([*pieces, extras])
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        except Exception as exc:  # a peer died or hung past general.dist_timeout_s
            raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
        flat /= self.world
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            if flat[-(len(self.params) + 3) + i] > 0:
                g = flat[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            offset += n
        return float(flat[-3]), bool(flat[-2] > 0), bool(flat[-1] > 0)


def _entry_module(module):
    """An ``nn.Module`` whose forward is ``module``'s own (class) forward: what DDP wraps, while callers keep
    calling ``module`` itself (its hooks run once, outside)."""

    class DDPEntry(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return type(self.inner).forward(self.inner, *args, **kwargs)

    return DDPEntry(module)


class DDPGradients:
    """torch's ``DistributedDataParallel`` for the trained modules: their gradients are averaged in buckets
    *during* backward (overlapping the all-reduce with the rest of backward), and not at all on the
    micro-batches of an accumulation but the last (:meth:`accumulating`, DDP's ``no_sync``).

    The modules are not replaced: each trained module (the denoiser, a trained text encoder) gets a DDP
    wrapper around an entry module that runs the module's own forward, and the module's ``forward`` is
    pointed at that wrapper while gradients are on. So the families' code, peft, the optimizer (and its
    state in backups, loadable on any number of processes) and sampling see the plain modules. Only trained
    weights are registered with DDP (frozen, fp8 and NF4 base weights are ignored: never broadcast, no
    buckets). ``skip`` holds parameters someone else averages (FSDP's shards).

    Not covered, left to :class:`GradientSync`: weights that no module's forward reads as a parameter of
    that module (an embedding's new token vectors, read inside the text encoder's embedding layer)."""

    def __init__(self, modules, skip_ids: set, device: Any):
        self.wrapped: List[Tuple[Any, Any]] = []  # (module, DDP)
        self.entries: Dict[int, Any] = {}  # id(module) -> the entry module DDP calls (see entry_for)
        self.names: List[str] = []
        self.params: List[Any] = []
        claimed = set(skip_ids)
        self.calls: Dict[str, int] = {}
        for name, module in modules.items():
            if not isinstance(module, torch.nn.Module) or \
                    type(module).forward is torch.nn.Module.forward:  # never called (an embedding's vectors)
                continue
            own = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in claimed]
            if not own:
                continue
            entry = _entry_module(module)
            keep = {f"inner.{n}" for n, _ in own}
            ignore = [n for n, _ in entry.named_parameters(remove_duplicate=False) if n not in keep]
            ignore += [n for n, _ in entry.named_buffers(remove_duplicate=False)]
            DDP._set_params_and_buffers_to_ignore_for_model(entry, ignore)
            # find_unused_parameters: a trained weight may get no gradient in a step (CLIP-L's last layer
            # under SDXL, a component frozen by its stop_after_* window); broadcast_buffers off: no buffer
            # is trained, and every process loaded the same ones
            ddp = DDP(entry, device_ids=None, broadcast_buffers=False, find_unused_parameters=True,
                      init_sync=True)
            self._redirect(name, module, ddp)
            self.wrapped.append((module, ddp))
            self.entries[id(module)] = entry
            self.names.append(name)
            for _, p in own:
                claimed.add(id(p))
                self.params.append(p)
        self.ids = {id(p) for p in self.params}

    def _redirect(self, name: str, module, ddp) -> None:
        plain = type(module).forward
        calls = self.calls

        def forward(*args, **kwargs):
            if torch.is_grad_enabled():  # training: through DDP (gradient hooks, bucketed all-reduce)
                calls[name] = calls.get(name, 0) + 1
                return ddp(*args, **kwargs)
            return plain(module, *args, **kwargs)  # sampling / validation on one process: no collectives

        module.forward = forward

    def entry_for(self, module):
        """The module whose call runs ``module``'s forward in a training step (``module`` itself when not wrapped):
        what ``training.compile_scope`` denoiser compiles. Compiling ``module`` in place would trace DDP's own
        forward, which torch does not trace (three graph breaks around it); compiled inside DDP's forward, the
        entry is one graph that torch's DDPOptimizer splits at the gradient buckets, so their all-reduces overlap
        the rest of backward (torch.compile's way with DDP)."""
        return self.entries.get(id(module), module)

    def unwrap(self) -> None:
        for module, _ in self.wrapped:
            module.__dict__.pop("forward", None)
        self.wrapped = []
        self.entries = {}

    def check_step(self) -> None:
        """After an optimizer step's backward: a wrapped module whose weights got gradients without its
        forward being called this step was not averaged (DDP only hooks a backward its forward prepared).
        Raise rather than let the processes' weights drift apart."""
        for name, (module, _) in zip(self.names, self.wrapped):
            if not self.calls.get(name) and any(p.grad is not None for p in module.parameters() if p.requires_grad):
                raise RuntimeError(f"DDP: the trained module '{name}' got gradients without its forward being "
                                   "called, so they were not averaged over the processes (a bug: please report it)")
        self.calls.clear()

    def accumulating(self, on: bool):
        """DDP's ``no_sync`` on every wrapper while ``on`` (a micro-batch that is not the last of its step)."""
        stack = contextlib.ExitStack()
        if on:
            for _, ddp in self.wrapped:
                stack.enter_context(ddp.no_sync())
        return stack


class PeerLost(RuntimeError):
    """A collective failed: another process died, hung or lost its connection."""


_COLLECTIVE_SIGNS = ("connection closed by peer", "connection reset by peer", "gloo", "nccl", "processgroup",
                     "broken pipe", "socket timeout", "collective operation timeout", "watchdog")


def collective_failure(exc: BaseException) -> bool:
    """Whether an exception raised inside a DDP backward (where the gradient all-reduce runs) is a failed
    collective (a peer died, hung or lost its connection) rather than this process's own error (an OOM, a
    NaN check …), so rank 0 names the peer instead of itself."""
    try:
        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except Exception:  # a torch without torch.distributed
        pass
    text = str(exc).lower()
    return "out of memory" not in text and any(sign in text for sign in _COLLECTIVE_SIGNS)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception as exc:
            raise PeerLost(f"{type(exc).__name__}: {exc}") from exc


def fault_injection(rank: int, step: int) -> None:
    """Test hook: ``ATELIER_TEST_FAULT=RANK:STEP:raise|exit`` makes that rank fail after that step."""
    spec = os.environ.get("ATELIER_TEST_FAULT", "")
    if not spec:
        return
    r, s, how = spec.split(":")
    if int(r) == rank and int(s) == step:
        if how == "exit":
            os._exit(3)
        if how == "segv":  # a crash below Python
            faulthandler._sigsegv()
        raise RuntimeError(f"test fault on rank {rank} at step {step}")


def weight_grad_average(world: int):
    """``training.fused_backward`` with several processes: average one weight's gradient over the
    processes inside its post-accumulate-grad hook, right before that weight's update (the gradient is
    freed after it, so the once-per-step flat all-reduce of :class:`GradientSync` has nothing to
    average). One small all-reduce per weight, in the order backward makes them — the same on every
    process, since they run the same graph."""

    def average(p) -> None:
        try:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        except Exception as exc:  # a peer died or hung past general.dist_timeout_s
            raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
        p.grad.div_(world)
    return average
