"""Decoding images for the data pipeline: a cache job's loader (:class:`Renderer`: decode once, render every wanted
variant) and, when samples are rendered every step, an epoch's decoded images shared between the samples that use
them (:class:`DecodeMemo`), kept small (:func:`shrink`). A video family's window of a clip (:func:`render_clip`)
is decoded frame by frame (only its own frames, ``trainer.data.clips``) and every frame gets the same crop, flip
and colour as one image would. Pillow and torch; the tensors come from ``trainer.data.images``."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import torch
from PIL import Image

from trainer.data import clips, images  # looked up at call time (tests count the decodes)
from trainer.data.augment import AugmentParams
from trainer.data.buckets import Size
from trainer.data.concepts import ImageItem


def render_clip(item: ImageItem, mask_path: Any, size: Size, params: AugmentParams) -> Tuple[Any, Any]:
    """A window of a clip (or an image, a one-frame clip) as pixels [3, F, H, W] in [-1, 1] with its mask
    [1, F, H, W] or None: a mask image applies to every frame, a mask clip gives each frame its own. Each frame is
    rendered as an image is, with the same ``params`` (one crop, flip and colour for the whole window); only the
    window's frames are decoded."""
    window = item.window
    count = window.count if window is not None else 1
    masks: List[Any] = []
    if item.clip is None:
        img, mask = images.decode(item.path, mask_path)
        frames, masks = [img] * count, [mask] * count
    else:
        frames = [Image.fromarray(a) for a in clips.read_frames(item.path, item.clip, window.sources)]
        if mask_path is not None and clips.is_mask_clip(mask_path.name):
            info = clips.probe_clip(mask_path)[2]
            masks = [Image.fromarray(a).convert("L") for a in clips.read_frames(mask_path, info, window.sources)]
        else:
            masks = [images.open_mask(mask_path) if mask_path is not None else None] * count
        masks = [m.resize(frames[0].size, Image.Resampling.BILINEAR) if m is not None and m.size != frames[0].size
                 else m for m in masks]
    rendered = [images.render_sample(f, m, size, params) for f, m in zip(frames, masks)]
    pixels = torch.stack([px for px, _ in rendered], dim=1)
    if rendered[0][1] is None:
        return pixels, None
    return pixels, torch.stack([m for _, m in rendered], dim=1)


def latent_frames(mask: Any, frames: int) -> Any:
    """A mask over a clip's frames [..., F, h, w] at the latent frame count ``frames``: the VAE keeps the first frame
    and compresses each following group of (F - 1) / (frames - 1) into one, so latent frame 0 is mask frame 0 and
    latent frame k the mean of its group."""
    count = mask.shape[-3]
    if count == frames:
        return mask
    if frames == 1:
        return mask.mean(dim=-3, keepdim=True)
    group = (count - 1) // (frames - 1)
    rest = mask[..., 1:1 + group * (frames - 1), :, :]
    rest = rest.unflatten(-3, (frames - 1, group)).mean(dim=-3)
    return torch.cat([mask[..., :1, :, :], rest], dim=-3)


class Renderer:
    """A cache job's loader: decode an image (and its mask) once, render every wanted variant."""

    def __init__(self, item: ImageItem, specs: List[Tuple[Size, AugmentParams]], min_side: int):
        self.item, self.specs, self.min_side = item, specs, min_side

    def __call__(self) -> List[Tuple[Any, Any]]:
        if self.item.window is not None:  # a video family's window: [3, F, H, W]
            return [render_clip(self.item, self.item.mask, size, params) for size, params in self.specs]
        img, mask = images.decode(self.item.path, self.item.mask, self.min_side)
        return [images.render_sample(img, mask, size, params) for size, params in self.specs]


def shrink(pair: Tuple[Any, Any], min_side: int) -> Tuple[Any, Any]:
    """Keep a decoded photo at most twice the size the epoch needs (a 6000-px photo trained at
    512 would otherwise hold ~100 MB in the decode memo); the final resize still downsamples."""
    img, mask = pair
    short = min(img.size)
    if short <= 2 * min_side:
        return img, mask
    f = 2 * min_side / short
    new = (max(1, round(img.size[0] * f)), max(1, round(img.size[1] * f)))
    img = img.resize(new, Image.Resampling.LANCZOS, reducing_gap=3.0)
    if mask is not None:
        mask = mask.resize(new, Image.Resampling.BILINEAR, reducing_gap=3.0)
    return img, mask


class DecodeMemo:
    """Decoded images shared within an epoch: an image used several times (repeats) is decoded
    once and released after its last use. Safe for several loader threads. Held pixels are capped
    at ``budget`` bytes; past it an image is decoded again when next needed (correct, slower)."""

    def __init__(self, uses: Counter, budget: int = 2 << 30):
        self.uses = uses
        self.budget = budget
        self.held = 0
        self.lock = threading.Lock()
        self.entries: Dict[int, Any] = {}
        self.pending: Dict[int, threading.Event] = {}

    def get(self, index: int, load: Callable[[], Any]) -> Any:
        while True:
            with self.lock:
                if index in self.entries:
                    value = self.entries[index]
                    self._release(index)
                    return value
                event = self.pending.get(index)
                if event is None:
                    event = self.pending[index] = threading.Event()
                    owner = True
                else:
                    owner = False
            if not owner:
                event.wait()
                continue
            try:
                value = load()
            except BaseException:
                with self.lock:
                    self.pending.pop(index).set()
                raise
            with self.lock:
                size = nbytes(value)
                if self.held + size <= self.budget:
                    self.entries[index] = value
                    self.held += size
                self.pending.pop(index).set()
                self._release(index)
            return value

    def _release(self, index: int) -> None:
        self.uses[index] -= 1
        if self.uses[index] <= 0 and index in self.entries:
            self.held -= nbytes(self.entries.pop(index))


def nbytes(pair: Tuple[Any, Any]) -> int:
    img, mask = pair
    return img.size[0] * img.size[1] * (3 + (1 if mask is not None else 0))
