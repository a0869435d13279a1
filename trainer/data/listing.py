"""Listing a concept's folder: which files are training images, which are passed over and why.

Kept apart from the scan (``trainer.data.concepts``) because the web page and the captioners list folders too.
One ``os.scandir`` pass per folder (entries know their type: no stat per plain file); the formats Atelier does not
train on are collected in the same pass when asked (``unused``), not by listing the folder a second time.
Standard library only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, List, Optional, Tuple

from trainer.data.clips import is_mask_clip
from trainer.host.paths import confinement

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
# Image files people drop into a dataset that are not trained on: named in the check, not silently ignored.
UNUSED_IMAGE_EXTENSIONS = (".gif", ".avif", ".heic", ".heif", ".jxl", ".svg", ".psd", ".ico", ".apng", ".jp2")
MASK_SUFFIX = "-masklabel.png"  # OneTrainer's mask naming; masks are paired with images later


def find_images(folder: Path, recursive: bool, extensions: Tuple[str, ...] = IMAGE_EXTENSIONS,
                relative: bool = False, passed_over: Optional[List[Tuple[str, str]]] = None,
                unused: Optional[List[str]] = None) -> List[Any]:
    """Image files of a folder, sorted so every machine sees the same order (``relative``: as
    strings relative to ``folder``).

    Hidden files and folders (``.DS_Store``, macOS ``._name.png`` resource forks,
    ``.ipynb_checkpoints``) and mask files (``*-masklabel.png``) are not training images. Links to files and (with
    ``recursive``) to folders are followed once each. What carries an image's name but cannot be read as one goes
    to ``passed_over`` as (file, reason): a folder, a link to nothing or looping, a link leading outside the
    folders this process is confined to, a device or pipe. ``unused`` receives, relative and sorted, the readable
    files of the same listing in a format of :data:`UNUSED_IMAGE_EXTENSIONS` that ``extensions`` leaves out.
    """
    out: List[Tuple[str, Path]] = []  # (path relative to the folder, path)
    others: List[str] = []
    other_extensions = tuple(e for e in UNUSED_IMAGE_EXTENSIONS if e not in extensions) if unused is not None else ()
    skipped: List[Tuple[str, str]] = []
    seen_dirs: set = set()
    confined = confinement()

    def visit(directory: Path, prefix: str) -> None:
        try:
            real_dir = directory.resolve()
            with os.scandir(directory) as listing:  # entries know their type: no stat per file
                entries = list(listing)
        except (OSError, RuntimeError) as exc:
            if directory != folder:
                skipped.append((prefix, f"cannot be read ({_os_reason(exc)})"))
                return
            raise
        if real_dir in seen_dirs:
            skipped.append((prefix, "a link back to a folder already read (a loop)"))
            return
        seen_dirs.add(real_dir)
        kept = []
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            low = name.lower()
            image_name = low.endswith(extensions) and not low.endswith(MASK_SUFFIX) and not is_mask_clip(low)
            other = not image_name and bool(other_extensions) and low.endswith(other_extensions)
            if image_name or other or (recursive and _maybe_dir(entry)):  # not a caption, a mask, ...
                kept.append((name, entry, image_name, other))
        kept.sort(key=lambda k: k[0])  # every machine reads the folders in the same order
        for name, entry, image_name, other in kept:
            p = directory / name
            reason = _entry_problem(p, confined) if entry.is_symlink() else None
            is_dir = reason is None and entry.is_dir()
            if is_dir and recursive:
                visit(p, f"{prefix}{name}/")
                continue
            if not (image_name or other):
                continue
            if reason is None and is_dir:
                reason = "a folder named like an image (turn on recursive to read the images inside)"
            elif reason is None and not entry.is_file():
                reason = "not a regular file (a device, pipe or socket)"
            if other:
                if not reason:
                    others.append(prefix + name)
            elif reason:
                skipped.append((prefix + name, reason))
            else:
                out.append((prefix + name, p))

    visit(folder, "")
    out.sort(key=lambda pair: pair[0])
    if passed_over is not None:
        passed_over.extend(sorted(skipped))
    if unused is not None:
        unused.extend(sorted(others))
    return [rel for rel, _ in out] if relative else [p for _, p in out]


def _maybe_dir(entry: os.DirEntry) -> bool:
    """Whether a folder entry may be a folder to read (a link that cannot be followed is judged by the caller)."""
    try:
        return entry.is_symlink() or entry.is_dir()
    except OSError:
        return True


def _os_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _entry_problem(p: Path, confined: Any) -> Optional[str]:
    """Why a folder entry cannot be followed: a link to nothing, a looping link, a link out of the confinement."""
    if not p.is_symlink():
        return None
    try:
        target = os.readlink(p)
        real = p.resolve(strict=True)
    except RuntimeError:
        return "a link that loops back on itself"
    except OSError as exc:
        if getattr(exc, "errno", None) == errno.ELOOP:
            return "a link that loops back on itself"
        return f"a link to '{target}', which does not exist"
    if confined is not None and not confined.allows(real):
        return f"a link to '{real}', outside the folders this run may read"
    return None


__all__ = ["IMAGE_EXTENSIONS", "MASK_SUFFIX", "UNUSED_IMAGE_EXTENSIONS", "find_images"]
