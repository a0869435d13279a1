"""Which frames of a clip train: the extraction modes, frame-count buckets, and the dataset's clips cut into windows.

The settings and their names follow musubi-tuner's video datasets (``kohya-ss/musubi-tuner``,
``src/musubi_tuner/dataset/image_video_dataset.py`` at commit fc2e236d8ae9be14d209493eec2842f25123f621), made
per concept (musubi's are per dataset): ``target_frames`` (frame counts to take), ``frame_extraction``, and its
``frame_stride``, ``frame_sample`` and ``max_frames``. For a clip of ``n`` frames (after resampling to the model's
frame rate) and each target count ``t``:

- ``head``: the first ``t`` frames (clips shorter than ``t`` give none for it);
- ``chunk``: back-to-back windows ``0, t, 2t …`` while a whole one fits;
- ``slide``: windows starting every ``frame_stride`` frames while a whole one fits;
- ``uniform``: ``frame_sample`` windows with starts evenly spaced from 0 to ``n - t`` (``linspace``, truncated);
- ``full``: one window of all frames, at most ``max_frames`` (0 = the model's longest), rounded down to a count the
  VAE takes (``target_frames`` is not read).

Every clip is resampled to the family's frame rate by timestamps first (:func:`trainer.data.clips.resample`), so a
window's frames are the model's seconds, whatever rate the clip was recorded at. A window's bucket is its aspect
bucket (as an image gets: ``trainer.data.buckets``) with its frame count: ``(width, height, frames)``; a batch holds
one such bucket. An image in a video family is a one-frame clip. Standard library only (PyAV through ``clips``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from trainer.data.clips import VIDEO_EXTENSIONS, ClipInfo, Window, describe, resample
from trainer.data.concepts import IMAGE_EXTENSIONS, ConceptReport, DataReport, ImageItem, concept_label, rel_path
from trainer.errors import ConfigError
from trainer.families import VideoSpec, info_for
from trainer.families.checks import family_without_loading

EXTRACTION_MODES = ("head", "chunk", "slide", "uniform", "full")
# the settings only a video family reads (the page shows them for one): a concept's, and the data section's
CONCEPT_CLIP_SETTINGS = ("target_frames", "frame_extraction", "frame_stride", "frame_sample", "max_frames")
DATA_CLIP_SETTINGS = ("data.variable_frame_rate",)
# A GIF in an image family's concept stays a file it does not train on (listed, as it always was); these make a
# concept a clip concept there, which is refused.
_CLIP_ONLY = tuple(e for e in VIDEO_EXTENSIONS if e != ".gif")

Warn = Callable[[str], None]


def parse_frames(text: object) -> List[int]:
    """``"33"`` → ``[33]``, ``"17, 33"`` → ``[17, 33]`` (order kept, duplicates dropped); ValueError otherwise."""
    out: List[int] = []
    for part in str(text if text is not None else "").split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"'{part}' is not a frame count: write whole numbers such as 33 or 17,33")
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise ValueError("no frame count given: write one such as 33, or a comma list such as 17,33")
    return out


def windows(n: int, concept: Any, spec: VideoSpec) -> List[Tuple[int, int]]:
    """``(start, count)`` of every window of an ``n``-frame clip under the concept's extraction settings (see the
    module docstring), in musubi's order (by target count, then start)."""
    mode = str(getattr(concept, "frame_extraction", "head") or "head")
    if mode == "full":
        longest = int(getattr(concept, "max_frames", 0) or 0) or spec.max_frames
        count = min(n, longest)
        count = (count - 1) // spec.frame_multiple * spec.frame_multiple + 1 if count >= 1 else 0
        return [(0, count)] if count >= 1 else []
    out: List[Tuple[int, int]] = []
    stride = max(1, int(getattr(concept, "frame_stride", 1) or 1))
    sample = max(1, int(getattr(concept, "frame_sample", 1) or 1))
    for t in parse_frames(getattr(concept, "target_frames", "33")):
        if n < t:
            continue
        if mode == "head":
            out.append((0, t))
        elif mode == "chunk":
            out += [(i, t) for i in range(0, n - t + 1, t)]
        elif mode == "slide":
            out += [(i, t) for i in range(0, n - t + 1, stride)]
        elif mode == "uniform":
            last = n - t
            starts = [int(last * k / (sample - 1)) if sample > 1 else 0 for k in range(sample)]
            out += [(s, t) for s in starts]
        else:
            raise ValueError(f"frame_extraction {mode!r} is not one of {', '.join(EXTRACTION_MODES)}")
    return out


def smallest_window(concept: Any, spec: VideoSpec) -> int:
    """The fewest frames a clip of the concept needs to give a window."""
    if str(getattr(concept, "frame_extraction", "head")) == "full":
        return 1
    return min(parse_frames(getattr(concept, "target_frames", "33")))


# --------------------------------------------------------------------------------------------
# the family, and the checks validate runs
# --------------------------------------------------------------------------------------------

def video_spec(cfg: Any) -> Optional[VideoSpec]:
    """The VideoSpec of the run's family when it can be told without loading weights (``model.family``, a
    ``builtin:`` model, a folder's configs, a file's header); None for an image family or an unknown one."""
    model = getattr(cfg, "model", None)
    if model is None:
        return None
    general = getattr(cfg, "general", None)
    workspace = str(getattr(general, "workspace", "") or "") if general is not None else ""
    variant = family_without_loading(model, workspace)
    if not variant:
        return None
    try:
        return info_for(variant).video_for(variant)
    except KeyError:
        return None


def family_label(cfg: Any) -> Optional[str]:
    """The label of the run's family when it can be told without loading weights, else None."""
    model = getattr(cfg, "model", None)
    variant = family_without_loading(model, "") if model is not None else None
    try:
        return info_for(variant).label if variant else None
    except KeyError:
        return None


def concept_extensions(spec: Optional[VideoSpec]) -> Tuple[str, ...]:
    """The files a concept folder trains on: images, and clips for a video family."""
    return IMAGE_EXTENSIONS + VIDEO_EXTENSIONS if spec is not None else IMAGE_EXTENSIONS


def clip_files(folder: Path, recursive: bool, extensions: Tuple[str, ...] = _CLIP_ONLY) -> List[str]:
    """Clip files in a concept folder (a directory listing, relative names, sorted)."""
    found: List[str] = []
    if not folder.is_dir():
        return found
    walker = os.walk(folder) if recursive else [(str(folder), [], os.listdir(folder))]
    for root, _dirs, names in walker:
        found += [rel_path(Path(root) / n, folder) for n in names
                  if not n.startswith(".") and n.lower().endswith(extensions)]
    return sorted(found)


def check_clip_settings(cfg: Any, base: Optional[Path] = None) -> None:
    """``validate``'s clip rules, ConfigError naming the field: every concept's frame counts parse and are counts
    the family's VAE takes (``4k+1`` for Wan), its extraction mode is known; and an image family gets no concept
    folder of clips. An unknown family (a hub id with ``model.family: auto``) is checked when it loads."""
    spec = video_spec(cfg)
    base = Path(base) if base is not None else Path.cwd()
    for i, c in enumerate(cfg.data.concepts or []):
        if not c.enabled:
            continue
        key = f"data.concepts.{i}.target_frames"
        try:
            counts = parse_frames(getattr(c, "target_frames", "33"))
        except ValueError as exc:
            raise ConfigError(f"'{key}' = {c.target_frames!r} is not allowed: {exc}.", key=key,
                              value=c.target_frames) from None
        if spec is not None:
            bad = [n for n in counts if not spec.fits(n)]
            if bad and str(getattr(c, "frame_extraction", "head")) != "full":
                m = spec.frame_multiple
                near = sorted({max(1, (bad[0] - 1) // m * m + 1), (bad[0] - 1) // m * m + 1 + m})
                raise ConfigError(f"'{key}' = {c.target_frames!r}: {bad[0]} frames is not a count the VAE takes "
                                  f"({m}k+1: 1, {1 + m}, {1 + 2 * m} … {spec.max_frames}); use "
                                  f"{' or '.join(str(n) for n in near)}.", key=key, value=c.target_frames)
        if spec is None and str(c.path or "").strip():
            folder = Path(os.path.expanduser(str(c.path)))
            folder = folder if folder.is_absolute() else base / folder
            clips = clip_files(folder, bool(c.recursive))
            label = family_label(cfg)
            if clips and label:
                raise ConfigError(f"data.concepts.{i}.path: '{folder}' holds clips ({', '.join(clips[:3])}"
                                  f"{' …' if len(clips) > 3 else ''}) but {label} trains on images only; pick a "
                                  "video family (Wan) or move the clips out.", key=f"data.concepts.{i}.path",
                                  value=str(c.path))


# --------------------------------------------------------------------------------------------
# the dataset's clips cut into windows
# --------------------------------------------------------------------------------------------

def cut_windows(items: List[ImageItem], report: DataReport, data_cfg: Any, spec: VideoSpec,
                warn: Warn) -> List[ImageItem]:
    """Each clip item as one item per window (its ``window`` set: start and count at the family's rate and the clip
    frames they are), images as one-frame windows. A clip that gives no window is skipped with the reason in its
    concept's report (shorter than the smallest bucket; a variable frame rate with
    ``data.variable_frame_rate: skip``); ``report.clips`` lists every clip with its windows (bucket added later)."""
    concepts = list(data_cfg.concepts)
    by_concept = {c.index: c for c in report.concepts}
    vfr_skip = str(getattr(data_cfg, "variable_frame_rate", "resample")) == "skip"
    out: List[ImageItem] = []
    for item in items:
        clip: Optional[ClipInfo] = item.clip
        if clip is None:
            out.append(replace(item, window=Window(0, 1, spec.fps, (0,))))
            continue
        crep: ConceptReport = by_concept[item.concept_index]
        concept = concepts[item.concept_index]
        rel = rel_path(item.path, Path(crep.path))
        reason = None
        if clip.variable and vfr_skip:
            reason = (f"variable frame rate ({describe(clip)}); skipped as data.variable_frame_rate = skip "
                      "(resample would take its frames by timestamp)")
        sources = resample(clip, spec.fps) if reason is None else []
        cuts = windows(len(sources), concept, spec) if reason is None else []
        if reason is None and not cuts:
            need = smallest_window(concept, spec)
            reason = (f"too short: {describe(clip)} are {len(sources)} frames at the model's {spec.fps:g} fps, "
                      f"fewer than the smallest bucket of {need} frames "
                      f"(data.concepts.{item.concept_index}.target_frames)")
        entry = {"file": rel, "concept": item.concept_index, "clip": describe(clip), "frames_at_fps": len(sources),
                 "fps": spec.fps, "variable": clip.variable, "windows": []}
        if reason is not None:
            crep.skipped.append((rel, reason))
            crep.images_used -= 1
            warn(f"Skipping clip '{item.path}' ({concept_label(item.concept_index, concept)}): {reason}.")
            entry["skipped"] = reason
        elif clip.variable:
            entry["note"] = "variable frame rate: resampled by timestamps"
        report.clips.append(entry)
        for start, count in cuts:
            window = Window(start, count, spec.fps, tuple(sources[start:start + count]))
            out.append(replace(item, window=window))
            entry["windows"].append({"start": start, "count": count})
    return out


__all__ = ["EXTRACTION_MODES", "parse_frames", "windows", "smallest_window", "video_spec", "concept_extensions",
           "clip_files", "check_clip_settings", "cut_windows"]
