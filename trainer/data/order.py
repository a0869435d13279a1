"""Which samples an epoch holds and in what order: repeats (whole and fractional, paid out exactly over epochs) and
the seeded per-sample random generators. Pure functions of (seed, epoch, position), so a resumed run, or one with
another number of dataloader workers, sees exactly the same samples without saving any rng state."""

from __future__ import annotations

import functools
import hashlib
import random
from fractions import Fraction
from typing import Any, List, Sequence, Tuple

from trainer.data.concepts import ImageItem

# --------------------------------------------------------------------------------------------
# epoch order
# --------------------------------------------------------------------------------------------

def seed_int(*parts: Any) -> int:
    """A 64-bit seed from any parts; stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_rng(seed: int, epoch: int, position: int, purpose: str = "sample") -> random.Random:
    """An rng for one sample of one epoch (caption pick, random crop, flip).

    Deriving it from (seed, epoch, position) instead of carrying one rng through the loop makes a
    resumed run — or a run with a different number of dataloader workers — see exactly the same
    samples without saving any rng state.
    """
    return random.Random(seed_int("atelier", purpose, seed, epoch, position))


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
    per_concept = {index: concept_repeats(concepts[index], n) for index, n in counts.items()}  # settings read once
    return [per_concept[it.concept_index] for it in items]


@functools.lru_cache(maxsize=1024)  # one value per concept, asked once per item and epoch
def _exact(value: float) -> Fraction:
    # Fraction of the decimal the user typed (0.3 → 3/10), so floor(0.3 * 10) is 3, not 2.
    return Fraction(repr(float(value))).limit_denominator(10**6)


@functools.lru_cache(maxsize=1024)
def _split(value: float) -> Tuple[int, Fraction]:
    """(whole repeats, fraction) of a repeats value: worked out once per value, not per item."""
    exact = _exact(value)
    whole = int(exact)  # floor for non-negative
    return whole, exact - whole


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
        whole, frac = _split(r)
        order += [i] * whole
        if frac:
            groups.setdefault((item.concept_index, frac), []).append(i)
    for (concept_index, frac), members in sorted(groups.items()):
        n = len(members)
        total = frac * n
        start, stop = int(total * epoch), int(total * (epoch + 1))
        if stop == start:
            continue
        perm = list(members)
        random.Random(seed_int("atelier-fraction", seed, concept_index, frac)).shuffle(perm)
        order += [perm[k % n] for k in range(start, stop)]
    random.Random(seed_int("atelier-epoch", seed, epoch)).shuffle(order)
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
