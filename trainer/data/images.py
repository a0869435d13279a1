"""Image file → training tensor: orientation, colour mode, resize, crop, flip; masks alike.

Every path from disk to pixels goes through :func:`open_rgb` (masks: :func:`open_mask`), so EXIF
rotation and odd colour modes (CMYK JPEGs from print workflows, 16-bit PNGs from scanners, palette
GIF-likes, transparent PNGs) are handled once, the same way for training and latent caching.
:func:`render_sample` applies one sample's bucket size and augmentation to an image and its mask.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np
from PIL import Image, ImageOps

from trainer.data.augment import AugmentParams, apply, apply_geometry
from trainer.data.probe import TOO_LARGE, too_large
from trainer.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import torch

_HIGH_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def open_rgb(path: Path, min_side: Optional[int] = None) -> Image.Image:
    """Open ``path`` as an 8-bit RGB image the right way up.

    ``min_side``: the smallest short side the caller needs; lets JPEGs decode at a reduced DCT scale
    (a 6000-px photo trained at 512 decodes ~8x faster). Transparent pixels become white, because
    a model trained on black "transparent" backgrounds learns black halos.
    Raises :class:`DataError` naming the file when it cannot be read.
    """
    path = Path(path)
    try:
        with Image.open(path) as img:
            if too_large(img):
                raise DataError(f"Image '{path}' is {too_large(img)}.", value=str(path))
            if min_side and img.format == "JPEG":
                w, h = img.size
                scale = min_side / min(w, h)
                if scale < 0.5:
                    img.draft(None, (math.ceil(w * scale), math.ceil(h * scale)))
            img.load()
            img = ImageOps.exif_transpose(img)  # a copy, independent of the file handle
        return _to_rgb(img)
    except DataError:
        raise
    except TOO_LARGE as exc:
        raise DataError(f"Image '{path}' is too large to open safely ({exc}). Downscale it.",
                        value=str(path)) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise DataError(f"Could not read image '{path}' ({exc}). Re-save it as PNG or JPEG, or "
                        "remove it from the folder.", value=str(path)) from None


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in _HIGH_BIT_MODES:
        img = _high_bit_to_l(img)
    if img.has_transparency_data:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode != "RGB":
        img = img.convert("RGB")  # CMYK, L, 1, P, YCbCr, ...
    return img


def _high_bit_to_l(img: Image.Image) -> Image.Image:
    """16-bit / 32-bit / float greyscale → 8-bit ``L``.

    Pillow's own ``convert("L")`` clips 16-bit values at 255, which turns a scanner's 16-bit PNG
    almost white; scale by the bit depth instead.
    """

    arr = np.asarray(img).astype(np.float64)
    hi = float(arr.max()) if arr.size else 0.0
    if img.mode.startswith("I;16"):
        scale = 255.0 / 65535.0
    elif img.mode == "F" and hi <= 1.0:
        scale = 255.0
    elif hi <= 255.0:
        scale = 1.0
    elif hi <= 65535.0:
        scale = 255.0 / 65535.0
    else:
        scale = 255.0 / hi
    return Image.fromarray(np.clip(np.rint(arr * scale), 0, 255).astype(np.uint8))


def resize_crop(img: Image.Image, width: int, height: int, center_crop: bool = True,
                crop_rng: Optional[random.Random] = None) -> Tuple[Image.Image, Tuple[int, int]]:
    """Scale ``img`` to cover ``width``×``height`` (no distortion), then crop to exactly that size.

    Returns the crop and its (top, left) offset in the scaled image — SDXL's crop conditioning and
    aspect buckets will need it. The crop is centred unless ``center_crop`` is off and a
    ``crop_rng`` is given.
    """
    w, h = img.size
    scale = max(width / w, height / h)
    new_w = max(width, round(w * scale))
    new_h = max(height, round(h * scale))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.Resampling.LANCZOS,
                         reducing_gap=3.0 if scale < 1 else None)
    if center_crop or crop_rng is None:
        left, top = (new_w - width) // 2, (new_h - height) // 2
    else:
        left, top = crop_rng.randint(0, new_w - width), crop_rng.randint(0, new_h - height)
    if (new_w, new_h) != (width, height):
        img = img.crop((left, top, left + width, top + height))
    return img, (top, left)


def to_tensor(img: Image.Image) -> "torch.Tensor":
    """RGB PIL image → float32 [3, H, W] in [-1, 1] (what the VAE expects)."""
    import torch  # torch inside: data-report and the UI import this module without torch

    w, h = img.size
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return data.view(h, w, 3).permute(2, 0, 1).float().div_(127.5).sub_(1.0).contiguous()


def pixels_to_uint8(pixels: "torch.Tensor") -> "torch.Tensor":
    """:func:`to_tensor`'s output back to its uint8 values (lossless: every value it makes is k/127.5 - 1).
    A quarter of the float's size, for caches that keep rendered pixels (inpainting's masked images)."""
    import torch  # torch inside: data-report and the UI import this module without torch
    return pixels.detach().float().add(1.0).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)


def uint8_to_pixels(data: "torch.Tensor") -> "torch.Tensor":
    """uint8 [..., 3, H, W] → float32 in [-1, 1], bit for bit what :func:`to_tensor` made from them."""
    return data.float().div_(127.5).sub_(1.0)


def load_image(path: Path, resolution: int, center_crop: bool, flip: bool,
               crop_rng: Optional[random.Random] = None) -> "torch.Tensor":
    """A training image as float32 [3, resolution, resolution] in [-1, 1].

    EXIF-oriented, converted to RGB (alpha over white), resized so the short side is
    ``resolution`` (Lanczos; tiny images are upscaled), cropped (centre, or random with
    ``crop_rng``) and mirrored when ``flip``. Raises :class:`DataError` naming the file.
    """

    img = open_rgb(path, min_side=resolution)
    shift = (0.0, 0.0) if center_crop or crop_rng is None else (crop_rng.uniform(-1, 1), crop_rng.uniform(-1, 1))
    img, _ = apply_geometry(img, None, (resolution, resolution),
                            AugmentParams(flip=flip, shift_x=shift[0], shift_y=shift[1]))
    return to_tensor(img)


# --------------------------------------------------------------------------------------------
# masks and samples
# --------------------------------------------------------------------------------------------

def open_mask(path: Path) -> Image.Image:
    """A ``-masklabel.png`` as 8-bit greyscale the right way up (white = focus).

    Colour masks are converted to luminance; 16-bit masks are scaled like 16-bit images; a
    transparent pixel counts as black (not in focus). Raises :class:`DataError` naming the file.
    """
    path = Path(path)
    try:
        with Image.open(path) as img:
            img.load()
            img = ImageOps.exif_transpose(img)
        if img.mode in _HIGH_BIT_MODES:
            return _high_bit_to_l(img)
        if img.has_transparency_data:
            rgba = img.convert("RGBA")
            black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
            return Image.alpha_composite(black, rgba).convert("L")
        return img.convert("L")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise DataError(f"Could not read mask '{path}' ({exc}). Re-save it as a greyscale PNG "
                        "(white = focus) or remove it.", value=str(path)) from None


def decode(path: Path, mask_path: Optional[Path], min_side: Optional[int] = None
           ) -> Tuple[Image.Image, Optional[Image.Image]]:
    """Image (RGB) and mask (L, resized to the image when its size differs) of one sample,
    decoded once; the pipeline reuses the pair for every crop and variant it needs."""
    img = open_rgb(path, min_side=min_side)
    mask = open_mask(mask_path) if mask_path is not None else None
    if mask is not None and mask.size != img.size:
        mask = mask.resize(img.size, Image.Resampling.BILINEAR)
    return img, mask


def mask_to_tensor(mask: Image.Image) -> "torch.Tensor":
    """L image → float32 [1, H, W] in [0, 1] (1 = focus)."""
    import torch  # torch inside: data-report and the UI import this module without torch

    w, h = mask.size
    data = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8)
    return data.view(1, h, w).float().div_(255.0)


def render_sample(img: Image.Image, mask: Optional[Image.Image], size: Tuple[int, int], params: Any
                  ) -> Tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """Apply one sample's :class:`~trainer.data.augment.AugmentParams`: pixels [3, H, W] in
    [-1, 1] and, when there is a mask, the mask [1, H, W] in [0, 1], pixel-aligned."""

    out, out_mask = apply(img, mask, size, params)
    return to_tensor(out), (mask_to_tensor(out_mask) if out_mask is not None else None)


def mask_to_latent(mask: "torch.Tensor", latent_hw: Tuple[int, int]) -> "torch.Tensor":
    """Pixel mask [..., 1, H, W] → latent resolution by area averaging (a soft edge where a latent
    cell covers both focus and background)."""
    import torch.nn.functional as F  # torch inside: data-report and the UI import this module without torch

    squeeze = mask.dim() == 3
    m = mask[None] if squeeze else mask
    out = F.interpolate(m.float(), size=tuple(latent_hw), mode="area")
    return out[0] if squeeze else out


__all__ = ["open_rgb", "resize_crop", "to_tensor", "pixels_to_uint8", "uint8_to_pixels", "load_image", "open_mask",
           "decode", "mask_to_tensor",
           "render_sample", "mask_to_latent"]
