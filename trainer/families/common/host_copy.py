"""A tensor a family makes on the host during a step (token ids, size conditioning from Python numbers) moved to the
training device without making the host wait: on CUDA pinned first and copied with ``non_blocking`` (a copy from
pageable memory blocks the host until the GPU's queue reaches it). The loop moves its batches with it too
(``trainer/train/transfer.py``)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned() and torch.cuda.is_available():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def flags_on(flags, device) -> torch.Tensor:
    """Caption dropout's per-row choices (Python bools, drawn on the host) as a bool tensor on ``device``, moved as
    :func:`to_device` moves (``torch.as_tensor(list, device=…)`` is a blocking copy)."""
    return to_device(torch.tensor([bool(f) for f in flags], dtype=torch.bool), device)


def kept_on(owner, name: str, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor``, a host tensor ``owner`` keeps (the empty caption's features, for caption dropout), in ``like``'s
    device and dtype: moved once and kept on ``owner`` under ``name`` (moved again only when ``owner`` holds another
    tensor there), instead of a blocking copy at every step that drops a row."""
    kept = owner.__dict__.setdefault("_kept_on_device", {})
    key = (name, str(like.device), like.dtype)
    hit = kept.get(key)
    if hit is None or hit[0] is not tensor:
        hit = kept[key] = (tensor, tensor.to(like.device, like.dtype))
    return hit[1]


__all__ = ["flags_on", "kept_on", "to_device"]
