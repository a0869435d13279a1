"""Inpainting UNets (SD 1.5 / 2.x / SDXL inpainting: 9 input channels).

The UNet sees ``noisy latents (4) ‖ mask (1) ‖ masked-image latents (4)``, exactly what
``StableDiffusion(XL)InpaintPipeline`` feeds it: the mask (1 = repaint) at latent resolution, and
the VAE latents of the image with the masked part blanked (``image * (mask < 0.5)``, i.e. 0 = grey
in [-1, 1]).

Where the masks come from (``model.inpainting_mask``):

- ``random``: rectangles and brush strokes, and now and then the whole image (so the model still
  draws from text alone), drawn from the step's generator — deterministic, so resume is exact;
- ``data``: each image's own mask (``data.masks``; white = repaint);
- ``both``: per image, a coin from the generator picks its own mask or a random one.

The masked image needs the training image's *pixels*. The data pipeline hands them over in each
batch (``inpaint_pixels``, once :meth:`DataPipeline.prepare` got :meth:`encode_masked_images`): freshly
rendered without the latent cache, and from the cache otherwise, which for an inpainting model keeps each
entry's rendered pixels as uint8 (lossless: they come from 8-bit images). With data masks the cache also
keeps the masked image's latents (``masked_mean``, encoded at cache time from the same pixels and mask),
so ``model.inpainting_mask = data`` costs no VAE pass per step. Either way a cached run builds the same
masked-image latents as an uncached one. Random masks change every step, so their masked images are
encoded per step. Only a batch without pixels (a data pipeline prepared without the model) falls back
to decoding the latents through the VAE (close, not exact), with a warning once.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from PIL import Image

from trainer.families.common.host_copy import to_device
from trainer.parallel.distributed import expand_rows, take_rows

INPAINT_CHANNELS = 9
MASK_MODES = ("random", "data", "both")


def random_masks(n: int, height: int, width: int, generator, full_probability: float = 0.25):
    """``[n, 1, height, width]`` float masks (1 = repaint) from ``generator``: with probability
    ``full_probability`` the whole image, else one rectangle or a few brush strokes (half each)."""

    def u() -> float:
        return float(torch.rand((1,), generator=generator).item())

    masks = torch.zeros(n, 1, height, width)
    ys = torch.arange(height, dtype=torch.float32)[:, None]
    xs = torch.arange(width, dtype=torch.float32)[None, :]
    for i in range(n):
        kind = u()
        if kind < full_probability:
            masks[i] = 1.0
        elif kind < full_probability + (1 - full_probability) / 2:  # a rectangle, 10–80 % of each side
            h = max(1, round(height * (0.1 + 0.7 * u())))
            w = max(1, round(width * (0.1 + 0.7 * u())))
            top = int(u() * (height - h + 1))
            left = int(u() * (width - w + 1))
            masks[i, :, top:top + h, left:left + w] = 1.0
        else:  # brush strokes: random walks of discs
            radius = max(1.0, min(height, width) * (0.03 + 0.07 * u()))
            for _ in range(1 + int(u() * 3)):
                y, x = u() * height, u() * width
                angle = u() * 2 * math.pi
                for _ in range(4 + int(u() * 8)):
                    masks[i, 0][(ys - y) ** 2 + (xs - x) ** 2 <= radius ** 2] = 1.0
                    angle += (u() - 0.5) * 1.5
                    step = radius * (1 + u())
                    y = min(max(y + step * math.sin(angle), 0.0), height - 1.0)
                    x = min(max(x + step * math.cos(angle), 0.0), width - 1.0)
    return masks


def data_masks_to_pixels(latent_masks, size):
    """A batch's own masks (``batch["mask"]``, [B, 1, h, w] in [0, 1]) as binary repaint masks at pixel
    ``size``: nearest upsampling, > 0.5 repaints."""
    return (F.interpolate(latent_masks.float(), size=tuple(size), mode="nearest") > 0.5).float()


def masked_pixels(pixels, masks):
    """The inpainting pipelines' masked image: the repainted part (mask ≥ 0.5) blanked to 0 (grey)."""
    return pixels * (masks < 0.5)


class InpaintingMixin:
    """What a latent-diffusion family adds for 9-channel UNets; ``self.inpainting`` switches it on."""

    inpainting: bool = False
    inpainting_mask: str = "random"
    inpainting_full_mask: float = 0.25
    _warned_no_pixels = False

    def _setup_inpainting(self, mcfg) -> None:
        self.inpainting = int(self.unet.config.in_channels) == INPAINT_CHANNELS
        self.inpainting_mask = str(getattr(mcfg, "inpainting_mask", "random") or "random")
        self.inpainting_full_mask = float(getattr(mcfg, "inpainting_full_mask", 0.25))

    def _encode_mean(self, pixels, cpu: bool = True):
        """VAE posterior mean (unscaled, fp32; on the CPU unless ``cpu`` is False) of ``pixels`` in [-1, 1]."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        mean = dist.mean.float()
        return mean.cpu() if cpu else mean

    def encode_masked_images(self, pixels, latent_masks):
        """VAE means of ``pixels`` with their own masks (``latent_masks`` [B, 1, h, w], as batches carry
        them) blanked: the latent cache stores this as ``masked_mean`` for ``inpainting_mask = data``."""
        masks = data_masks_to_pixels(latent_masks, pixels.shape[-2:])
        return self._encode_mean(masked_pixels(pixels.float(), masks))

    def _pixels_for(self, batch, warn: Optional[Callable[[str], None]]):
        pixels = batch.get("inpaint_pixels")
        if pixels is not None:
            return pixels
        if warn is not None and not self._warned_no_pixels:
            warn("Inpainting: this batch carries no training pixels (the data pipeline was prepared without "
                 "the inpainting model), so the masked images are rebuilt from the latents through the VAE "
                 "(close, not exact).")
        self._warned_no_pixels = True
        mean = batch["latent_dist"]["mean"]
        with torch.no_grad():
            # the posterior mean is in the VAE's own (unscaled) latent space
            decoded = self.vae.decode(mean.to(self.device, dtype=self.vae.dtype)).sample
        return decoded.float().clamp(-1, 1).cpu()

    def inpaint_masks(self, batch, pixel_size, generator, mode: Optional[str] = None, n: Optional[int] = None):
        """``[n, 1, H, W]`` binary masks at pixel resolution (1 = repaint) for ``mode``.

        ``n`` (default: the batch's size) is the global micro-batch with several processes: every
        process draws the random masks for all rows from the shared generator (its own data masks sit
        in its rows, see ``batch["global_rows"]``) and keeps its rows."""

        mode = mode or self.inpainting_mask
        n = batch["latent_dist"]["mean"].shape[0] if n is None else n
        h, w = pixel_size
        data = batch.get("mask")
        if mode in ("data", "both") and data is None:
            raise ValueError(f"model.inpainting_mask = {mode} needs the images' masks: turn on data.masks "
                             "(<image>-masklabel.png, white = repaint), or use random.")
        if data is not None:
            data = expand_rows(data, batch.get("global_rows"))
        if mode == "data":
            return data_masks_to_pixels(data, (h, w))
        masks = random_masks(n, h, w, generator, self.inpainting_full_mask)
        if mode == "both":
            own = data_masks_to_pixels(data, (h, w))
            pick = torch.rand(n, generator=generator) < 0.5
            masks = torch.where(pick[:, None, None, None], own, masks)
        return masks

    def inpaint_input(self, noisy_latents, batch, generator, warn: Optional[Callable[[str], None]] = None):
        """The UNet's 9-channel input for a training batch: ``noisy ‖ mask ‖ masked-image latents``.

        With ``inpainting_mask = data`` and a cached ``masked_mean`` in the batch the masked-image
        latents are those (encoded at cache time from the same pixels and masks); otherwise the batch's
        pixels are masked and encoded now. ``noisy_latents`` has the global micro-batch's rows with
        several processes (``batch["global_rows"]``); the rows of the other processes get zeros."""

        rows = batch.get("global_rows")
        pixels = self._pixels_for(batch, warn).float()
        masks = take_rows(self.inpaint_masks(batch, tuple(pixels.shape[-2:]), generator,
                                             n=noisy_latents.shape[0]), rows)
        cached = batch.get("masked_mean")
        if self.inpainting_mask == "data" and cached is not None:
            masked_mean = cached.float()
        else:
            masked_mean = self._encode_mean(masked_pixels(pixels, to_device(masks, pixels.device)), cpu=False)
        masked_latents = masked_mean.to(noisy_latents.device) * self.vae.config.scaling_factor
        latent_mask = F.interpolate(masks, size=tuple(noisy_latents.shape[-2:]), mode="nearest")
        # the masks are drawn on the host: pinned and copied without making it wait
        extra = expand_rows(torch.cat([to_device(latent_mask, masked_latents.device), masked_latents], dim=1), rows)
        return torch.cat([noisy_latents, extra.to(noisy_latents.device, noisy_latents.dtype)], dim=1)

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Per-prompt pipeline arguments: for an inpainting model the sample's image and mask
        (``sampling.prompts[i].image`` / ``.mask``); without them a blank image, all repainted."""
        if not self.inpainting:
            return {}
        w, h = int(sample_prompt.width), int(sample_prompt.height)
        image_path = str(getattr(sample_prompt, "image", "") or "")
        mask_path = str(getattr(sample_prompt, "mask", "") or "")
        image = Image.open(image_path).convert("RGB").resize((w, h)) if image_path else \
            Image.new("RGB", (w, h), (127, 127, 127))
        mask = Image.open(mask_path).convert("L").resize((w, h)) if mask_path else Image.new("L", (w, h), 255)
        return {"image": image, "mask_image": mask, "strength": 1.0}
