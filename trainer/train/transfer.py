"""What crosses between the host and the training device during a step, made so the host never waits for the
device: batches copied from pinned memory without blocking, and the step's loss read one step late.

A GPU runs what the host queued; each blocking copy or host read of a device value (``.item()``, ``float(t)``)
makes the host wait until the queue is empty, so the GPU idles while the host prepares the next work. The loop
queues a step, then reads the loss of the step before (long finished by then), so the queue never drains.
``bench/step_counts.py`` counts what is left per step.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch

from trainer.families.common import host_copy

# what stays on the host: ``prior`` is read there (which rows need the base model's prediction); the masks and the
# inpainting pixels meet masks drawn on the host (sd_kit.inpaint) and move where they are used
HOST_KEYS = ("prior", "mask", "inpaint_pixels", "masked_mean")


def to_device(batch: Any, device: torch.device, key: str = "") -> Any:
    """``batch`` (dicts, lists and tuples of tensors) with its tensors on ``device``: on CUDA each is pinned and
    copied with ``non_blocking`` (the copy runs beside the queued work). What the host reads stays (``HOST_KEYS``).
    On the CPU ``.to`` returns the tensors themselves."""
    if isinstance(batch, torch.Tensor):
        return batch if key in HOST_KEYS else host_copy.to_device(batch, device)
    if isinstance(batch, dict):
        return {k: to_device(v, device, k) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in batch):
        return type(batch)(to_device(v, device, key) for v in batch)
    return batch


class LateRead:
    """A step's loss, read on the host when the next step has been queued.

    ``put`` starts the copy of a device scalar into host memory (pinned, without blocking, a CUDA event marking its
    end); ``take`` waits for that event (the step it belongs to, not the work queued since) and returns the value
    with the context ``put`` was given. Elsewhere (the CPU, MPS) the copy is a plain one. A value that is already a
    Python number (several processes: the all-reduce read it) is kept as it is."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: Optional[Tuple[Any, Any, Dict[str, Any]]] = None

    def put(self, value: Any, **context: Any) -> None:
        context.setdefault("time", time.time())
        done = None
        if isinstance(value, torch.Tensor):
            cuda = self.device.type == "cuda"
            host = torch.empty((), dtype=torch.float32, pin_memory=cuda)
            # MPS: a plain copy (its non-blocking copies need a sync before the host may read them)
            host.copy_(value.detach(), non_blocking=self.device.type in ("cuda", "cpu"))
            if cuda:
                done = torch.cuda.Event()
                done.record()
            value = host
        self.pending = (value, done, context)

    def take(self) -> Optional[Tuple[float, Dict[str, Any]]]:
        """(the value, its context), or None when nothing is pending."""
        if self.pending is None:
            return None
        value, done, context = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        return float(value), context
