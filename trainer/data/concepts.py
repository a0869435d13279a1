"""Concepts → a list of training items: find images, read captions, check files, order epochs.

This module is pure standard library plus Pillow (no torch), so a ``data-report`` command or the web
UI can scan a dataset in a fraction of a second without starting the training engine.

Captions are kept as *candidates* (``ImageItem.captions``): a multi-line caption file or a
concept-wide caption file gives several, and one is picked per epoch (:func:`pick_caption`), which
acts like caption augmentation. ``width``/``height`` are recorded (already EXIF-oriented) so
bucketing (``buckets``/``dataset``) needs no second scan; ``mask`` is the image's
``<stem>-masklabel.png`` when one exists (checked only when ``data.masks`` is on).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from trainer.errors import ConfigError, DataError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
# Image files people drop into a dataset that are not trained on: named in the check, not silently ignored.
UNUSED_IMAGE_EXTENSIONS = (".gif", ".avif", ".heic", ".heif", ".jxl", ".svg", ".psd", ".ico", ".apng", ".jp2")
MASK_SUFFIX = "-masklabel.png"  # OneTrainer's mask naming; masks are paired with images later
_LIST_LIMIT = 20  # how many file names a warning or report lists before "and N more"

Warn = Callable[[str], None]


@dataclass
class ImageItem:
    """One training image and everything the loader needs to turn it into a sample."""
    path: Path
    captions: List[str]          # candidate captions; one is picked at random per epoch
    concept_index: int           # index into data.concepts (the config's numbering, disabled ones included)
    loss_weight: float
    width: int = 0               # size as displayed, i.e. after EXIF orientation (0 = unknown)
    height: int = 0
    mask: Optional[Path] = None  # <stem>-masklabel.png next to the image, when present and usable
    validation: bool = False     # from a validation concept: loss is measured, never trained on


@dataclass
class ConceptReport:
    """What a scan found in one concept folder."""
    index: int
    name: str
    path: str
    repeats: float = 1.0
    images_found: int = 0
    images_used: int = 0
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (file, reason)
    captions_missing: int = 0   # txt mode: no caption file next to the image
    captions_empty: int = 0     # caption file present but blank
    captions_empty_files: List[str] = field(default_factory=list)
    unused_files: List[str] = field(default_factory=list)     # images in a format Atelier does not train on
    masks_blank: List[str] = field(default_factory=list)      # all-black masks: the image trains only outside focus
    validation: bool = False
    resolution: str = ""        # the concept's own resolution setting ("" = data.resolution)
    masks_found: int = 0
    masks_missing: List[str] = field(default_factory=list)   # with data.masks on
    masks_bad: List[Tuple[str, str]] = field(default_factory=list)  # (mask file, reason): trained unmasked

    @property
    def images_skipped(self) -> int:
        return len(self.skipped)

    @property
    def captions_with_text(self) -> int:
        return max(0, self.images_used - self.captions_missing - self.captions_empty)

    def to_dict(self) -> dict:
        return {
            "index": self.index, "name": self.name, "path": self.path, "repeats": self.repeats,
            "validation": self.validation, "resolution": self.resolution,
            "images_found": self.images_found, "images_used": self.images_used,
            "images_skipped": self.images_skipped,
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped[:_LIST_LIMIT]],
            "skipped_not_listed": max(0, self.images_skipped - _LIST_LIMIT),
            "captions_missing": self.captions_missing, "captions_empty": self.captions_empty,
            "captions_empty_files": self.captions_empty_files[:_LIST_LIMIT],
            "unused_files": self.unused_files[:_LIST_LIMIT],
            "masks_blank": self.masks_blank[:_LIST_LIMIT],
            "caption_coverage": round(self.captions_with_text / self.images_used, 4) if self.images_used else 0.0,
            "masks_found": self.masks_found, "masks_missing": len(self.masks_missing),
            "masks_missing_files": self.masks_missing[:_LIST_LIMIT],
            "masks_bad": [{"file": f, "reason": r} for f, r in self.masks_bad[:_LIST_LIMIT]],
            "images_per_epoch": 0.0 if self.validation else float(self.images_used * self.repeats),
        }


@dataclass
class DataReport:
    """The dataset summary shown before launch and written into the ``started`` event.

    :func:`scan_concepts` fills ``concepts`` and ``warnings``; ``trainer.data.dataset`` adds the
    bucket plan (histogram, dropped images, small images, duplicates)."""
    concepts: List[ConceptReport] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    batch_size: int = 0
    resolutions: List[str] = field(default_factory=list)
    buckets: List[dict] = field(default_factory=list)        # {"size", "images", "per_epoch", "trains"}
    dropped: List[str] = field(default_factory=list)         # in a bucket too small for a batch: never trained
    small_images: List[dict] = field(default_factory=list)   # {"file", "size", "bucket", "upscale"}
    duplicates: List[List[str]] = field(default_factory=list)  # files with identical content
    leftover_per_epoch: int = 0                              # samples of unfilled batches in epoch 1
    batches_per_epoch: int = 0

    @property
    def total_images(self) -> int:
        """Usable images over all enabled concepts (each counted once, repeats not applied)."""
        return sum(c.images_used for c in self.concepts)

    @property
    def total_skipped(self) -> int:
        return sum(c.images_skipped for c in self.concepts)

    @property
    def images_per_epoch(self) -> float:
        return sum(c.images_used * c.repeats for c in self.concepts if not c.validation)

    @property
    def masks_missing(self) -> List[str]:
        return [m for c in self.concepts for m in c.masks_missing]

    def to_dict(self) -> dict:
        listed = 200
        return {
            "total_images": self.total_images,
            "total_skipped": self.total_skipped,
            "images_per_epoch": float(self.images_per_epoch),
            "batch_size": self.batch_size,
            "batches_per_epoch": self.batches_per_epoch,
            "resolutions": list(self.resolutions),
            "buckets": list(self.buckets),
            "dropped": self.dropped[:listed], "dropped_count": len(self.dropped),
            "small_images": self.small_images[:listed], "small_images_count": len(self.small_images),
            "duplicates": self.duplicates[:listed], "duplicates_count": len(self.duplicates),
            "masks_missing": self.masks_missing[:listed], "masks_missing_count": len(self.masks_missing),
            "leftover_per_epoch": self.leftover_per_epoch,
            "concepts": [c.to_dict() for c in self.concepts],
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------------------------
# scanning
# --------------------------------------------------------------------------------------------

def _default_warn(message: str) -> None:
    log.warning(message)


def scan_concepts(data_cfg: Any, warn: Warn = _default_warn,
                  base_dir: Optional[Path] = None) -> Tuple[List[ImageItem], DataReport]:
    """Find every usable image of every enabled concept, with its caption candidates.

    ``data_cfg`` is the ``data`` section (an OmegaConf node or a ``DataConfig``). Relative concept
    paths and caption files are taken from ``base_dir`` (default: the current directory).
    Unreadable images are skipped with a warning rather than failing the run, because one bad file
    in a folder of hundreds should not cost a user their evening; a concept left with *no* image,
    a missing folder or no enabled concept at all raises :class:`DataError`.
    Every warning goes to ``warn`` and into ``report.warnings``.
    """
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    report = DataReport()

    def _warn(message: str) -> None:
        report.warnings.append(message)
        warn(message)

    concepts = list(data_cfg.concepts or [])
    enabled = [(i, c) for i, c in enumerate(concepts) if c.enabled]
    if not enabled:
        raise DataError("No enabled concept in data.concepts: add a folder of training images "
                        "(or turn 'enabled' on for one).", key="data.concepts")

    items: List[ImageItem] = []
    for index, concept in enabled:
        concept_items, concept_report = _scan_one(index, concept, base, _warn,
                                                  masks=bool(getattr(data_cfg, "masks", False)))
        items += concept_items
        report.concepts.append(concept_report)
    return items, report


def _label(index: int, concept: Any) -> str:
    return f"concept {index}" + (f" ('{concept.name}')" if concept.name else "")


def _resolve(path_str: str, base: Path) -> Path:
    p = Path(os.path.expanduser(str(path_str)))
    return p if p.is_absolute() else base / p


def concept_folder(index: int, concept: Any, base: Path) -> Tuple[Path, List[Path]]:
    """The folder of an enabled concept and its image files, or DataError naming the field: empty,
    missing, a file, or holding no image. Cheap (a directory listing): ``validate`` runs it too."""
    key = f"data.concepts.{index}.path"
    label = _label(index, concept)
    if not str(concept.path or "").strip():
        raise DataError(f"{key} is empty: give {label} the folder that holds its images.", key=key)
    folder = _resolve(concept.path, base)
    if not folder.exists():
        raise DataError(f"{key}: folder '{folder}' does not exist. Check the path of {label} "
                        "(relative paths are read from the folder Atelier was started in).",
                        key=key, value=str(concept.path))
    if not folder.is_dir():
        raise DataError(f"{key}: '{folder}' is a file, not a folder. Point {label} at the folder "
                        "that holds the images.", key=key, value=str(concept.path))
    files = find_images(folder, bool(concept.recursive))
    if not files:
        hint = ""
        if not concept.recursive and find_images(folder, True):
            hint = f" Its sub-folders do hold images: turn on data.concepts.{index}.recursive."
        raise DataError(f"{key}: folder '{folder}' has no images ({' '.join(IMAGE_EXTENSIONS)}).{hint} "
                        f"Add images, fix the path, or disable {label}.", key=key, value=str(concept.path))
    return folder, files


def concept_caption_file(index: int, concept: Any, folder: Path, base: Path) -> Path:
    """The caption file of a ``caption_source: concept_file`` concept, or DataError naming the field."""
    key = f"data.concepts.{index}.caption_file"
    if not str(concept.caption_file or "").strip():
        raise DataError(f"{key} is empty: {_label(index, concept)} reads its captions from one text "
                        "file; name that file.", key=key)
    path = _resolve(concept.caption_file, base)
    if not path.is_file() and not Path(str(concept.caption_file)).is_absolute():
        path = folder / str(concept.caption_file)  # also accept a path relative to the concept folder
    if not path.is_file():
        raise DataError(f"{key}: caption file '{concept.caption_file}' was not found (looked in "
                        f"'{base}' and '{folder}'). Fix the path or use caption_source=txt.",
                        key=key, value=str(concept.caption_file))
    return path


def _scan_one(index: int, concept: Any, base: Path, warn: Warn,
              masks: bool = False) -> Tuple[List[ImageItem], ConceptReport]:
    key = f"data.concepts.{index}.path"
    label = _label(index, concept)
    folder, files = concept_folder(index, concept, base)

    report = ConceptReport(index=index, name=str(concept.name or folder.name), path=str(folder),
                           repeats=float(concept.repeats), validation=bool(getattr(concept, "validation", False)),
                           resolution=str(getattr(concept, "resolution", "") or ""))
    report.images_found = len(files)
    report.unused_files = find_images(folder, bool(concept.recursive), UNUSED_IMAGE_EXTENSIONS, relative=True)
    if report.unused_files:
        warn(f"{label}: {len(report.unused_files)} files are in a format Atelier does not train on and are "
             f"not used ({_list(report.unused_files)}). Convert them to PNG or JPEG (for an animation, "
             "export the frames you want) to train on them.")
    shared_captions: Optional[List[str]] = None
    if concept.caption_source == "concept_file":
        shared_captions = _read_concept_file(index, concept, folder, base, warn)

    workers = max(1, min(8, (os.cpu_count() or 1), len(files)))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # decoding releases the GIL
        checks = list(pool.map(probe_image, files))

    items: List[ImageItem] = []
    missing: List[str] = []
    for path, (size, problem) in zip(files, checks):
        rel = _rel(path, folder)
        if problem is not None:
            report.skipped.append((rel, problem))
            warn(f"Skipping '{path}' ({label}): {problem}. Re-save or remove the file.")
            continue
        if shared_captions is not None:
            captions = list(shared_captions)
        elif concept.caption_source == "filename":
            captions = [caption_from_filename(path)]
        else:
            captions = _read_image_captions(path, concept.caption_extension, warn)
            if captions is None:
                missing.append(rel)
                captions = [""]
            elif not captions:
                report.captions_empty += 1
                report.captions_empty_files.append(_rel(path.with_name(path.stem + _caption_ext(concept.caption_extension)),
                                                        folder))
                captions = [""]
        items.append(ImageItem(path=path, captions=captions, concept_index=index,
                               loss_weight=float(concept.loss_weight), width=size[0], height=size[1],
                               validation=report.validation))

    if masks:
        _attach_masks(items, folder, report, label, warn)
    report.images_used = len(items)
    report.captions_missing = len(missing)
    if missing:
        ext = _caption_ext(concept.caption_extension)
        warn(f"{label}: {len(missing)} of {report.images_found} images have no caption file "
             f"({_list(missing)}); they train with an empty caption. Add <image name>{ext} next to "
             f"each image, or set data.concepts.{index}.caption_source to concept_file or filename.")
    if report.captions_empty:
        warn(f"{label}: {report.captions_empty} caption files are empty ({_list(report.captions_empty_files)}); "
             "those images train with an empty caption. Write a caption into each, or delete them.")
    if not items:
        raise DataError(f"{key}: none of the {report.images_found} images in '{folder}' could be read "
                        f"({_list([f'{f}: {r}' for f, r in report.skipped], 5)}). "
                        "Re-save them as PNG or JPEG, or fix the path.", key=key, value=str(concept.path))
    return items, report


def mask_path(image: Path) -> Path:
    """Where the mask of ``image`` lives: ``<stem>-masklabel.png`` in the same folder."""
    return image.with_name(image.stem + MASK_SUFFIX)


def _attach_masks(items: List[ImageItem], folder: Path, report: ConceptReport, label: str, warn: Warn) -> None:
    """Pair each image with its mask. A missing mask trains the whole image (all focus); an
    unreadable mask, or one whose shape differs from its image's, is reported and ignored; one
    with the image's aspect but another size is used, scaled to the image."""
    candidates = [mask_path(it.path) for it in items]
    present = [(it, m) for it, m in zip(items, candidates) if m.is_file()]
    workers = max(1, min(8, (os.cpu_count() or 1), len(present) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        checks = list(pool.map(lambda pair: probe_image(pair[1]), present))
    by_item = {id(it): (m, chk) for (it, m), chk in zip(present, checks)}
    for item in items:
        rel = _rel(item.path, folder)
        if id(item) not in by_item:
            report.masks_missing.append(rel)
            continue
        m, (size, problem) = by_item[id(item)]
        mrel = _rel(m, folder)
        if problem is None and size != (item.width, item.height):
            ia, ma = item.width / item.height, size[0] / size[1]
            if abs(ia - ma) / ia > 0.01:
                problem = (f"its size {size[0]}x{size[1]} does not match the image's "
                           f"{item.width}x{item.height}")
        if problem is not None:
            report.masks_bad.append((mrel, problem))
            warn(f"Ignoring mask '{m}' ({label}): {problem}. '{item.path.name}' trains without a mask; "
                 "re-export the mask at the image's size.")
            continue
        item.mask = m
        report.masks_found += 1
        if mask_is_blank(m):
            report.masks_blank.append(mrel)
    if report.masks_blank:
        warn(f"{label}: {len(report.masks_blank)} masks are black everywhere ({_list(report.masks_blank)}): "
             "nothing of those images is in focus, so they train only at loss.unmasked_weight. Paint the "
             "subject white, or delete the mask to train the whole image.")
    if report.masks_missing:
        warn(f"{label}: {len(report.masks_missing)} of {len(items)} images have no mask "
             f"({_list(report.masks_missing)}); they train as if all of the image were in focus. "
             f"Add <image name>{MASK_SUFFIX} (white = focus) next to each image.")


def find_images(folder: Path, recursive: bool, extensions: Tuple[str, ...] = IMAGE_EXTENSIONS,
                relative: bool = False) -> List[Any]:
    """Image files of a folder, sorted so every machine sees the same order (``relative``: as
    strings relative to ``folder``).

    Hidden files and folders (``.DS_Store``, macOS ``._name.png`` resource forks,
    ``.ipynb_checkpoints``) and mask files (``*-masklabel.png``) are not training images.
    """
    out: List[Path] = []
    walker: Iterable = os.walk(folder) if recursive else [(str(folder), [], os.listdir(folder))]
    for root, dirs, names in walker:
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            low = name.lower()
            if name.startswith(".") or low.endswith(MASK_SUFFIX) or not low.endswith(extensions):
                continue
            p = Path(root) / name
            if p.is_file():
                out.append(p)
    out.sort(key=lambda p: _rel(p, folder))
    return [_rel(p, folder) for p in out] if relative else out


def probe_image(path: Path) -> Tuple[Tuple[int, int], Optional[str]]:
    """Check that ``path`` is an image that decodes whole: ``((width, height), None)`` or
    ``((0, 0), reason)``.

    Every image is decoded in full, so a file whose checksums are valid but whose pixel stream is
    broken is caught here, not at caching. PNGs also get Pillow's ``verify()`` (chunk CRCs) and a
    check that the compressed stream holds every row (Pillow fills missing rows with black without
    a word); JPEGs are decoded at a reduced DCT scale (``draft``: the whole entropy-coded stream is
    still read, so truncation and corruption show, for a fraction of the cost).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        if path.stat().st_size == 0:
            return (0, 0), "the file is empty (0 bytes)"
        with Image.open(path) as img:
            width, height = img.size
            fmt = img.format
            orientation = _orientation(img)
            if fmt == "PNG":
                img.verify()
        if fmt == "PNG":
            problem = png_stream_problem(path)
            if problem:
                return (0, 0), problem
        with Image.open(path) as img:
            if fmt == "JPEG":
                img.draft(None, (64, 64))
            img.load()
    except UnidentifiedImageError:
        return (0, 0), "not an image Pillow can read (wrong extension or damaged file)"
    except Image.DecompressionBombError as exc:
        return (0, 0), f"too large to open safely ({exc}); downscale it"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return (0, 0), f"damaged or truncated image ({exc})"
    if width <= 0 or height <= 0:
        return (0, 0), f"image has no pixels ({width}x{height})"
    if orientation in (5, 6, 7, 8):  # rotated by 90°: displayed size is transposed
        width, height = height, width
    return (width, height), None


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def png_stream_problem(path: Path) -> Optional[str]:
    """Why the pixel data of a PNG is incomplete or broken, or None: the IDAT stream must inflate to
    exactly the bytes its header promises (a cut-off stream with valid checksums otherwise decodes
    as an image whose last rows are black). Standard library only."""
    import struct
    import zlib
    with open(path, "rb") as fh:
        data = fh.read()
    pos, ihdr, inflater, got = 8, None, zlib.decompressobj(), 0
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if ctype == b"IHDR" and len(body) >= 13:
            ihdr = struct.unpack(">IIBBBBB", body[:13])
        elif ctype == b"IDAT":
            try:
                got += len(inflater.decompress(body))
            except zlib.error as exc:
                return f"damaged pixel data ({exc})"
        elif ctype == b"IEND":
            break
    if ihdr is None:
        return "no PNG header"
    width, height, depth, colour, _c, _f, interlace = ihdr
    bits = _PNG_CHANNELS.get(colour, 4) * depth
    if interlace:  # Adam7: seven reduced images, each row with its filter byte
        passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
        want = 0
        for x0, y0, dx, dy in passes:
            w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
            if w and h:
                want += h * (1 + (w * bits + 7) // 8)
    else:
        want = height * (1 + (width * bits + 7) // 8)
    if got < want or not inflater.eof:
        rows = got * height // want if want else 0
        return (f"truncated pixel data: about {rows} of {height} rows are in the file (the rest would train "
                "as black)")
    return None


def mask_is_blank(path: Path) -> bool:
    """True when a mask is black everywhere (no pixel in focus)."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            return img.convert("L").getextrema()[1] == 0
    except (OSError, ValueError, SyntaxError):
        return False


def _orientation(img: Any) -> int:
    """EXIF orientation without decoding pixels (PNG's getexif() would load the whole image;
    its eXIf chunk normally precedes the pixel data, so it is already in ``info``)."""
    try:
        if img.format == "PNG":
            from PIL import Image
            raw = img.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = img.getexif()
        return int(exif.get(0x0112, 1) or 1)
    except Exception:  # broken EXIF is not a reason to drop the image
        return 1


# --------------------------------------------------------------------------------------------
# captions
# --------------------------------------------------------------------------------------------

def read_text(path: Path, warn: Warn = _default_warn) -> str:
    """Read a caption file: UTF-8 (with or without BOM), UTF-16 with BOM, else cp1252/latin-1.

    Captions written on Windows by older taggers are often cp1252; reading them as latin-1
    silently would turn ``’`` into mojibake, so the fallback is announced.
    """
    raw = path.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError:
            pass
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    for encoding in ("cp1252", "latin-1"):
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            continue
        warn(f"Caption file '{path}' is not UTF-8; read it as {encoding}. Re-save it as UTF-8 "
             "if any character looks wrong.")
        return text
    raise AssertionError("latin-1 decodes any bytes")  # pragma: no cover


def caption_lines(text: str) -> List[str]:
    """Non-empty, stripped lines: each is one candidate caption."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def _caption_ext(ext: str) -> str:
    ext = str(ext or ".txt").strip()
    return ext if ext.startswith(".") else "." + ext


def _read_image_captions(image: Path, extension: str, warn: Warn) -> Optional[List[str]]:
    """Candidates from ``<stem><extension>`` next to the image; None when there is no such file."""
    cap = image.with_name(image.stem + _caption_ext(extension))
    if not cap.is_file():
        return None
    try:
        return caption_lines(read_text(cap, warn))
    except OSError as exc:
        warn(f"Could not read caption file '{cap}' ({exc}); the image trains with an empty caption.")
        return []


def _read_concept_file(index: int, concept: Any, folder: Path, base: Path, warn: Warn) -> List[str]:
    key = f"data.concepts.{index}.caption_file"
    path = concept_caption_file(index, concept, folder, base)
    lines = caption_lines(read_text(path, warn))
    if not lines:
        raise DataError(f"{key}: caption file '{path}' has no caption. Write one caption a line.",
                        key=key, value=str(concept.caption_file))
    return lines


# "_001", "-3", ".02", " 7" and " (2)" at the end of a name: copies and numbered exports.
_NUMBERING = re.compile(r"(?:[\s_.\-]+\d+|\s*\(\d+\))$")


def caption_from_filename(path: Path) -> str:
    """``a_red_fox_001.png`` → ``a red fox``: the stem without trailing numbering, ``_`` → space.

    Bare digits glued to a word (``r2d2``, ``sks1``) are kept: they are usually part of the name.
    """
    stem = Path(path).stem
    text = stem
    while True:
        stripped = _NUMBERING.sub("", text)
        if stripped == text or not stripped.strip(" _.-"):
            break
        text = stripped
    text = text.replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def pick_caption(item: ImageItem, rng: random.Random) -> str:
    """One candidate caption of ``item``, chosen with ``rng``.

    Pass an rng from :func:`sample_rng` so a resumed run picks the same caption for the same sample.
    """
    if not item.captions:
        return ""
    if len(item.captions) == 1:
        return item.captions[0]
    return item.captions[rng.randrange(len(item.captions))]


# --------------------------------------------------------------------------------------------
# epoch order
# --------------------------------------------------------------------------------------------

def _seed_int(*parts: Any) -> int:
    """A 64-bit seed from any parts; stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_rng(seed: int, epoch: int, position: int, purpose: str = "sample") -> random.Random:
    """An rng for one sample of one epoch (caption pick, random crop, flip).

    Deriving it from (seed, epoch, position) instead of carrying one rng through the loop makes a
    resumed run — or a run with a different number of dataloader workers — see exactly the same
    samples without saving any rng state.
    """
    return random.Random(_seed_int("atelier", purpose, seed, epoch, position))


def _repeats_list(items: Sequence[ImageItem], repeats_per_item: Any) -> List[float]:
    if isinstance(repeats_per_item, (int, float)):
        return [float(repeats_per_item)] * len(items)
    reps = [float(r) for r in repeats_per_item]
    if len(reps) != len(items):
        raise ValueError(f"repeats_per_item has {len(reps)} values for {len(items)} items")
    return reps


def concept_repeats(concept: Any, images: int) -> float:
    """A concept's repeats: ``samples`` per epoch spread over its images when set, else ``repeats``.

    ``samples`` balances concepts of different sizes (20 images and 200 images both at 100 samples
    an epoch); the fraction is paid out exactly over epochs by :func:`epoch_order`."""
    samples = int(getattr(concept, "samples", 0) or 0)
    if samples > 0 and images > 0:
        return float(Fraction(samples, images))
    return float(concept.repeats)


def item_repeats(items: Sequence[ImageItem], data_cfg: Any) -> List[float]:
    """Each item's concept's repeats (see :func:`concept_repeats`), the usual
    ``repeats_per_item`` for :func:`epoch_order`."""
    concepts = list(data_cfg.concepts)
    counts: dict = {}
    for it in items:
        counts[it.concept_index] = counts.get(it.concept_index, 0) + 1
    return [concept_repeats(concepts[it.concept_index], counts[it.concept_index]) for it in items]


def _exact(value: float) -> Fraction:
    # Fraction of the decimal the user typed (0.3 → 3/10), so floor(0.3 * 10) is 3, not 2.
    return Fraction(repr(float(value))).limit_denominator(10**6)


def epoch_order(items: Sequence[ImageItem], repeats_per_item: Any, epoch: int, seed: int) -> List[int]:
    """The shuffled item indices of one epoch, repeats applied; a pure function of its arguments.

    Whole repeats put an item ``floor(repeats)`` times in the epoch. The fractional parts are paid out
    over epochs: items of one concept with the same fraction ``f`` form a group with ``F = f * n``
    extra draws per epoch; epoch ``e`` takes the next ``floor(F*(e+1)) - floor(F*e)`` items of a
    fixed seeded permutation of the group, cyclically. So repeats=0.5 shows every image exactly once
    every two epochs (not "maybe, maybe not" per epoch), the count over E epochs is ``floor(F*E)``,
    and a resumed run recomputes exactly the same order from (seed, epoch).
    ``repeats_per_item`` is one number for all items or one per item (see :func:`item_repeats`).
    """
    reps = _repeats_list(items, repeats_per_item)
    order: List[int] = []
    groups: dict = {}
    for i, (item, r) in enumerate(zip(items, reps)):
        if r < 0:
            raise ValueError(f"repeats must be >= 0, got {r} for item {i}")
        exact = _exact(r)
        whole = int(exact)  # floor for non-negative
        order += [i] * whole
        frac = exact - whole
        if frac:
            groups.setdefault((item.concept_index, frac), []).append(i)
    for (concept_index, frac), members in sorted(groups.items()):
        n = len(members)
        total = frac * n
        start, stop = int(total * epoch), int(total * (epoch + 1))
        if stop == start:
            continue
        perm = list(members)
        random.Random(_seed_int("atelier-fraction", seed, concept_index, frac)).shuffle(perm)
        order += [perm[k % n] for k in range(start, stop)]
    random.Random(_seed_int("atelier-epoch", seed, epoch)).shuffle(order)
    return order


def epoch_length(items: Sequence[ImageItem], repeats_per_item: Any, epoch: int) -> int:
    """``len(epoch_order(...))`` without shuffling: what a step count for the schedule needs.

    Fractional repeats make lengths differ by at most one per concept between epochs.
    """
    reps = _repeats_list(items, repeats_per_item)
    length = 0
    fracs: dict = {}
    for item, r in zip(items, reps):
        exact = _exact(r)
        length += int(exact)
        if exact - int(exact):
            k = (item.concept_index, exact - int(exact))
            fracs[k] = fracs.get(k, 0) + 1
    for (_, frac), n in fracs.items():
        length += int(frac * n * (epoch + 1)) - int(frac * n * epoch)
    return length


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _rel(path: Path, folder: Path) -> str:
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return str(path)


def _list(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = [
    "DataError", "ImageItem", "ConceptReport", "DataReport", "IMAGE_EXTENSIONS", "MASK_SUFFIX",
    "scan_concepts", "concept_folder", "concept_caption_file", "find_images", "probe_image", "png_stream_problem", "mask_is_blank", "mask_path", "concept_repeats", "read_text", "caption_lines", "caption_from_filename",
    "pick_caption", "sample_rng", "epoch_order", "epoch_length", "item_repeats",
]
