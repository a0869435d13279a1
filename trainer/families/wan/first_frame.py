"""Image-to-video conditioning (Wan 2.1 I2V 14B, Wan 2.2 I2V A14B), as ``WanImageToVideoPipeline`` builds it:

- the condition video: the start frame followed by F − 1 black (zero) frames, through the VAE (its posterior's mean,
  the pipeline's ``sample_mode="argmax"``), normalised per channel like the latents: [B, 16, F', h, w];
- the mask: 1 on the start frame's latent, 0 after it, in 4 channels (the VAE's temporal factor: the first frame's
  mask repeated 4 times, then each latent frame's 4 frames): [B, 4, F', h, w];
- the transformer's input: noisy latents ‖ mask ‖ condition (16 + 4 + 16 = 36 channels) at every step;
- Wan 2.1 only: CLIP ViT-H/14's penultimate hidden states of the start frame (``encoder_hidden_states_image``),
  from the pipeline's ``image_processor`` (resize the short side, centre crop) on the frame as an image.

In training the start frame is the first frame of each window as it was rendered (its crop, flip and colour), as
musubi-tuner takes it (kohya-ss/musubi-tuner 30c658c4, ``wan_cache_latents.py``). musubi's CLIP squashes the whole
frame to 224×224 (the original Wan code's ``clip.visual``); diffusers' processor and ComfyUI's CLIP vision encode
centre-crop. Atelier follows diffusers, so training sees what samples in diffusers and ComfyUI see."""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np
import torch
from PIL import Image

from trainer.families.common.transformer_kit import MaskedText


class ImageText(MaskedText):
    """Text features with their mask, and the start frames' CLIP image features [B, N, D] (Wan 2.1 I2V)."""

    def __init__(self, prompt_embeds, prompt_mask, image_embeds):
        super().__init__(prompt_embeds, prompt_mask)
        self.image_embeds = image_embeds

    def to(self, *args: Any, **kwargs: Any) -> "ImageText":
        text = super().to(*args, **kwargs)
        return ImageText(text.prompt_embeds, text.prompt_mask, self.image_embeds.to(*args, **kwargs))


class PromptFirst:
    """``WanImageToVideoPipeline`` called like the other pipelines, the prompt first (``pipe(prompt, image=…)``):
    its own ``__call__`` takes the image first. The prompts go in as features from ``encode`` (UMT5, zero-padded as
    ``WanPipeline`` makes them): diffusers 0.42.1's image-to-video module calls ``ftfy`` unguarded when it cleans a
    prompt (the text-to-video one skips it where ftfy is not installed), so its own prompt path fails without it.
    Anything else (``load_lora_weights`` …) reaches the pipeline."""

    def __init__(self, pipe: Any, encode: Callable[[List[str]], torch.Tensor]):
        self.pipe, self.encode = pipe, encode

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, prompt: Any = None, *args: Any, **kwargs: Any) -> Any:
        if prompt is not None and kwargs.get("prompt_embeds") is None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            negative = kwargs.pop("negative_prompt", None) or ""
            with torch.no_grad():
                kwargs["prompt_embeds"] = self.encode(prompts)
                if kwargs.get("guidance_scale", 5.0) > 1.0:  # the pipeline's default guidance: 5
                    negatives = [negative] * len(prompts) if isinstance(negative, str) else list(negative)
                    kwargs["negative_prompt_embeds"] = self.encode(negatives)
            prompt = None
        return self.pipe(kwargs.pop("image", None), prompt, *args, **kwargs)


def condition_video(clip: torch.Tensor) -> torch.Tensor:
    """Pixels [B, 3, F, H, W] → the start frame and F − 1 zero frames, as the pipeline's ``prepare_latents``."""
    first = clip[:, :, :1]
    return torch.cat([first, first.new_zeros(first.shape[0], 3, clip.shape[2] - 1, *first.shape[-2:])], dim=2)


def first_frame_mask(condition: torch.Tensor, temporal: int) -> torch.Tensor:
    """The mask channels [B, temporal, F', h, w] beside a condition latent [B, C, F', h, w]: the pipeline's
    ``mask_lat_size`` (1 on the start frame's latent frame, 0 after it)."""
    b, _, latent_frames, h, w = condition.shape
    mask = torch.zeros(b, temporal, latent_frames, h, w, dtype=condition.dtype, device=condition.device)
    mask[:, :, 0] = 1
    return mask


def frames_as_images(first: torch.Tensor) -> List[Image.Image]:
    """Start frames [B, 3, H, W] in [-1, 1] as RGB images for the CLIP processor (exact for frames rendered from
    8-bit images: the pipeline's PIL start image gives the same values)."""
    arr = ((first.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    try:
        data = arr.numpy()
    except RuntimeError:  # a tensor without values (the VRAM estimate's fake tensors): blank frames of its size
        data = np.zeros(tuple(arr.shape), np.uint8)
    return [Image.fromarray(np.ascontiguousarray(a)) for a in data]
