"""A folder's images as the page shows them: a file that cannot be shown is named with its reason and the rest of the
folder still works, and a link never takes the page outside its folders.

The listing is the trainer's own (``trainer.data.concepts.find_images``: hidden files and masks are no images; a
folder with an image's name, a link to nothing and a looping link are named), then every image, its caption file and
its mask are resolved, links included, and what leads outside the page's folders is left out and named: a link in an
allowed folder would otherwise show a caption, serve an image or load a mask from anywhere on the disk.

The caption editor, the concept preview, the concept cards and the mask painter open whatever a user's folder holds:
a truncated download, a file with an image's extension that is not one, a crafted decompression bomb. Each is opened
here, behind one guard: Pillow's limit on pixels is a refusal (``trainer.data.probe.too_large``, the trainer's own
words), and any decoding error becomes the reason the trainer's probe gives for the file, so the page says what the
dataset report and a run would say. Pillow and the standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from trainer.data.concepts import MASK_SUFFIX, find_images, rel_path
from trainer.data.probe import probe_image, too_large
from webui.mdtext import md_code, md_escape

NAMES_SHOWN = 20  # skipped files named before "and N more"
GREY = (90, 90, 90)
OUTSIDE = "a link that leads outside the folders this page may show"


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


def page_images(folder: Path, allowed: Callable[[Path], bool], recursive: bool = False,
                caption_ext: Optional[str] = ".txt") -> Tuple[List[Path], List[Tuple[str, str]]]:
    """``(images, left out)``: the images of ``folder`` the page may show, sorted as the trainer sorts them, and
    ``(name, reason)`` for every entry with an image's name it leaves out. ``allowed`` judges a path after its links
    are resolved (``Roots.allowed``); an image is left out when it, its caption file (``caption_ext``) or its mask
    leads outside. With ``recursive``, a linked folder that leads outside is named and never entered (a link to
    ``/`` must not walk the disk), and a folder already read through another link is named as a loop."""
    images: List[Path] = []
    skipped: List[Tuple[str, str]] = []
    seen: set = set()
    plain: Dict[Path, set] = {}  # a folder inside the page's folders -> its entries that are links
    cap = "." + caption_ext.lstrip(".") if caption_ext else ""

    def visit(directory: Path) -> None:
        here: List[Tuple[str, str]] = []
        try:
            seen.add(directory.resolve())
            found = find_images(directory, False, passed_over=here)
            if found and allowed(directory):
                with os.scandir(directory) as entries:  # a link's type is in the listing: no stat per file
                    plain[directory] = {e.name for e in entries if e.is_symlink()}
            subfolders = sorted(e for e in directory.iterdir() if not e.name.startswith(".") and e.is_dir()) \
                if recursive else []
        except (OSError, RuntimeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            skipped.append((f"{rel_path(directory, folder)}/", f"cannot be read ({why})"))
            return
        images.extend(found)
        skipped.extend((rel_path(directory / name, folder), why) for name, why in here
                       if not (recursive and (directory / name).is_dir()))  # a folder named x.png: read below
        for sub in subfolders:
            if not allowed(sub):
                skipped.append((f"{rel_path(sub, folder)}/", OUTSIDE))
            elif sub.resolve() in seen:
                skipped.append((f"{rel_path(sub, folder)}/", "a link back to a folder already read (a loop)"))
            else:
                visit(sub)

    visit(folder)
    shown: List[Path] = []
    for image in sorted(images, key=lambda p: rel_path(p, folder)):
        links, stem = plain.get(image.parent), image.stem
        if links is not None and image.name not in links and stem + MASK_SUFFIX not in links and \
                (not cap or stem + cap not in links):
            shown.append(image)  # no link among them in an allowed folder: they resolve inside, no resolve() each
            continue
        companions = [image, image.with_name(stem + MASK_SUFFIX)] + ([image.with_suffix(cap)] if cap else [])
        leaving = [c for c in companions if (c == image or c.is_symlink() or c.exists()) and not allowed(c)]
        if not leaving:
            shown.append(image)
            continue
        whose = {0: "", 1: "its mask ", 2: "its caption file "}[companions.index(leaving[0])]
        skipped.append((rel_path(image, folder), f"{whose}`{leaving[0].name}` is {OUTSIDE}" if whose else OUTSIDE))
    return shown, sorted(skipped)


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
    """Markdown: "Error: N file(s) left out: `name` — reason; …" ("" when none)."""
    if not skipped:
        return ""
    shown = "; ".join(f"{md_code(name)} — {md_escape(why)}" for name, why in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"Error: {len(skipped)} {what}: {shown}{more}."


__all__ = ["NAMES_SHOWN", "OUTSIDE", "UnreadableImage", "grey_tile", "open_rgb", "page_images", "reason_for",
           "size_of", "skipped_md"]
