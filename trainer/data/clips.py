"""Video clips as training data: probe a clip (frames, frame rate, size, whether the rate varies, whether it decodes),
map the model's frame rate onto the clip's frames by their timestamps, and decode only the frames a window needs.

Decoding is PyAV's (FFmpeg's demuxers and decoders through their C API): it iterates a clip frame by frame with each
frame's exact presentation timestamp (pts), seeks to the keyframe before a window that starts late, and runs in this
process (no ``ffmpeg`` subprocess to find, start and parse). The alternatives fall short here: decord's wheels are
unmaintained (none for current Python versions), torchvision.io's video API is deprecated and pulls torch into the
torch-free dataset report, and OpenCV's ``CAP_PROP_POS_MSEC`` is an estimate from the average rate, so a variable
frame rate clip (phone recordings, screen captures, GIFs) would be resampled at the wrong frames.

Standard library, NumPy and PyAV; ``av`` is imported inside the functions that read a clip, so a dataset of images
(every image family's data report and ``validate``) never pays its import. No torch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from trainer.errors import DataError

# What a concept folder of a video family may hold besides images; GIFs are clips there (an image family lists them
# as files it does not train on, as before).
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif", ".mkv", ".avi")
_VFR_TOLERANCE = 0.005  # a pts step more than this fraction (plus one tick) off the median makes the rate variable


@dataclass(frozen=True)
class ClipInfo:
    """What probing a clip found. ``pts`` are the frames' presentation timestamps in display order (units of
    ``time_base`` seconds); ``problem`` says why the clip cannot be used (then the rest may be empty)."""
    frames: int = 0
    fps: float = 0.0            # the clip's average frame rate
    duration: float = 0.0       # seconds, from the first frame's start to the last frame's end
    width: int = 0
    height: int = 0
    variable: bool = False      # its pts steps differ: a variable frame rate
    pts: Tuple[int, ...] = ()
    time_base: Fraction = Fraction(1, 1)
    problem: Optional[str] = None

    @property
    def times(self) -> List[float]:
        """Each frame's start in seconds from the first frame."""
        if not self.pts:
            return []
        first = self.pts[0]
        return [float((p - first) * self.time_base) for p in self.pts]


@dataclass(frozen=True)
class Window:
    """Frames ``start .. start + count - 1`` of a clip resampled to ``fps`` (an image is ``Window(0, 1)``), and the
    clip frames they are (``sources``: one clip frame index per resampled frame, repeats and gaps included)."""
    start: int
    count: int
    fps: float = 0.0
    sources: Tuple[int, ...] = field(default=(), compare=False)

    def tag(self) -> str:
        """What the latent cache keys a window by: its place, its length and the rate it was taken at."""
        return f"frames:{self.start}+{self.count}@{self.fps:g}"


def is_clip(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS


def probe_clip(path: Path) -> Tuple[Tuple[int, int], Optional[str], ClipInfo]:
    """``((width, height), problem, info)`` of a clip, the shape :func:`trainer.data.probe.probe_image` gives plus
    the clip's :class:`ClipInfo`. Reads every packet's timestamp (no decoding) and decodes the first frame, so a
    file that demuxes but does not decode is named here, not at caching."""
    import av  # inside: only a folder with clips pays the import (see the module docstring)

    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return (0, 0), "zero-length: the file is empty (0 bytes)", ClipInfo(problem="zero-length")
        with av.open(str(path)) as container:
            if not container.streams.video:
                return (0, 0), "unreadable: it holds no video stream", ClipInfo(problem="no video stream")
            stream = container.streams.video[0]
            pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size)
            if not pts:
                return (0, 0), "zero-length: the clip has no frames", ClipInfo(problem="zero-length")
            container.seek(pts[0], stream=stream, backward=True, any_frame=False)
            first = next(container.decode(stream), None)
            if first is None:
                return (0, 0), "unreadable: no frame decodes", ClipInfo(problem="unreadable")
            width, height = first.width, first.height
            time_base = stream.time_base or Fraction(1, 1)
            rate = stream.average_rate or stream.guessed_rate
    except (av.FFmpegError, OSError, ValueError, StopIteration) as exc:
        return (0, 0), f"unreadable: not a video PyAV can decode ({exc})", ClipInfo(problem="unreadable")
    if width <= 0 or height <= 0:
        return (0, 0), f"unreadable: frames have no pixels ({width}x{height})", ClipInfo(problem="unreadable")
    steps = [b - a for a, b in zip(pts, pts[1:])]
    median = sorted(steps)[len(steps) // 2] if steps else 0
    variable = any(abs(s - median) > 1 + _VFR_TOLERANCE * median for s in steps)
    last = median if median else (int(1 / (float(rate) * time_base)) if rate else 0)
    duration = float((pts[-1] - pts[0] + last) * time_base)
    fps = float(rate) if rate and not variable else (len(pts) / duration if duration > 0 else 0.0)
    info = ClipInfo(frames=len(pts), fps=fps, duration=duration, width=width, height=height, variable=variable,
                    pts=tuple(pts), time_base=Fraction(time_base), problem=None)
    return (width, height), None, info


def resample(info: ClipInfo, fps: float) -> List[int]:
    """The clip frame shown at each tick of ``fps``: for frame ``k`` at time ``k / fps`` the last clip frame whose
    pts is not later (frames are dropped when the clip is faster, repeated when it is slower; a variable rate
    clip is resampled by its real timestamps). As many frames as fit in the clip's duration, at least one."""
    times = info.times
    if not times:
        return []
    count = max(1, int(math.floor(info.duration * fps + 1e-6)))
    out: List[int] = []
    for k in range(count):
        j = bisect.bisect_right(times, k / fps + 1e-6) - 1
        out.append(max(0, j))
    return out


@dataclass
class DecodeStats:
    """What :func:`read_frames` did, for tests and logs: frames decoded, frames kept and the most held at once."""
    decoded: int = 0
    kept: int = 0
    held_peak: int = 0
    seeks: int = 0


def read_frames(path: Path, info: ClipInfo, indices: Sequence[int],
                stats: Optional[DecodeStats] = None) -> List[np.ndarray]:
    """The clip frames ``indices`` (clip frame numbers, repeats allowed) as RGB uint8 arrays [H, W, 3], in that
    order. Only the distinct wanted frames are converted and held; decoding starts at the keyframe before the first
    wanted frame (a seek, when it is not the first) and stops after the last, so a window of a long clip never holds
    more than its own frames. Raises DataError naming the file when a wanted frame does not decode."""
    import av  # inside: only a folder with clips pays the import (see the module docstring)

    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        return []
    by_pts = {p: i for i, p in enumerate(info.pts)}
    held: Dict[int, np.ndarray] = {}
    stats = stats if stats is not None else DecodeStats()
    first, last = wanted[0], wanted[-1]
    want = set(wanted)
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if first > 0:
                container.seek(info.pts[first], stream=stream, backward=True, any_frame=False)
                stats.seeks += 1
            else:
                container.seek(info.pts[0], stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                stats.decoded += 1
                index = by_pts.get(frame.pts)
                if index is None:  # no pts, or one the demuxer did not list: not a frame a window can name
                    continue
                if index in want and index not in held:
                    held[index] = frame.to_ndarray(format="rgb24")
                    stats.kept += 1
                    stats.held_peak = max(stats.held_peak, len(held))
                if index >= last:
                    break
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise DataError(f"Could not decode clip '{path}' ({exc}). Re-encode it (H.264 MP4) or remove it.",
                        value=str(path)) from None
    missing = [i for i in wanted if i not in held]
    if missing:
        raise DataError(f"Clip '{path}': frames {missing[:5]} of {info.frames} did not decode (a damaged file, or "
                        "it changed since it was scanned). Re-encode it (H.264 MP4) or remove it.",
                        value=str(path))
    return [held[i] for i in indices]


def clip_mask(clip: Path, image_mask: Path) -> Path:
    """A clip's mask: its mask image (``<stem>-masklabel.png``, for every frame) when there, else a mask clip
    ``<stem>-masklabel.<clip extension>`` (white = focus, frame by frame); ``image_mask`` when neither is."""
    if image_mask.is_file():
        return image_mask
    for ext in VIDEO_EXTENSIONS:
        candidate = clip.with_name(clip.stem + "-masklabel" + ext)
        if candidate.is_file():
            return candidate
    return image_mask


def is_mask_clip(name: str) -> bool:
    """``walk-masklabel.mp4``: a clip's mask, never a training clip."""
    low = name.lower()
    return "-masklabel." in low and low.endswith(VIDEO_EXTENSIONS)


def probe_mask_clip(path: Path, info: ClipInfo) -> Tuple[Tuple[int, int], Optional[str]]:
    """A mask clip's size, or why it cannot mask ``info``'s clip (unreadable, or another number of frames)."""
    size, problem, mask = probe_clip(path)
    if problem is None and mask.frames != info.frames:
        problem = f"its {mask.frames} frames do not match the clip's {info.frames}"
    return size, problem


def describe(info: ClipInfo) -> str:
    """One line about a clip for the dataset report: frames, rate, length, size."""
    rate = "variable" if info.variable else f"{info.fps:g}"
    return f"{info.frames} frames at {rate} fps ({info.duration:.2f} s, {info.width}x{info.height})"


__all__ = ["VIDEO_EXTENSIONS", "ClipInfo", "Window", "DecodeStats", "is_clip", "probe_clip", "resample",
           "read_frames", "clip_mask", "is_mask_clip", "probe_mask_clip", "describe"]
