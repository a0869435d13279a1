"""``python -m trainer data-report CONFIG``: what the trainer will do with the images, before any GPU time.

The report is built by the same code as training (``trainer.data.dataset.build_dataset``: scan,
buckets, epoch plan; the scan remembered between launches in the cache folder, ``trainer.data.scanindex``),
without torch: images per concept, caption coverage, the bucket histogram,
images in a bucket too small for the batch size (never trained: listed), images smaller than the
training size, duplicates, missing and unusable masks, skipped files and every warning; for a video family each
clip with the windows taken from it (start frame, frame count, bucket) or the reason it was skipped.
:func:`concept_pairs` lists each concept's role, control folders and pairs (the page shows them side by side).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Optional

from trainer.data.concepts import concept_controls, concept_folder, control_folders, pair_listing
from trainer.data.dataset import build_dataset
from trainer.data.scanindex import ScanIndex
from trainer.errors import ConfigError, DataError
from trainer.families import VideoSpec


def build_report(cfg: Any, base_dir: Optional[Path] = None, video: Optional[VideoSpec] = None,
                 index: Optional[ScanIndex] = None) -> dict:
    """Scan and plan (no model, no torch) and return the report as a dict with the warnings. ``video``: the
    family trains on clips (default: told from ``cfg.model`` as training does). ``index``: the remembered scan
    (default: the config's cache folder's; the page passes its own to show how far the check is)."""
    warnings: List[str] = []
    dataset = build_dataset(cfg, warn=warnings.append, base_dir=base_dir, video=video, index=index)
    out = dataset.report.to_dict()
    out["warnings"] = warnings
    return out


def concept_pairs(cfg: Any, base_dir: Optional[Path] = None) -> List[dict]:
    """Each enabled concept's role and control folders and, for a concept with controls, its pairs (a target with
    its control in every folder, paired by file name), every unpaired target or control named, and ``error``: the
    line ``validate`` gives for the concept's first problem ("" when none). Never raises (the page shows what it
    can of a broken dataset); directory listings only, no image is opened."""
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    out: List[dict] = []
    for index, concept in enumerate(cfg.data.concepts or []):
        if not concept.enabled:
            continue
        folders = control_folders(concept, base)
        entry: dict = {"index": index, "name": str(concept.name or ""), "path": str(concept.path or ""),
                       "role": str(getattr(concept, "role", "train") or "train"), "controls": [str(f) for f in folders],
                       "missing_folders": [], "pairs": [], "unpaired_targets": [], "unpaired_controls": [],
                       "error": ""}
        out.append(entry)
        try:
            folder, files = concept_folder(index, concept, base)
        except DataError as exc:
            entry["error"] = str(exc)
            continue
        try:
            concept_controls(index, concept, folder, files, base)
        except DataError as exc:
            entry["error"] = str(exc)
        if not folders:
            continue
        listing = pair_listing(folder, files, folders, bool(concept.recursive))
        entry["missing_folders"] = [str(f) for f, found in zip(folders, listing.found) if found is None]
        entry["pairs"] = [{"target": str(t), "controls": [str(c) for c in cs]} for t, cs in listing.pairs()]
        for k, control in enumerate(folders):
            entry["unpaired_targets"] += [{"file": name, "folder": str(control)} for name in listing.targets_without(k)]
            entry["unpaired_controls"] += [{"file": name, "folder": str(control)}
                                           for name in listing.controls_without(k)]
    return out


def format_report(rep: dict) -> str:
    """The report as plain text for a terminal."""
    lines: List[str] = []
    for c in rep.get("concepts", []):
        role = c.get("role") or ("validation" if c.get("validation") else "train")
        kind = f" [{role}]" if role != "train" else ""
        lines.append(f"concept {c.get('index')} {c.get('name') or ''}{kind} ({c.get('path')}): "
                     f"{c.get('images_used')} used / {c.get('images_found')} found, "
                     f"repeats {c.get('repeats', 1):g}, {c.get('images_per_epoch', 0):g} per epoch")
        lines.append(f"  captions: {100 * c.get('caption_coverage', 0):.0f}% have text "
                     f"({c.get('captions_missing', 0)} without caption file, {c.get('captions_empty', 0)} empty)")
        for k, folder in enumerate(c.get("controls", [])):
            lines.append(f"  control {k}: {folder} (paired with every image by name)")
        if c.get("masks_found") or c.get("masks_missing"):
            lines.append(f"  masks: {c.get('masks_found', 0)} found, {c.get('masks_missing', 0)} missing")
        for entry in c.get("skipped", []):
            lines.append(f"  skipped: {entry['file']}: {entry['reason']}")
        if c.get("skipped_not_listed"):
            lines.append(f"  skipped: … and {c['skipped_not_listed']} more")
        for entry in c.get("masks_bad", []):
            lines.append(f"  mask ignored: {entry['file']}: {entry['reason']}")
        for name in c.get("masks_blank", []):
            lines.append(f"  mask black everywhere (nothing in focus): {name}")
        for name in c.get("captions_empty_files", []):
            lines.append(f"  empty caption file: {name}")
        for name in c.get("unused_files", []):
            lines.append(f"  not used (format not trained on): {name}")
    lines += clip_lines(rep)
    bs = rep.get("batch_size")
    lines.append(f"resolutions: {', '.join(rep.get('resolutions', []))}; batch size {bs}; "
                 f"{rep.get('batches_per_epoch')} batches per epoch"
                 + (f" ({rep.get('leftover_per_epoch')} samples left over in epoch 1)"
                    if rep.get("leftover_per_epoch") else ""))
    if rep.get("buckets"):
        lines.append("buckets (size: images, samples per epoch):")
        for b in rep["buckets"]:
            flag = "" if b.get("trains") else f"   <- fewer than {bs}: never trains"
            lines.append(f"  {b['size']:>11}: {b['images']:5d} images, {b['per_epoch']:g}/epoch{flag}")
    for key, title in (("dropped", "never trained (bucket smaller than the batch)"),
                       ("masks_missing", "without mask")):
        if rep.get(f"{key}_count"):
            lines.append(f"{title}: {rep[f'{key}_count']}")
            lines += [f"  {p}" for p in rep[key]]
    if rep.get("small_images_count"):
        lines.append(f"smaller than the training size: {rep['small_images_count']}")
        lines += [f"  {s['file']} ({s['size']}, trains at {s['bucket']}, enlarged {s['upscale']:g}x)"
                  for s in rep["small_images"]]
    if rep.get("duplicates_count"):
        lines.append(f"identical files: {rep['duplicates_count']} groups")
        lines += ["  " + " = ".join(g) for g in rep["duplicates"]]
    for w in rep.get("warnings", []):
        lines.append(f"warning: {w}")
    lines.append(f"total: {rep.get('total_images')} images, {rep.get('total_skipped')} skipped, "
                 f"{rep.get('images_per_epoch', 0):g} samples per epoch")
    return "\n".join(lines)


def clip_lines(rep: dict) -> List[str]:
    """A video family's clips: each with its frames and rate, the windows taken (start frame at the model's rate,
    frame count, bucket), or why it was skipped."""
    lines: List[str] = []
    for c in rep.get("clips", []):
        head = f"clip {c['file']} (concept {c['concept']}): {c['clip']}"
        if c.get("skipped"):
            lines.append(f"{head}; skipped: {c['skipped']}")
            continue
        lines.append(f"{head}; {c['frames_at_fps']} frames at {c['fps']:g} fps"
                     + (f" ({c['note']})" if c.get("note") else ""))
        for w in c["windows"]:
            lines.append(f"  window: start {w['start']}, {w['count']} frames, bucket {w.get('bucket', '?')}")
    return lines


def print_report(cfg: Any, as_json: bool = False) -> int:
    try:
        rep = build_report(cfg)
    except ConfigError as exc:
        print(f"Data error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(rep, indent=1, default=str))
    else:
        print(format_report(rep))
    return 0
