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

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from trainer.data.clips import VIDEO_EXTENSIONS, ClipInfo, Window, clip_mask, is_mask_clip, probe_clip, probe_mask_clip
from trainer.data.captions import caption_ext, caption_from_filename, caption_lines, read_text
from trainer.data.listing import IMAGE_EXTENSIONS, MASK_SUFFIX, find_images
from trainer.data.probe import Prober, mask_is_blank
from trainer.errors import DataError

log = logging.getLogger(__name__)

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
    role: str = "train"          # the concept's role: train | validation | regularisation | prior_prediction
    controls: Tuple[Path, ...] = ()  # its control/reference images, one from each of the concept's control folders
    clip: Optional[ClipInfo] = None  # a video clip (a video family's concept): what probing it found
    window: Optional[Window] = None  # a video family's sample: which frames of the clip (an image: Window(0, 1))


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
    role: str = "train"
    controls: List[str] = field(default_factory=list)  # the control folders (images pair by name)
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
            "validation": self.validation, "role": self.role, "controls": list(self.controls),
            "resolution": self.resolution,
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
    clips: List[dict] = field(default_factory=list)  # a video family's clips: each with its windows or why skipped
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
            "clips": list(self.clips),
            "concepts": [c.to_dict() for c in self.concepts],
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------------------------
# scanning
# --------------------------------------------------------------------------------------------

def _default_warn(message: str) -> None:
    log.warning(message)


def scan_concepts(data_cfg: Any, warn: Warn = _default_warn, base_dir: Optional[Path] = None,
                  clips: bool = False, prober: Optional[Prober] = None) -> Tuple[List[ImageItem], DataReport]:
    """Find every usable image of every enabled concept, with its caption candidates.

    ``data_cfg`` is the ``data`` section (an OmegaConf node or a ``DataConfig``). Relative concept
    paths and caption files are taken from ``base_dir`` (default: the current directory).
    Unreadable images are skipped with a warning rather than failing the run, because one bad file
    in a folder of hundreds should not cost a user their evening; a concept left with *no* image,
    a missing folder or no enabled concept at all raises :class:`DataError`.
    Every warning goes to ``warn`` and into ``report.warnings``. ``clips`` (a video family): a concept folder's
    clips are training items too, each with its :class:`ClipInfo`. ``prober`` checks each image, control and mask
    (default: every file decoded afresh; ``trainer.data.scanindex.ScanIndex``: the remembered scan).
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
    prober = prober if prober is not None else Prober()
    masks = bool(getattr(data_cfg, "masks", False))
    for index, concept in enabled:
        concept_items, concept_report = _scan_one(index, concept, base, _warn, masks=masks, clips=clips,
                                                  prober=prober)
        items += concept_items
        report.concepts.append(concept_report)
    return items, report


def concept_label(index: int, concept: Any) -> str:
    return f"concept {index}" + (f" ('{concept.name}')" if concept.name else "")


def _resolve(path_str: str, base: Path) -> Path:
    p = Path(os.path.expanduser(str(path_str)))
    return p if p.is_absolute() else base / p


def concept_folder(index: int, concept: Any, base: Path, passed_over: Optional[List[Tuple[str, str]]] = None,
                   extensions: Tuple[str, ...] = IMAGE_EXTENSIONS,
                   unused: Optional[List[str]] = None) -> Tuple[Path, List[Path]]:
    """The folder of an enabled concept and its image files, or DataError naming the field: empty,
    missing, a file, or holding no image. Cheap (a directory listing): ``validate`` runs it too.
    ``passed_over`` receives what carries an image's name but is no image file, ``unused`` the files in a format
    not trained on (see :func:`trainer.data.listing.find_images`)."""
    key = f"data.concepts.{index}.path"
    label = concept_label(index, concept)
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
    passed: List[Tuple[str, str]] = []
    files = find_images(folder, bool(concept.recursive), extensions, passed_over=passed, unused=unused)
    if passed_over is not None:
        passed_over.extend(passed)
    if not files:
        hint = ""
        if passed:
            hint = f" Passed over: {short_list([f'{f} ({r})' for f, r in passed], 3)}."
        if not concept.recursive and find_images(folder, True):
            hint += f" Its sub-folders do hold images: turn on data.concepts.{index}.recursive."
        raise DataError(f"{key}: folder '{folder}' has no images ({' '.join(extensions)}).{hint} "
                        f"Add images, fix the path, or disable {label}.", key=key, value=str(concept.path))
    return folder, files


def control_folders(concept: Any, base: Path) -> List[Path]:
    """The concept's control folders (``control_paths``), resolved like its own path."""
    return [_resolve(p, base) for p in (getattr(concept, "control_paths", None) or []) if str(p).strip()]


def pair_key(path: Path, folder: Path) -> str:
    """How an image pairs with its controls: its path below its folder without the extension (``sub/cat_01``)."""
    rel = rel_path(path, folder)
    return rel[: -len(path.suffix)] if path.suffix else rel


@dataclass
class PairListing:
    """How a concept's images pair with the images of its control folders by name, with nothing refused:
    :func:`concept_controls` refuses on it, the page shows it (pairs side by side, every unpaired file named)."""
    folder: Path                            # the concept's folder
    targets: List[Path]                     # its images (those inside one of its control folders left out)
    control_folders: List[Path]
    found: List[Optional[Dict[str, Path]]]  # per control folder: its images by pair key; None: not a folder

    def pairs(self) -> List[Tuple[Path, Tuple[Path, ...]]]:
        """The targets that have a control in every folder, each with its controls in folder order."""
        out = []
        for target in self.targets:
            key = pair_key(target, self.folder)
            if all(found is not None and key in found for found in self.found):
                out.append((target, tuple(found[key] for found in self.found if found is not None)))
        return out

    def targets_without(self, k: int) -> List[str]:
        """The targets (relative to the concept's folder) with no image of their name in control folder ``k``
        (none listed when that folder does not exist: the folder is the problem)."""
        found = self.found[k]
        if found is None:
            return []
        return [rel_path(t, self.folder) for t in self.targets if pair_key(t, self.folder) not in found]

    def controls_without(self, k: int) -> List[str]:
        """The images of control folder ``k`` (relative to it) whose name no target has."""
        keys = {pair_key(t, self.folder) for t in self.targets}
        return [rel_path(p, self.control_folders[k]) for s, p in (self.found[k] or {}).items() if s not in keys]


def pair_listing(folder: Path, files: List[Path], controls: Sequence[Path], recursive: bool) -> PairListing:
    """Pair ``files`` (a concept's images in ``folder``) with the images of each control folder by name. A
    directory listing only; control folders inside the concept's folder hold controls, not targets."""
    inside = [c for c in controls if c != folder and folder in c.parents]
    targets = [f for f in files if not any(c in f.parents for c in inside)]
    found = [{pair_key(p, c): p for p in find_images(c, recursive)} if c.is_dir() else None for c in controls]
    return PairListing(folder=folder, targets=targets, control_folders=list(controls), found=found)


def concept_controls(index: int, concept: Any, folder: Path, files: List[Path], base: Path) -> Dict[Path, Tuple[Path, ...]]:
    """Each of ``files`` (the concept's images) with its control images, one from each control folder, paired by
    name (``cat_01.png`` ↔ ``<control folder>/cat_01.jpg``); {} when the concept has no control folders. Raises
    DataError naming the field, the folder and the files for a missing folder, an image without its control or
    a control without its image. A directory listing only: ``validate`` runs it too."""
    key = f"data.concepts.{index}.control_paths"
    label = concept_label(index, concept)
    folders = control_folders(concept, base)
    if not folders:
        return {}
    listing = pair_listing(folder, files, folders, bool(concept.recursive))
    for k, control in enumerate(folders):
        where = f"{key}.{k}"
        if listing.found[k] is None:
            raise DataError(f"{where}: control folder '{control}' of {label} does not exist"
                            + (" (it is a file)" if control.exists() else "")
                            + ". Give the folder of the images each target is made from (edit sources or references).",
                            key=where, value=str(control))
        missing = listing.targets_without(k)
        extra = listing.controls_without(k)
        if missing:
            raise DataError(f"{where}: {len(missing)} image(s) of {label} have no control image of the same name in "
                            f"'{control}' ({short_list(missing)}). Add them there (any image extension), or move "
                            "those images out of the concept.", key=where, value=str(control))
        if extra:
            raise DataError(f"{where}: {len(extra)} control image(s) in '{control}' pair with no image of {label} "
                            f"({short_list(extra)}): every control needs its target of the same name. Add the "
                            "targets or remove those controls.", key=where, value=str(control))
    return dict(listing.pairs())


def concept_caption_file(index: int, concept: Any, folder: Path, base: Path) -> Path:
    """The caption file of a ``caption_source: concept_file`` concept, or DataError naming the field."""
    key = f"data.concepts.{index}.caption_file"
    if not str(concept.caption_file or "").strip():
        raise DataError(f"{key} is empty: {concept_label(index, concept)} reads its captions from one text "
                        "file; name that file.", key=key)
    path = _resolve(concept.caption_file, base)
    if not path.is_file() and not Path(str(concept.caption_file)).is_absolute():
        path = folder / str(concept.caption_file)  # also accept a path relative to the concept folder
    if not path.is_file():
        raise DataError(f"{key}: caption file '{concept.caption_file}' was not found (looked in "
                        f"'{base}' and '{folder}'). Fix the path or use caption_source=txt.",
                        key=key, value=str(concept.caption_file))
    return path


def _scan_one(index: int, concept: Any, base: Path, warn: Warn, masks: bool = False,
              clips: bool = False, prober: Optional[Prober] = None) -> Tuple[List[ImageItem], ConceptReport]:
    prober = prober if prober is not None else Prober()
    key = f"data.concepts.{index}.path"
    label = concept_label(index, concept)
    passed: List[Tuple[str, str]] = []
    extensions = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS if clips else IMAGE_EXTENSIONS
    unused_files: List[str] = []  # listed in the same pass as the images
    folder, files = concept_folder(index, concept, base, passed, extensions, unused_files)
    prober.scanning(folder)
    # the concept's settings read once as plain values: an OmegaConf attribute read costs microseconds, per image
    source, caption_extension = str(concept.caption_source), str(concept.caption_extension)
    ext, loss_weight = caption_ext(caption_extension), float(concept.loss_weight)

    role = str(getattr(concept, "role", "train") or "train")
    controls = concept_controls(index, concept, folder, files, base)
    if controls:
        files = [f for f in files if f in controls]  # control folders inside the concept folder are not targets
    report = ConceptReport(index=index, name=str(concept.name or folder.name), path=str(folder),
                           repeats=float(concept.repeats), validation=role == "validation", role=role,
                           controls=[str(p) for p in control_folders(concept, base)],
                           resolution=str(getattr(concept, "resolution", "") or ""))
    report.images_found = len(files) + len(passed)
    for rel, why in passed:
        report.skipped.append((rel, why))
        warn(f"Skipping '{folder / rel}' ({label}): {why}.")
    report.unused_files = unused_files
    if report.unused_files:
        warn(f"{label}: {len(report.unused_files)} files are in a format Atelier does not train on and are "
             f"not used ({short_list(report.unused_files)}). Convert them to PNG or JPEG (for an animation, "
             "export the frames you want) to train on them.")
    shared_captions: Optional[List[str]] = None
    if source == "concept_file":
        shared_captions = _read_concept_file(index, concept, folder, base, warn)

    workers = max(1, min(8, (os.cpu_count() or 1), len(files)))
    control_files = sorted({c for pair in controls.values() for c in pair})
    with ThreadPoolExecutor(max_workers=workers) as pool:  # decoding releases the GIL
        checks = list(pool.map(lambda p: probe_clip(p) if p.suffix.lower() in VIDEO_EXTENSIONS else prober.probe(p),
                               files)) if clips else prober.probe_all(files, pool)
        control_problems = {c: chk[1] for c, chk in zip(control_files, prober.probe_all(control_files, pool))}

    items: List[ImageItem] = []
    missing: List[str] = []
    for path, (size, problem, *clip) in zip(files, checks):
        pair = controls.get(path, ()) if controls else ()
        bad_control = next((c for c in pair if control_problems.get(c)), None) if pair else None
        if problem is None and bad_control is not None:  # a pair trains whole or not at all
            problem = f"its control image '{bad_control}' cannot be used: {control_problems[bad_control]}"
        if problem is not None:
            report.skipped.append((rel_path(path, folder), problem))
            warn(f"Skipping '{path}' ({label}): {problem}. Re-save or remove the file.")
            continue
        if shared_captions is not None:
            captions = list(shared_captions)
        elif source == "filename":
            captions = [caption_from_filename(path)]
        else:
            captions = prober.captions(path, caption_extension, warn)
            if captions is None:
                missing.append(rel_path(path, folder))
                captions = [""]
            elif not captions:
                report.captions_empty += 1
                report.captions_empty_files.append(rel_path(path.with_name(path.stem + ext), folder))
                captions = [""]
        items.append(ImageItem(path=path, captions=captions, concept_index=index,
                               loss_weight=loss_weight, width=size[0], height=size[1],
                               validation=report.validation, role=role, controls=pair,
                               clip=clip[0] if clip else None))

    if masks:
        _attach_masks(items, folder, report, label, warn, prober)
    report.images_used = len(items)
    report.captions_missing = len(missing)
    if missing:
        warn(f"{label}: {len(missing)} of {report.images_found} images have no caption file "
             f"({short_list(missing)}); they train with an empty caption. Add <image name>{ext} next to "
             f"each image, or set data.concepts.{index}.caption_source to concept_file or filename.")
    if report.captions_empty:
        warn(f"{label}: {report.captions_empty} caption files are empty ({short_list(report.captions_empty_files)}); "
             "those images train with an empty caption. Write a caption into each, or delete them.")
    if not items:
        raise DataError(f"{key}: none of the {report.images_found} images in '{folder}' could be read "
                        f"({short_list([f'{f}: {r}' for f, r in report.skipped], 5)}). "
                        "Re-save them as PNG or JPEG, or fix the path.", key=key, value=str(concept.path))
    return items, report


def mask_path(image: Path) -> Path:
    """Where the mask of ``image`` lives: ``<stem>-masklabel.png`` in the same folder."""
    return image.with_name(image.stem + MASK_SUFFIX)


def _attach_masks(items: List[ImageItem], folder: Path, report: ConceptReport, label: str, warn: Warn,
                  prober: Prober) -> None:
    """Pair each image with its mask. A missing mask trains the whole image (all focus); an
    unreadable mask, or one whose shape differs from its image's, is reported and ignored; one
    with the image's aspect but another size is used, scaled to the image."""
    candidates = [mask_path(it.path) if it.clip is None else clip_mask(it.path, mask_path(it.path)) for it in items]
    present = [(it, m) for it, m in zip(items, candidates) if m.is_file()]
    workers = max(1, min(8, (os.cpu_count() or 1), len(present) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        checks = list(pool.map(lambda pair: probe_mask_clip(pair[1], pair[0].clip) if is_mask_clip(pair[1].name)
                               else prober.probe(pair[1]), present))
    by_item = {id(it): (m, chk) for (it, m), chk in zip(present, checks)}
    for item in items:
        rel = rel_path(item.path, folder)
        if id(item) not in by_item:
            report.masks_missing.append(rel)
            continue
        m, (size, problem) = by_item[id(item)]
        mrel = rel_path(m, folder)
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
        warn(f"{label}: {len(report.masks_blank)} masks are black everywhere ({short_list(report.masks_blank)}): "
             "nothing of those images is in focus, so they train only at loss.unmasked_weight. Paint the "
             "subject white, or delete the mask to train the whole image.")
    if report.masks_missing:
        warn(f"{label}: {len(report.masks_missing)} of {len(items)} images have no mask "
             f"({short_list(report.masks_missing)}); they train as if all of the image were in focus. "
             f"Add <image name>{MASK_SUFFIX} (white = focus) next to each image.")


def _read_concept_file(index: int, concept: Any, folder: Path, base: Path, warn: Warn) -> List[str]:
    key = f"data.concepts.{index}.caption_file"
    path = concept_caption_file(index, concept, folder, base)
    lines = caption_lines(read_text(path, warn))
    if not lines:
        raise DataError(f"{key}: caption file '{path}' has no caption. Write one caption a line.",
                        key=key, value=str(concept.caption_file))
    return lines


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def rel_path(path: Path, folder: Path) -> str:
    """``path`` relative to ``folder`` with ``/`` separators (``str(path)`` when it is not inside)."""
    p, f = str(path), str(folder)
    if len(p) > len(f) + 1 and p.startswith(f) and p[len(f)] == os.sep:  # the common case, without pathlib's parsing
        return p[len(f) + 1:].replace(os.sep, "/")
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return str(path)


def short_list(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
