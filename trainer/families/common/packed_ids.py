"""The position ids of a Flux-lineage transformer's tokens (packed 2×2 latent patches, text), made on the device.

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


def flux2_latent_ids(latents: torch.Tensor) -> torch.Tensor:
    """``[B, H*W, 4]`` int64 (t, y, x, l) ids of Flux.2's packed latents ``[B, C, H, W]`` on their device, equal to
    ``Flux2KleinPipeline._prepare_latent_ids(latents)`` (made on the CPU there)."""
    b, _, h, w = latents.shape
    device = latents.device
    one = torch.arange(1, device=device)
    ids = torch.cartesian_prod(one, torch.arange(h, device=device), torch.arange(w, device=device), one)
    return ids.unsqueeze(0).expand(b, -1, -1)


def flux2_text_ids(embeds: torch.Tensor) -> torch.Tensor:
    """``[B, L, 4]`` int64 (0, 0, 0, l) ids of Flux.2's text tokens ``[B, L, D]`` on their device, equal to
    ``Flux2KleinPipeline._prepare_text_ids(embeds)`` (made on the CPU there)."""
    b, length, _ = embeds.shape
    device = embeds.device
    one = torch.arange(1, device=device)
    ids = torch.cartesian_prod(one, one, one, torch.arange(length, device=device))
    return ids.unsqueeze(0).expand(b, -1, -1).contiguous()


def flux2_reference_ids(references, scale: int = 10) -> torch.Tensor:
    """``[1, N, 4]`` int64 (t, y, x, l) ids of Flux.2's reference latents (each ``[B, C, H, W]``; the k-th on time
    ``scale + scale·k``) on their device, equal to ``Flux2KleinPipeline._prepare_image_ids`` of one row of each
    (made on the CPU there)."""
    device = references[0].device
    one = torch.arange(1, device=device)
    ids = [torch.cartesian_prod(torch.full((1,), scale + scale * k, device=device), torch.arange(r.shape[-2],
                                device=device), torch.arange(r.shape[-1], device=device), one)
           for k, r in enumerate(references)]
    return torch.cat(ids, dim=0).unsqueeze(0)


__all__ = ["flux2_latent_ids", "flux2_reference_ids", "flux2_text_ids", "latent_image_ids"]
