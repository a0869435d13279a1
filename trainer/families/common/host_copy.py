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


__all__ = ["to_device"]
