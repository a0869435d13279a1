"""A memory-tier preset's promise, kept: ``general.sized_for`` names the ``*-<N>gb`` preset a config was sized with,
and every memory setting changed from that preset in a direction that needs more GPU memory is named (a warning at
its field, in ``validate``, ``train`` and the UI's Check): the run may no longer fit the card the tier is for.

The settings compared: fp8/NF4 storage of the denoiser and fp8 of the text encoders, swapped blocks, text-encoder
offloading, the latent and text caches, gradient checkpointing, batch size, resolution, LoRA rank, an 8-bit optimizer,
storage dtypes, trained text encoders, LoRA vs fine-tune. The estimate itself (``python -m trainer estimate-vram``, the
UI's VRAM check) says by how much; this only says which setting broke the tier, without loading anything.
The optimizer counts as more when its states grow (Adafactor < 8-bit < full precision)."""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Tuple

from omegaconf import OmegaConf

from trainer.config.load import compose, resolve_preset
from trainer.data.buckets import parse_resolution
from trainer.errors import ConfigError
from trainer.optim.registry import optimizer_spec

_WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}


def card_gib(preset: str) -> int:
    m = re.search(r"-(\d+)gb$", preset)
    return int(m.group(1)) if m else 0


def _sel(cfg: Any, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def _largest_side(cfg: Any) -> int:
    try:
        sizes = parse_resolution(cfg.data.resolution)
    except Exception:
        return 0
    return max((w * h for w, h in sizes), default=0)


def _quantised(cfg: Any) -> int:
    den = cfg.parts.denoiser
    return 2 if den.get("nf4", False) else 1 if den.get("fp8", False) else 0


def _optimizer_state(cfg: Any) -> int:
    """0: factored (Adafactor, a few vectors per matrix), 1: 8-bit states, 2: full-precision states."""
    name = str(cfg.training.optimizer.name).lower()
    if "adafactor" in name:
        return 0
    try:
        return 1 if optimizer_spec(name).eight_bit else 2
    except Exception:
        return 2


# (key named in the warning, value of the config, True when the tier's value → this one needs more memory)
_RULES: List[Tuple[str, Callable[[Any], Any], Callable[[Any, Any], bool]]] = [
    ("parts.denoiser.nf4", _quantised, lambda tier, now: now < tier),
    ("parts.denoiser.blocks_to_swap", lambda c: int(c.parts.denoiser.get("blocks_to_swap", 0) or 0),
     lambda tier, now: now < tier),
    ("data.offload_text_encoders", lambda c: bool(c.data.get("offload_text_encoders", False)),
     lambda tier, now: tier and not now),
    ("data.cache_text", lambda c: bool(c.data.cache_text), lambda tier, now: tier and not now),
    ("data.cache_latents", lambda c: bool(c.data.cache_latents), lambda tier, now: tier and not now),
    ("training.gradient_checkpointing", lambda c: bool(c.training.gradient_checkpointing),
     lambda tier, now: tier and not now),
    ("training.gradient_checkpointing_interval",  # every Nth block checkpointed: the others keep activations
     lambda c: int(c.training.get("gradient_checkpointing_interval", 1) or 1), lambda tier, now: now > tier),
    ("training.checkpoint_keep_attention", lambda c: bool(c.training.get("checkpoint_keep_attention", False)),
     lambda tier, now: now and not tier),
    ("training.batch_size", lambda c: int(c.training.batch_size), lambda tier, now: now > tier),
    ("data.resolution", _largest_side, lambda tier, now: now > tier),
    ("lora.rank", lambda c: int(c.lora.rank), lambda tier, now: now > 2 * tier),
    ("training.optimizer.name", _optimizer_state, lambda tier, now: now > tier),
    ("training.method", lambda c: str(c.training.method), lambda tier, now: tier == "lora" and now != "lora"),
    ("parts.denoiser.dtype", lambda c: _WIDTH.get(str(c.parts.denoiser.dtype), 4), lambda tier, now: now > tier),
] + [rule for part in ("text_encoder_1", "text_encoder_2", "text_encoder_3", "text_encoder_4")
   for rule in (
    (f"parts.{part}.fp8", lambda c, p=part: bool(c.parts[p].get("fp8", False)), lambda tier, now: tier and not now),
    (f"parts.{part}.train", lambda c, p=part: bool(c.parts[p].train), lambda tier, now: now and not tier),
    (f"parts.{part}.dtype", lambda c, p=part: _WIDTH.get(str(c.parts[p].dtype), 4), lambda tier, now: now > tier),
)]


def _shown(cfg: Any, key: str) -> str:
    if key == "parts.denoiser.nf4":
        den = cfg.parts.denoiser
        return "NF4" if den.get("nf4", False) else "fp8" if den.get("fp8", False) else "neither fp8 nor NF4"
    return str(_sel(cfg, key))


_COMPOSED: Dict[Tuple[str, int], Any] = {}


def _tier_preset(preset: str) -> Any:
    """The composed ``general.sized_for`` preset, once per preset file version (its path and mtime): every config load
    checks its tier, and composing the preset again each time was most of a load's cost. Read only here."""
    path = resolve_preset(preset)
    key = (str(path), path.stat().st_mtime_ns if path.exists() else 0)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(preset=preset)
    return _COMPOSED[key]


def tier_warnings(cfg: Any) -> List[Tuple[str, str]]:
    """(key, message) for each memory setting of ``cfg`` that needs more than its ``general.sized_for`` preset's."""
    preset = str(cfg.general.get("sized_for", "") or "")
    if not preset:
        return []
    try:
        tier = _tier_preset(preset)  # a shipped preset: its values were checked when it shipped
    except ConfigError:
        return [("general.sized_for", f"general.sized_for = {preset}: no such preset to compare the memory settings "
                                      "with. Clear it, or name the *-<N>gb preset this config started from.")]
    card = card_gib(preset)
    where = f"a {card} GB card" if card else "its memory"
    out = []
    for key, value, costs in _RULES:
        try:
            before, now = value(tier), value(cfg)
        except Exception:
            continue
        if costs(before, now):
            out.append((key, f"{key} is {_shown(cfg, key)} here; {preset}, sized for {where}, has "
                             f"{_shown(tier, key)}. That needs more GPU memory: the run may not fit {where}. Set it back, "
                             f"or check the estimate for your card (the VRAM check before Start, or python -m trainer "
                             f"estimate-vram CONFIG --card-gib {card or 'N'})."))
    return out


__all__ = ["card_gib", "tier_warnings"]
