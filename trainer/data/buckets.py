"""Resolutions, aspect-ratio buckets and the batches of an epoch (standard library only).

- A *resolution* setting is one value (``512``), a ``WxH`` (``768x512``) or a comma list
  (``384,448,512``); each entry is a pixel budget ``W*H`` (:func:`parse_resolution`).
- For each budget, :func:`generate_buckets` lists the sizes whose sides are multiples of the model's
  step (64 for SD) and whose area is at most the budget, within a maximum aspect ratio. An image goes
  to the bucket nearest its aspect ratio (:func:`assign_bucket`); an image that would have to be
  enlarged more than ``max_upscale`` gets a proportionally smaller bucket instead, or is reported
  too small when not even one step × one step fits.
- :func:`plan_epoch` turns an epoch's shuffled sample order into batches whose images all share one
  bucket. With several resolutions, each new batch picks its resolution at random (seeded by
  (seed, epoch)); later samples join an open batch of the same size, so multi-resolution training
  does not split small buckets more than it must. A batch that does not fill by the end of the epoch
  is dropped (its images come back in other epochs, in other company); an image whose bucket holds
  fewer samples per epoch than the batch size never trains, which :func:`bucket_populations` lets
  the dataset report say up front.

diffusers has ``training_utils.generate_aspect_ratio_buckets``, but importing it pulls torch and
diffusers into the data report (seconds instead of milliseconds), and its nearest-bucket metric is
not scale-invariant; the twenty lines here are the cheaper path.
"""

from __future__ import annotations

import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trainer.data.order import seed_int
from trainer.errors import ConfigError

Size = Tuple[int, int]  # (width, height)

_ENTRY = re.compile(r"^\s*(\d+)\s*(?:[x×*]\s*(\d+))?\s*$", re.IGNORECASE)
MIN_SIDE, MAX_SIDE = 64, 8192


def parse_resolution(text: object, min_side: int = MIN_SIDE, max_side: int = MAX_SIDE) -> List[Size]:
    """``'512'`` → ``[(512, 512)]``, ``'768x512'`` → ``[(768, 512)]``, ``'384, 512x640'`` → both.

    Raises ``ValueError`` with a message a user can act on. Order is kept; duplicates are removed.
    """
    raw = str(text if text is not None else "").strip()
    if not raw:
        raise ValueError("the resolution is empty: give a size such as 512, 768x512 or 384,448,512")
    out: List[Size] = []
    for part in raw.split(","):
        m = _ENTRY.match(part)
        if not m:
            raise ValueError(f"'{part.strip()}' is not a size: write 512, 768x512 or a comma list "
                             "such as 384,448,512")
        w = int(m.group(1))
        h = int(m.group(2)) if m.group(2) else w
        for side in (w, h):
            if not min_side <= side <= max_side:
                raise ValueError(f"'{part.strip()}': sides must be between {min_side} and {max_side} pixels")
        if (w, h) not in out:
            out.append((w, h))
    return out


def format_size(size: Tuple[int, ...]) -> str:
    """``512x768``; a video family's bucket ``(width, height, frames)`` as ``512x768x33f``."""
    return f"{size[0]}x{size[1]}" + (f"x{size[2]}f" if len(size) > 2 else "")


def snap(value: float, step: int) -> int:
    """Nearest multiple of ``step``, at least ``step``."""
    return max(step, int(round(value / step)) * step)


def generate_buckets(target: Size, step: int = 64, max_aspect: float = 2.0) -> List[Size]:
    """Bucket sizes for the pixel budget of ``target``: sides multiples of ``step``, area at most the
    budget (each side as large as the budget allows), aspect ratio at most ``max_aspect``.

    The target is snapped to ``step`` first (500 → 512), so its own shape is always a bucket.
    """
    if step < 1:
        raise ValueError(f"bucket step must be >= 1, got {step}")
    tw, th = snap(target[0], step), snap(target[1], step)
    area = tw * th
    limit = max(float(max_aspect), tw / th, th / tw)  # the target's own shape is always allowed
    found = {(tw, th)}
    w = step
    while True:
        h = (area // w // step) * step
        if h < step:
            break
        if max(w / h, h / w) <= limit + 1e-9:
            found.add((w, h))
        w += step
    return sorted(found, key=lambda s: (s[0] / s[1], s[0]))


def nearest_bucket(width: int, height: int, buckets: Sequence[Size]) -> Size:
    """The bucket closest in aspect ratio (log distance: 2:1 and 1:2 are equally far from 1:1);
    ties go to the larger bucket, then the wider one, so the choice is the same everywhere."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: (round(abs(math.log(b[0] / b[1]) - aspect), 9), -b[0] * b[1], -b[0]))


def cover_scale(width: int, height: int, size: Size) -> float:
    """How much an image must be scaled to cover ``size`` (>1 = enlarged)."""
    return max(size[0] / width, size[1] / height)


def assign_bucket(width: int, height: int, buckets: Sequence[Size], step: int,
                  max_upscale: float) -> Optional[Size]:
    """The bucket of a ``width``×``height`` image, or None when the image is too small.

    ``max_upscale`` > 0 caps the enlargement: an image that would need more gets the nearest
    bucket shrunk by the missing factor (sides floored to ``step``), so it trains at a lower
    resolution instead of as a blurry enlargement. None when even that is below one step.
    """
    bucket = nearest_bucket(width, height, buckets)
    scale = cover_scale(width, height, bucket)
    if max_upscale <= 0 or scale <= max_upscale + 1e-9:
        return bucket
    factor = max_upscale / scale
    w = int(bucket[0] * factor // step) * step
    h = int(bucket[1] * factor // step) * step
    if w < step or h < step:
        return None
    return (w, h)


# --------------------------------------------------------------------------------------------
# epoch plan
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedBatch:
    """One micro-batch: item indices, their positions in the epoch order (the key of each sample's
    random choices) and the pixel size all of them are trained at."""
    indices: Tuple[int, ...]
    positions: Tuple[int, ...]
    size: Size

    def __len__(self) -> int:
        return len(self.indices)


def bucket_populations(item_buckets: Sequence[Sequence[Size]], repeats: Sequence[float]) -> Dict[Size, float]:
    """Samples per epoch that *can* go to each bucket (an item counts once per distinct bucket of
    its resolutions, weighted by its repeats)."""
    pop: Dict[Size, float] = {}
    for options, r in zip(item_buckets, repeats):
        for b in set(options):
            pop[b] = pop.get(b, 0.0) + float(r)
    return pop


def plan_epoch(order: Sequence[int], item_buckets: Sequence[Sequence[Size]], batch_size: int,
               seed: int, epoch: int, populations: Optional[Dict[Size, float]] = None
               ) -> Tuple[List[PlannedBatch], List[Tuple[int, int]]]:
    """Batches of one epoch from its sample ``order``; a pure function of its arguments.

    ``item_buckets[i]`` lists item ``i``'s bucket at each of its resolutions. A sample joins the
    oldest open batch whose size is one of its buckets; otherwise it opens a batch at one of its
    resolutions picked at random (preferring buckets whose ``populations`` can fill a batch).
    Returns ``(batches, leftovers)``; leftovers are ``(item, position)`` of batches left unfilled.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    rng = random.Random(seed_int("atelier-resolution", seed, epoch))
    open_batches: "OrderedDict[Size, List[Tuple[int, int]]]" = OrderedDict()
    batches: List[PlannedBatch] = []
    for position, index in enumerate(order):
        options = item_buckets[index]
        target = next((b for b in open_batches if b in options), None)
        if target is None:
            viable = [b for b in options if populations is None or populations.get(b, 0.0) >= batch_size]
            choices = viable or list(options)
            target = choices[rng.randrange(len(choices))] if len(choices) > 1 else choices[0]
            open_batches[target] = []
        members = open_batches[target]
        members.append((index, position))
        if len(members) == batch_size:
            del open_batches[target]
            batches.append(PlannedBatch(tuple(i for i, _ in members), tuple(p for _, p in members), target))
    leftovers = [m for members in open_batches.values() for m in members]
    return batches, leftovers


__all__ = ["Size", "parse_resolution", "format_size", "snap", "generate_buckets", "nearest_bucket",
           "cover_scale", "assign_bucket", "PlannedBatch", "bucket_populations", "plan_epoch"]


def check_resolutions(cfg: Any) -> None:
    """data.resolution and each concept's resolution: ``512``, ``768x512`` or ``384,448,512``."""
    fields = [("data.resolution", cfg.data.resolution)]
    fields += [(f"data.concepts.{i}.resolution", c.resolution) for i, c in enumerate(cfg.data.concepts)
               if str(c.resolution or "").strip()]
    for key, value in fields:
        try:
            parse_resolution(value)
        except ValueError as exc:
            raise ConfigError(f"'{key}' = {value!r} is not allowed: {exc}.", key=key, value=value) from None


def training_side(cfg: Any) -> int:
    """The training resolution as one side length (the square root of the largest pixel budget
    of data.resolution), for rules of thumb and metadata."""
    return int(round(max(w * h for w, h in parse_resolution(cfg.data.resolution)) ** 0.5))


def control_budget(data_cfg: Any) -> int:
    """data.control_resolution as a pixel budget (the largest of its sizes); 0 = controls take their target's size."""
    text = str(getattr(data_cfg, "control_resolution", "") or "").strip()
    return max(w * h for w, h in parse_resolution(text)) if text else 0


def control_size(size: Size, budget: int, step: int) -> Size:
    """The size a control image of a target at bucket ``size`` is rendered at: the target's own, or ``budget``
    pixels with the target's aspect ratio (sides multiples of ``step``)."""
    if not budget:
        return size
    w, h = size
    width = (budget * w / h) ** 0.5
    return snap(width, step), snap(budget / width, step)
