"""A folder's images as the page shows them: a file that cannot be shown is named with its reason and the rest of the
folder still works.

The caption editor, the concept preview, the concept cards and the mask painter open whatever a user's folder holds:
a truncated download, a file with an image's extension that is not one, a crafted decompression bomb. Each is opened
here, behind one guard: Pillow's limit on pixels is a refusal (``trainer.data.probe.too_large``, the trainer's own
words), and any decoding error becomes the reason the trainer's probe gives for the file, so the page says what the
dataset report and a run would say. Pillow and the standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

from PIL import Image

from trainer.data.probe import probe_image, too_large

NAMES_SHOWN = 20  # skipped files named before "and N more"
GREY = (90, 90, 90)


class UnreadableImage(OSError):
    """An image the page cannot show; the message is the reason, in the trainer's words."""


def reason_for(path: Path, exc: BaseException) -> str:
    """Why ``path`` could not be opened: the trainer's probe names the damage; else the error itself."""
    try:
        _, why = probe_image(path)
    except Exception:  # the probe itself failed on a crafted file: the first error is the reason
        why = None
    return why or f"cannot be read ({exc or type(exc).__name__})"


def open_rgb(path: Path, size: Optional[int] = None) -> Tuple[Optional[Any], str]:
    """``(image, "")``: ``path`` decoded as RGB (``size``: shrunk to fit a ``size`` square), or ``(None, why)``.
    Never raises for what a file holds."""
    try:
        with Image.open(path) as img:
            why = too_large(img)
            if why:
                return None, why
            if size:
                img.draft("RGB", (size, size))  # JPEG: decode at a reduced scale, a fraction of the cost
            rgb = img.convert("RGB")
        if size:
            rgb.thumbnail((size, size))
        return rgb, ""
    except Exception as exc:  # Pillow's decoders raise many kinds of errors on a damaged or crafted file
        return None, reason_for(path, exc)


def grey_tile(size: int) -> Any:
    """A plain tile in place of an image that cannot be shown (a gallery keeps its order)."""
    return Image.new("RGB", (size, size), GREY)


def size_of(path: Path) -> Tuple[Optional[Tuple[int, int]], str]:
    """``((width, height), "")`` from the file's header, or ``(None, why)`` (too large, not an image)."""
    try:
        with Image.open(path) as img:
            why, size = too_large(img), img.size
    except Exception as exc:  # as in open_rgb
        return None, reason_for(path, exc)
    return (None, why) if why else (size, "")


def skipped_md(skipped: Sequence[Tuple[str, str]], what: str = "file(s) left out", limit: int = NAMES_SHOWN) -> str:
    """Markdown: "⛔ N file(s) left out: `name` — reason; …" ("" when none)."""
    if not skipped:
        return ""
    shown = "; ".join(f"`{name}` — {why}" for name, why in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"⛔ {len(skipped)} {what}: {shown}{more}."


__all__ = ["NAMES_SHOWN", "UnreadableImage", "grey_tile", "open_rgb", "reason_for", "size_of",
           "skipped_md"]
