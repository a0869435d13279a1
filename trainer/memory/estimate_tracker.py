"""Counting the bytes of live tensors, as the CUDA caching allocator would hold them: the storages behind
modules and an optimizer, and :func:`live_tensor_tracker`, which follows every storage a phase of the VRAM
estimate makes and keeps the peak, its breakdown by kind and where it happened."""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Sequence

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.memory.estimate_report import Breakdown

_READ = torch.ops.aten._local_scalar_dense.default  # a tensor's value read on the host (.item(), bool(), .tolist())


def _stand_in(t: torch.Tensor) -> Any:
    """A value for an optimizer's read of a fake tensor that has none (one made from a constant has it): its step
    sizes and branches (Prodigy's and D-Adaptation's estimates, "is this weight all zeros") only steer the
    arithmetic, whose tensors are the same whatever the value; 1 (True: a weight is taken as nonzero, so Prodigy's
    copy of it is counted)."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.is_floating_point() else 1


BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
KINDS = ("weights", "trainable", "grads", "optimizer", "activations")


def allocated_bytes(nbytes: int) -> int:
    """``nbytes`` in the allocator's blocks (``BLOCK``; the tests set 1 to compare with exact counts)."""
    return int(math.ceil(nbytes / BLOCK) * BLOCK) if nbytes else 0


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
    return sum(allocated_bytes(st.nbytes()) for st in _storages(tensors).values())


def module_tensors(modules: Iterable[Any]) -> Iterator[Any]:
    for m in modules:
        if m is None:
            continue
        yield from m.parameters()
        yield from m.buffers()


def optimizer_state_tensors(optimizer) -> Iterator[Any]:
    inner = [opt for _, _, opt in getattr(optimizer, "per_param", [])] or [optimizer]  # fused backward
    for opt in inner:
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield v


class LiveTensorTracker(TorchDispatchMode):
    """See :func:`live_tensor_tracker`."""

    def __init__(self, modules: Sequence[Any], trainable: Sequence[Any], optimizer=None,
                 extra: Sequence[Any] = ()) -> None:
        super().__init__()
        self.modules, self.trainable, self.optimizer, self.extra = modules, trainable, optimizer, extra
        self.names = {id(m): n for root in modules if root is not None
                      for n, m in root.named_modules(prefix=type(root).__name__)}
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
            size = allocated_bytes(st.nbytes())
            if size != entry[1]:  # resized (aten.resize_, out= kernels): count the new size
                self.now[entry[0]] += size - entry[1]
                self.total += size - entry[1]
                entry[1] = size
            if retag and entry[0] != kind:
                self.now[entry[0]] -= entry[1]
                self.now[kind] += entry[1]
                entry[0] = kind
            return
        size = allocated_bytes(st.nbytes())
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
        try:
            out = func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if not (self._in_optimizer and func is _READ):
                raise
            return _stand_in(args[0])
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
        for t in module_tensors(self.modules):
            self.track(t, "weights")
        for p in self.trainable:
            self.track(p, "trainable", retag=True)
            if p.grad is not None:
                self.track(p.grad, "grads", retag=True)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda q: self.track(q.grad, "grads", retag=True) if q.grad is not None else None))
        state = list(optimizer_state_tensors(self.optimizer) if self.optimizer is not None else [])
        for t in state + list(self.extra):
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
            name = self.names.get(id(module))
            if name is not None:
                self._stack.append(name)

        def post_forward(module, args, out):  # noqa: ARG001
            if self.names.get(id(module)) is not None and self._stack:
                self._stack.pop()

        self._handles += [register_optimizer_step_pre_hook(pre_step), register_optimizer_step_post_hook(post_step),
                          register_module_forward_pre_hook(pre_forward), register_module_forward_hook(post_forward)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)


def live_tensor_tracker(modules: Sequence[Any], trainable: Sequence[Any], optimizer=None,
                        extra: Sequence[Any] = ()) -> LiveTensorTracker:
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
    return LiveTensorTracker(modules, trainable, optimizer, extra)


__all__ = ["BLOCK", "KINDS", "LiveTensorTracker", "allocated_bytes", "live_tensor_tracker", "module_tensors",
           "optimizer_state_tensors", "storage_bytes"]
