"""The dataset as the trainer will see it: scanned concepts + buckets + epoch plans + the report.

Standard library and Pillow only (no torch): ``python -m trainer data-report`` and the web UI build
exactly what training builds, in a fraction of a second, and show which images a bucket too small
for the batch size would silently drop, which are smaller than the training size, which are
duplicates and which masks are missing.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from trainer.data.buckets import (
    PlannedBatch,
    Size,
    assign_bucket,
    bucket_populations,
    cover_scale,
    format_size,
    generate_buckets,
    nearest_bucket,
    parse_resolution,
    plan_epoch,
    snap,
)
from trainer.data.concepts import DataReport, ImageItem, concept_label, rel_path, scan_concepts, short_list
from trainer.data.frames import cut_windows, video_spec
from trainer.data.order import concept_repeats, epoch_order, item_repeats
from trainer.data.scanindex import ScanIndex, hashes, index_for
from trainer.errors import DataError
from trainer.families import VideoSpec

Warn = Callable[[str], None]


@dataclass
class Dataset:
    """Training and validation items with their buckets; :meth:`plan` gives an epoch's batches."""
    items: List[ImageItem]                   # trained on
    buckets: List[List[Size]]                # per training item: its bucket at each of its resolutions
    repeats: List[float]
    validation: List[ImageItem]
    validation_buckets: List[Size]           # per validation item: its bucket at its first resolution
    populations: Dict[Size, float]
    report: DataReport
    batch_size: int
    seed: int
    _plans: Dict[int, Tuple[List[PlannedBatch], List[Tuple[int, int]]]] = field(default_factory=dict)

    def plan(self, epoch: int) -> Tuple[List[PlannedBatch], List[Tuple[int, int]]]:
        """``(batches, leftovers)`` of an epoch; a pure function of (seed, epoch), memoised."""
        if epoch not in self._plans:
            order = epoch_order(self.items, self.repeats, epoch, self.seed)
            if len(self._plans) >= 4:
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = plan_epoch(order, self.buckets, self.batch_size, self.seed, epoch,
                                            self.populations)
        return self._plans[epoch]


def resolution_targets(data_cfg: Any, concept: Any) -> List[Size]:
    """The concept's resolutions: its own ``resolution`` when set, else ``data.resolution``."""
    own = str(getattr(concept, "resolution", "") or "").strip()
    return parse_resolution(own or data_cfg.resolution)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off for a bulk build (also a decorator), back on after when it was on.

    Why: a scan makes a few objects per image (the index's entries, items, paths), none in a cycle, and the
    collector's full passes over a heap that keeps growing cost a third of a 50k-image relaunch; reference
    counting frees what the build drops, and the next collection after it finds any cycle it left."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@gc_paused()
def build_dataset(cfg: Any, warn: Warn, base_dir: Optional[Path] = None,
                  find_duplicates: bool = True, video: Optional[VideoSpec] = None,
                  index: Optional[ScanIndex] = None) -> Dataset:
    """Scan, bucket and plan. ``cfg`` is the whole run config (``data``, ``training.batch_size``,
    ``general.seed``). Raises :class:`DataError` for a concept with no usable image or a run with
    no training concept; everything else is a warning (also listed in ``report.warnings``).

    ``video``: the family trains on clips (default: the VideoSpec of ``cfg.model``'s family when it can be told
    without loading it). Concept folders then hold clips and images; each clip is cut into windows
    (``trainer.data.frames``) and every item's buckets are ``(width, height, frames)``.

    ``index``: the remembered scan (default: the one in the config's cache folder, ``trainer.data.scanindex``):
    only new and changed files are probed and hashed, and what they gave is saved for the next launch."""
    d = cfg.data
    batch_size = int(cfg.training.batch_size)
    seed = int(cfg.general.seed)
    video = video if video is not None else video_spec(cfg)
    scans = index if index is not None else index_for(cfg)
    items, report = scan_concepts(d, warn=lambda m: None, base_dir=base_dir, clips=video is not None, prober=scans)
    scans.save()  # what was probed is kept even when the plan below refuses the dataset
    for message in report.warnings:  # scan_concepts' warnings, forwarded once
        warn(message)

    def _warn(message: str) -> None:
        report.warnings.append(message)
        warn(message)

    if video is not None:
        items = cut_windows(items, report, d, video, _warn)

    step = int(getattr(d, "bucket_step", 64) or 64)
    max_aspect = float(getattr(d, "max_aspect_ratio", 2.0) or 2.0)
    max_upscale = float(getattr(d, "max_upscale", 0.0) or 0.0)
    use_buckets = bool(getattr(d, "aspect_buckets", True))
    concepts = list(d.concepts)
    bucket_lists: Dict[Size, List[Size]] = {}

    def buckets_for(target: Size) -> List[Size]:
        if target not in bucket_lists:
            bucket_lists[target] = generate_buckets(target, step, max_aspect) if use_buckets else \
                [(snap(target[0], step), snap(target[1], step))]
        return bucket_lists[target]

    all_targets: List[Size] = []
    kept: List[ImageItem] = []
    kept_buckets: List[List[Size]] = []
    by_concept = {c.index: c for c in report.concepts}
    too_small: Dict[int, List[str]] = {}
    small_clips: set = set()
    concept_targets = {c.index: resolution_targets(d, concepts[c.index]) for c in report.concepts}  # read once
    shapes: Dict[Any, Tuple[List[Optional[Size]], Size, Size]] = {}
    for item in items:
        targets = concept_targets[item.concept_index]
        for t in targets:
            if t not in all_targets:
                all_targets.append(t)
        shape = (item.width, item.height, targets[0] if len(targets) == 1 else tuple(targets))
        if shape not in shapes:  # images of one size in one concept bucket alike: worked out once
            largest = max(targets, key=lambda t: t[0] * t[1])
            shapes[shape] = ([assign_bucket(item.width, item.height, buckets_for(t), step, max_upscale)
                              for t in targets], largest, nearest_bucket(item.width, item.height, buckets_for(largest)))
        options, largest, full = shapes[shape]
        usable = [b for b in options if b is not None]
        crep = by_concept[item.concept_index]
        if not usable:
            reason = (f"too small ({item.width}x{item.height}): even a {step}x{step} bucket would enlarge it "
                      f"more than data.max_upscale = {max_upscale:g}x")
            if item.path not in small_clips:  # a clip's windows: named once
                small_clips.add(item.path)
                crep.skipped.append((rel_path(item.path, Path(crep.path)), reason))
                crep.images_used -= 1
                too_small.setdefault(item.concept_index, []).append(item.path.name)
            continue
        need = cover_scale(item.width, item.height, full)
        if need > 1.0 + 1e-9 and not any(s["file"] == str(item.path) for s in report.small_images[-1:]):  # a clip once
            chosen = usable[targets.index(largest)] if options[targets.index(largest)] is not None else usable[0]
            report.small_images.append({"file": str(item.path), "size": f"{item.width}x{item.height}",
                                        "bucket": format_size(chosen),
                                        "upscale": round(cover_scale(item.width, item.height, chosen), 3),
                                        "training_size": format_size(full)})
        kept.append(item)
        kept_buckets.append([(w, h, item.window.count) for w, h in usable] if item.window is not None else usable)
    for index, names in too_small.items():
        _warn(f"Skipping {len(names)} image(s) of {concept_label(index, concepts[index])} that are too small "
              f"to train ({short_list(names)}): raise data.max_upscale (0 = no limit) or use larger images.")
    for crep in report.concepts:
        if crep.images_used <= 0:
            key = f"data.concepts.{crep.index}.path"
            raise DataError(f"{key}: none of the {crep.images_found} images in '{crep.path}' is usable "
                            f"({short_list([f'{f}: {r}' for f, r in crep.skipped], 5)}).", key=key)
    report.resolutions = [format_size(t) for t in all_targets]
    if video is not None:
        _clip_buckets(report, kept, kept_buckets)
    report.batch_size = batch_size

    train_idx = [i for i, it in enumerate(kept) if not it.validation]
    val_idx = [i for i, it in enumerate(kept) if it.validation]
    if not train_idx:
        raise DataError("Every enabled concept is a validation concept: set data.concepts.N.role to train (or "
                        "regularisation) for at least one concept to train on.", key="data.concepts")
    train = [kept[i] for i in train_idx]
    train_buckets = [kept_buckets[i] for i in train_idx]
    repeats = item_repeats(train, d)
    counts: Dict[int, int] = {}
    for it in train:
        counts[it.concept_index] = counts.get(it.concept_index, 0) + 1
    for crep in report.concepts:
        if not crep.validation:
            crep.repeats = concept_repeats(concepts[crep.index], counts.get(crep.index, 0))

    populations = bucket_populations(train_buckets, repeats)
    _bucket_report(report, train, train_buckets, populations, batch_size, _warn)
    if find_duplicates:
        _duplicates(report, kept, _warn, scans)
    scans.save()

    dataset = Dataset(items=train, buckets=train_buckets, repeats=repeats,
                      validation=[kept[i] for i in val_idx],
                      validation_buckets=[kept_buckets[i][0] for i in val_idx],
                      populations=populations, report=report, batch_size=batch_size, seed=seed)
    batches, leftovers = dataset.plan(0)
    report.batches_per_epoch = len(batches)
    report.leftover_per_epoch = len(leftovers)
    if not batches:
        _warn(f"No bucket holds enough images for one batch of {batch_size}: nothing would train. "
              "Lower training.batch_size, raise repeats, or turn off data.aspect_buckets.")
    return dataset


def _bucket_report(report: DataReport, items: Sequence[ImageItem], buckets: Sequence[Sequence[Size]],
                   populations: Dict[Size, float], batch_size: int, warn: Warn) -> None:
    images: Dict[Size, int] = {}
    for options in buckets:
        for b in set(options):
            images[b] = images.get(b, 0) + 1
    report.buckets = [{"size": format_size(b), "images": images[b], "per_epoch": round(populations[b], 3),
                       "trains": populations[b] >= batch_size}
                      for b in sorted(images, key=lambda s: (s[0] * s[1], s[0] / s[1], tuple(s[2:])))]
    dropped = [str(it.path) for it, options in zip(items, buckets)
               if all(populations[b] < batch_size for b in options)]
    report.dropped = dropped
    if dropped:
        small = sorted({format_size(b) for options in buckets for b in options if populations[b] < batch_size})
        warn(f"{len(dropped)} image(s) are in aspect buckets with fewer samples per epoch than the batch size "
             f"({batch_size}) and will never train: {short_list([Path(p).name for p in dropped], 10)} "
             f"(buckets {', '.join(small[:8])}{' …' if len(small) > 8 else ''}). Lower training.batch_size, "
             "add images of similar shape, raise the concept's repeats, or crop them to a common shape.")


def _clip_buckets(report: DataReport, items: Sequence[ImageItem], buckets: Sequence[Sequence[Size]]) -> None:
    """Each window in the report's clip list with its bucket (``WxHxF``, at its first resolution)."""
    windows: Dict[Tuple[str, int, int], Size] = {}
    for item, options in zip(items, buckets):
        if item.clip is not None and item.window is not None:
            windows[(str(item.path), item.window.start, item.window.count)] = options[0]
    for entry in report.clips:
        crep = next(c for c in report.concepts if c.index == entry["concept"])
        path = str(Path(crep.path) / entry["file"])
        for w in entry["windows"]:
            bucket = windows.get((path, w["start"], w["count"]))
            w["bucket"] = format_size(bucket) if bucket else "too small to bucket"


def _duplicates(report: DataReport, items: Sequence[ImageItem], warn: Warn, index: ScanIndex) -> None:
    """Files of identical content, found by their sha256 (remembered in the scan index for unchanged files)."""
    paths = sorted({str(it.path) for it in items})  # strings: pathlib's hashing and ordering are slow at 50k
    digests = hashes(index, paths, min(8, os.cpu_count() or 1))
    groups: Dict[str, List[str]] = {}
    for path, digest in zip(paths, digests):
        if digest:
            groups.setdefault(digest, []).append(path)
    report.duplicates = [g for g in groups.values() if len(g) > 1]
    if report.duplicates:
        shown = "; ".join(" = ".join(Path(p).name for p in g) for g in report.duplicates[:5])
        more = f" and {len(report.duplicates) - 5} more groups" if len(report.duplicates) > 5 else ""
        warn(f"{len(report.duplicates)} group(s) of identical images ({shown}{more}): each copy trains as "
             "a separate image. Remove the copies unless the extra weight is intended.")


__all__ = ["Dataset", "build_dataset", "gc_paused", "resolution_targets"]
