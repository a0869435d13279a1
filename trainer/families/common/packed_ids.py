"""The position ids of a Flux-lineage transformer's packed 2×2 latent patches, made on the device.

diffusers' ``FluxPipeline._prepare_latent_image_ids`` (Chroma's and Kontext's are the same function) builds them on
the CPU and copies them over on every call: in a training step that is a blocking host-to-device copy (pageable
memory), which the GPU's queue waits for. These are the same numbers, made where the step runs: rows
``(0, y, x)`` for each patch in row-major order, in fp32 and then cast to ``dtype`` as the pipeline does (small
integers, exact in bf16/fp16 for the sizes these models take)."""

from __future__ import annotations

import torch


def latent_image_ids(height: int, width: int, device, dtype: torch.dtype) -> torch.Tensor:
    """``[height * width, 3]`` ids of a ``height × width`` grid of packed patches (latents of 2·height × 2·width),
    equal to ``FluxPipeline._prepare_latent_image_ids(_, height, width, device, dtype)``."""
    ys = torch.arange(height, device=device, dtype=torch.float32)
    xs = torch.arange(width, device=device, dtype=torch.float32)
    ids = torch.zeros(height, width, 3, device=device, dtype=torch.float32)
    ids[..., 1] = ys[:, None]
    ids[..., 2] = xs[None, :]
    return ids.reshape(height * width, 3).to(dtype)


__all__ = ["latent_image_ids"]
