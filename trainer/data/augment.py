"""Augmentations: one set of parameters per sample, applied to an image and its mask together.

Geometry (resize to the bucket, crop position, crop jitter zoom, rotation, flip) is applied to the
image *and* its mask with the same numbers, so a mask always covers the pixels it was painted on.
Colour (brightness, contrast, saturation, hue) touches the image only. Everything is Pillow.

Parameters are drawn once per sample (:func:`draw_params`) from a seeded rng and rounded, so
:meth:`AugmentParams.tag` names the exact transform: it is part of a cached latent's key, and the
same tag always yields the same pixels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
from PIL import Image, ImageEnhance

Size = Tuple[int, int]


@dataclass(frozen=True)
class AugmentSettings:
    """The augmentation part of ``DataConfig`` (strength 0 = off)."""
    random_flip: bool = False
    center_crop: bool = True
    rotation: float = 0.0       # degrees
    crop_jitter: float = 0.0    # extra zoom fraction, 0..0.5
    brightness: float = 0.0     # ± fraction
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0            # ± fraction of the colour circle
    random: bool = True         # off: each enabled augmentation applied at exactly its strength

    @classmethod
    def from_config(cls, d: Any) -> "AugmentSettings":
        g = lambda k, default: getattr(d, k, default)  # noqa: E731
        return cls(random_flip=bool(g("random_flip", False)), center_crop=bool(g("center_crop", True)),
                   rotation=float(g("rotation", 0.0) or 0), crop_jitter=float(g("crop_jitter", 0.0) or 0),
                   brightness=float(g("brightness", 0.0) or 0), contrast=float(g("contrast", 0.0) or 0),
                   saturation=float(g("saturation", 0.0) or 0), hue=float(g("hue", 0.0) or 0),
                   random=bool(g("augment_random", True)))

    @property
    def any_beyond_flip(self) -> bool:
        """Rotation, crop jitter or colour: transforms with a continuum of variants."""
        return any(v > 0 for v in (self.rotation, self.crop_jitter, self.brightness, self.contrast,
                                   self.saturation, self.hue))


@dataclass(frozen=True)
class AugmentParams:
    """The transform of one sample. Defaults are the identity (centre crop, no flip)."""
    flip: bool = False
    angle: float = 0.0          # degrees, counter-clockwise
    zoom: float = 1.0           # >= 1: the crop covers 1/zoom of what it would
    shift_x: float = 0.0        # -1..1: crop position within the slack (0 = centre)
    shift_y: float = 0.0
    brightness: float = 1.0     # enhancement factors (1 = unchanged)
    contrast: float = 1.0
    saturation: float = 1.0
    hue: float = 0.0            # fraction of the colour circle

    def tag(self) -> str:
        return (f"f{int(self.flip)}a{self.angle:g}z{self.zoom:g}x{self.shift_x:g}y{self.shift_y:g}"
                f"b{self.brightness:g}c{self.contrast:g}s{self.saturation:g}h{self.hue:g}")

    @property
    def has_color(self) -> bool:
        return (self.brightness, self.contrast, self.saturation, self.hue) != (1.0, 1.0, 1.0, 0.0)


def _r(x: float) -> float:
    return round(float(x), 4)


def draw_params(s: AugmentSettings, rng: random.Random) -> AugmentParams:
    """Parameters for one sample. Always makes the same number of draws, so enabling one
    augmentation does not change the values another one gets."""
    u = [rng.random() for _ in range(9)]
    sym = lambda v, strength: (2 * v - 1) * strength if s.random else strength  # noqa: E731
    jitter = s.crop_jitter > 0
    shift_x = (2 * u[3] - 1) if (jitter and s.random) or not s.center_crop else 0.0
    shift_y = (2 * u[4] - 1) if (jitter and s.random) or not s.center_crop else 0.0
    return AugmentParams(
        flip=s.random_flip and u[0] < 0.5,
        angle=_r(sym(u[1], s.rotation)) if s.rotation > 0 else 0.0,
        zoom=_r(1 + (u[2] * s.crop_jitter if s.random else s.crop_jitter)) if jitter else 1.0,
        shift_x=_r(shift_x), shift_y=_r(shift_y),
        brightness=_r(1 + sym(u[5], s.brightness)) if s.brightness > 0 else 1.0,
        contrast=_r(1 + sym(u[6], s.contrast)) if s.contrast > 0 else 1.0,
        saturation=_r(1 + sym(u[7], s.saturation)) if s.saturation > 0 else 1.0,
        hue=_r(sym(u[8], s.hue)) if s.hue > 0 else 0.0,
    )


# --------------------------------------------------------------------------------------------
# applying
# --------------------------------------------------------------------------------------------

def apply_geometry(img: Image.Image, mask: Optional[Image.Image], size: Size,
                   p: AugmentParams) -> Tuple[Image.Image, Optional[Image.Image]]:
    """Scale ``img`` (and ``mask``, resized to the image first if needed) to cover ``size`` — after
    rotation and zoom — crop at the shifted position, then mirror. Returns images of ``size``.

    Without rotation this is one Lanczos resize and an integer crop (no resampling twice); with
    rotation the image is first scaled, then rotated and cropped in one affine transform, and the
    scale makes the rotated crop fit inside the image, so no empty corners appear.
    """
    w, h = size
    if mask is not None and mask.size != img.size:
        mask = mask.resize(img.size, Image.Resampling.BILINEAR)
    g = _layout(img.size, size, p)
    img, mask = _resize(img, mask, (g.nw, g.nh), g.scale)
    if p.angle == 0:
        if (g.nw, g.nh) != (w, h):
            box = (g.left, g.top, g.left + w, g.top + h)
            img = img.crop(box)
            mask = mask.crop(box) if mask is not None else None
    else:
        cx, cy, theta = g.cx, g.cy, math.radians(p.angle)
        cos_t, sin_t = math.cos(theta), math.sin(theta)
        # output (x, y) -> input: centre + R(theta) (x - w/2, y - h/2)
        data = (cos_t, sin_t, cx - cos_t * w / 2 - sin_t * h / 2,
                -sin_t, cos_t, cy + sin_t * w / 2 - cos_t * h / 2)
        img = img.transform((w, h), Image.Transform.AFFINE, data, Image.Resampling.BICUBIC)
        if mask is not None:
            mask = mask.transform((w, h), Image.Transform.AFFINE, data, Image.Resampling.BILINEAR)
    if p.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        mask = mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if mask is not None else None
    return img, mask


@dataclass(frozen=True)
class _Layout:
    scale: float     # source pixels -> resized pixels
    nw: int          # resized image size
    nh: int
    left: int        # crop's top-left in the resized image
    top: int
    cx: float        # crop centre in the resized image
    cy: float


def _layout(img_size: Size, size: Size, p: AugmentParams) -> _Layout:
    iw, ih = img_size
    w, h = size
    theta = math.radians(p.angle)
    c, s = abs(math.cos(theta)), abs(math.sin(theta))
    need_w, need_h = w * c + h * s, w * s + h * c  # bounding box of the rotated crop
    scale = max(need_w / iw, need_h / ih) * max(1.0, p.zoom)
    if p.angle == 0:
        nw, nh = max(w, round(iw * scale)), max(h, round(ih * scale))
        left = min(max(int((nw - w) * (1 + p.shift_x) / 2), 0), nw - w)
        top = min(max(int((nh - h) * (1 + p.shift_y) / 2), 0), nh - h)
        return _Layout(scale, nw, nh, left, top, left + w / 2, top + h / 2)
    scale *= 1.0 + 2.0 / min(w, h)  # a pixel of margin against rounding at the edges
    nw, nh = max(1, round(iw * scale)), max(1, round(ih * scale))
    cx = nw / 2 + p.shift_x * max(0.0, nw - need_w) / 2
    cy = nh / 2 + p.shift_y * max(0.0, nh - need_h) / 2
    return _Layout(scale, nw, nh, int(round(cx - w / 2)), int(round(cy - h / 2)), cx, cy)


def crop_top_left(img_size: Size, size: Size, p: AugmentParams) -> Tuple[int, int]:
    """(top, left) of the crop in the resized image, as SDXL's crop conditioning wants it (for a
    rotated crop: of its centre minus half the size). Needs only the image size, not its pixels.

    A mirrored sample reports its crop in the mirrored image — where the pixels it shows are (diffusers' SDXL
    trainer flips before it crops; kohya mirrors the offset): the crop's left edge measured from the right."""
    g = _layout(img_size, size, p)
    return g.top, (g.nw - g.left - size[0]) if p.flip else g.left


def _resize(img: Image.Image, mask: Optional[Image.Image], new: Size,
            scale: float) -> Tuple[Image.Image, Optional[Image.Image]]:
    if new == img.size:
        return img, mask
    img = img.resize(new, Image.Resampling.LANCZOS, reducing_gap=3.0 if scale < 1 else None)
    if mask is not None:
        mask = mask.resize(new, Image.Resampling.BILINEAR, reducing_gap=3.0 if scale < 1 else None)
    return img, mask


def apply_color(img: Image.Image, p: AugmentParams) -> Image.Image:
    """Brightness, contrast, saturation (Pillow enhancers), then a hue rotation in HSV."""
    if p.brightness != 1.0:
        img = ImageEnhance.Brightness(img).enhance(p.brightness)
    if p.contrast != 1.0:
        img = ImageEnhance.Contrast(img).enhance(p.contrast)
    if p.saturation != 1.0:
        img = ImageEnhance.Color(img).enhance(p.saturation)
    if p.hue != 0.0:
        hsv = np.array(img.convert("HSV"), dtype=np.int16)
        hsv[..., 0] = (hsv[..., 0] + int(round(p.hue * 256))) % 256
        img = Image.fromarray(hsv.astype(np.uint8), "HSV").convert("RGB")
    return img


def apply(img: Image.Image, mask: Optional[Image.Image], size: Size,
          p: AugmentParams) -> Tuple[Image.Image, Optional[Image.Image]]:
    img, mask = apply_geometry(img, mask, size, p)
    if p.has_color:
        img = apply_color(img, p)
    return img, mask


__all__ = ["AugmentSettings", "AugmentParams", "draw_params", "apply_geometry", "apply_color", "apply",
           "crop_top_left"]
