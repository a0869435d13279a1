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

The masked image needs the training image's *pixels*. The latent cache keeps only latents, so:
with ``data.cache_latents`` off (what the inpainting presets do) the pixels that the data pipeline
renders and hands to :meth:`encode_pixels` are kept for the batch they belong to (matched by
identity of the latent tensor) and used exactly. With cached latents the pixels are rebuilt by
decoding the cached latent mean through the VAE (close, not exact), with a warning once. Masked-image
latents cannot be cached themselves: random masks change every step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

INPAINT_CHANNELS = 9
MASK_MODES = ("random", "data", "both")


def random_masks(n: int, height: int, width: int, generator, full_probability: float = 0.25):
    """``[n, 1, height, width]`` float masks (1 = repaint) from ``generator``: with probability
    ``full_probability`` the whole image, else one rectangle or a few brush strokes (half each)."""
    import torch

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


class InpaintingMixin:
    """What a latent-diffusion family adds for 9-channel UNets; ``self.inpainting`` switches it on."""

    inpainting: bool = False
    inpainting_mask: str = "random"
    inpainting_full_mask: float = 0.25
    _recent_pixels: list
    _warned_cached = False

    def _setup_inpainting(self, mcfg) -> None:
        self.inpainting = int(self.unet.config.in_channels) == INPAINT_CHANNELS
        self.inpainting_mask = str(getattr(mcfg, "inpainting_mask", "random") or "random")
        self.inpainting_full_mask = float(getattr(mcfg, "inpainting_full_mask", 0.25))
        self._recent_pixels = []

    def _remember_pixels(self, pixels, mean) -> None:
        """Keep the pixels of the last few encoded batches, keyed by their latent tensor object."""
        if self.inpainting:
            self._recent_pixels = (self._recent_pixels + [(mean, pixels.detach().cpu())])[-4:]

    def _pixels_for(self, batch, warn: Optional[Callable[[str], None]]):
        import torch
        mean = batch["latent_dist"]["mean"]
        for kept_mean, pixels in self._recent_pixels:
            if kept_mean is mean:
                return pixels.to(self.device)
        if warn is not None and not self._warned_cached:
            warn("Inpainting with cached latents: the masked images are rebuilt from the cached latents through "
                 "the VAE (close, not exact). Set data.cache_latents = false for exact masked images.")
        self._warned_cached = True
        with torch.no_grad():
            # the posterior mean is in the VAE's own (unscaled) latent space
            decoded = self.vae.decode(mean.to(self.device, dtype=self.vae.dtype)).sample
        return decoded.float().clamp(-1, 1)

    def inpaint_masks(self, batch, pixel_size, generator, mode: Optional[str] = None):
        """``[B, 1, H, W]`` binary masks at pixel resolution (1 = repaint) for ``mode``."""
        import torch
        import torch.nn.functional as F
        mode = mode or self.inpainting_mask
        n = batch["latent_dist"]["mean"].shape[0]
        h, w = pixel_size
        data = batch.get("mask")
        if mode in ("data", "both") and data is None:
            raise ValueError(f"model.inpainting_mask = {mode} needs the images' masks: turn on data.masks "
                             "(<image>-masklabel.png, white = repaint), or use random.")
        if mode == "data":
            return (F.interpolate(data.float(), size=(h, w), mode="nearest") > 0.5).float()
        masks = random_masks(n, h, w, generator, self.inpainting_full_mask)
        if mode == "both":
            own = (F.interpolate(data.float(), size=(h, w), mode="nearest") > 0.5).float()
            pick = torch.rand(n, generator=generator) < 0.5
            masks = torch.where(pick[:, None, None, None], own, masks)
        return masks

    def inpaint_input(self, noisy_latents, batch, generator, warn: Optional[Callable[[str], None]] = None):
        """The UNet's 9-channel input for a training batch: ``noisy ‖ mask ‖ masked-image latents``."""
        import torch
        import torch.nn.functional as F
        pixels = self._pixels_for(batch, warn)
        masks = self.inpaint_masks(batch, tuple(pixels.shape[-2:]), generator).to(pixels.device)
        masked = pixels * (masks < 0.5)
        with torch.no_grad():
            dist = self.vae.encode(masked.to(self.device, dtype=self.vae.dtype)).latent_dist
            masked_latents = dist.mean.float() * self.vae.config.scaling_factor
        latent_mask = F.interpolate(masks, size=tuple(noisy_latents.shape[-2:]), mode="nearest")
        dtype = noisy_latents.dtype
        return torch.cat([noisy_latents, latent_mask.to(noisy_latents.device, dtype),
                          masked_latents.to(noisy_latents.device, dtype)], dim=1)

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Per-prompt pipeline arguments: for an inpainting model the sample's image and mask
        (``sampling.prompts[i].image`` / ``.mask``); without them a blank image, all repainted."""
        if not self.inpainting:
            return {}
        from PIL import Image
        w, h = int(sample_prompt.width), int(sample_prompt.height)
        image_path = str(getattr(sample_prompt, "image", "") or "")
        mask_path = str(getattr(sample_prompt, "mask", "") or "")
        image = Image.open(image_path).convert("RGB").resize((w, h)) if image_path else \
            Image.new("RGB", (w, h), (127, 127, 127))
        mask = Image.open(mask_path).convert("L").resize((w, h)) if mask_path else Image.new("L", (w, h), 255)
        return {"image": image, "mask_image": mask, "strength": 1.0}
