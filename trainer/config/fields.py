"""Reading the schema: every dotted key, its dataclass field and type, what a field allows (used by loading, the
checks, the CLI's ``config-help`` and the web UI's form), and which ``parts.*`` section a model part reads.
Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterable, List

from trainer.config.schema import AtelierConfig

# --------------------------------------------------------------------------------------------
# schema introspection (used by validation, the CLI's config-help and the web UI)
# --------------------------------------------------------------------------------------------

def inner_type(tp: Any) -> Any:
    """Strip Optional[...] from a resolved type annotation."""
    args = getattr(tp, "__args__", None)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0]
    return tp


def iter_fields(cls: type = AtelierConfig, prefix: str = "") -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """Yield (dotted key, dataclass field, resolved type) for every leaf and list field."""
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        tp = inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, fld, tp


def field_info(key: str) -> tuple[dataclasses.Field, Any]:
    """The field and type of a dotted key such as ``training.learning_rate`` or
    ``data.concepts.0.path`` (list indices are skipped)."""
    cls: Any = AtelierConfig
    parts = [p for p in key.split(".") if not p.isdigit()]
    fld = None
    tp = None
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        matches = [x for x in dataclasses.fields(cls) if x.name == part]
        if not matches:
            raise KeyError(key)
        fld = matches[0]
        tp = inner_type(hints[part])
        origin = getattr(tp, "__origin__", None)
        if origin in (list, List):
            tp_item = tp.__args__[0]
            if dataclasses.is_dataclass(tp_item) and i < len(parts) - 1:
                cls = tp_item
                continue
        if dataclasses.is_dataclass(tp):
            cls = tp
    assert fld is not None
    return fld, tp


def all_keys(cls: type = AtelierConfig, prefix: str = "") -> List[str]:
    """Every dotted key of the schema, including those inside list items (without indices)."""
    out = []
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        tp = inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            out += all_keys(tp, key + ".")
        else:
            out.append(key)
            origin = getattr(tp, "__origin__", None)
            if origin in (list, List) and dataclasses.is_dataclass(tp.__args__[0]):
                out += all_keys(tp.__args__[0], key + ".")
    return out


def suggest(bad_key: str) -> str:
    keys = all_keys()
    leaf = bad_key.split(".")[-1]
    close = difflib.get_close_matches(bad_key, keys, n=1, cutoff=0.6)
    if not close:
        close = [k for k in keys if k.split(".")[-1] in difflib.get_close_matches(
            leaf, [x.split(".")[-1] for x in keys], n=1, cutoff=0.7)][:1]
    return f" Did you mean '{close[0]}'?" if close else ""


def allowed(key: str) -> str:
    """What ``key`` allows, for messages: its choices, or its type and range."""
    try:
        fld, tp = field_info(key)
    except KeyError:
        return "see the schema."
    meta = fld.metadata
    if "choices" in meta:
        return "one of " + ", ".join(meta["choices"]) + "."
    name = {"int": "whole number", "float": "number", "bool": "true/false", "str": "text"}.get(
        getattr(tp, "__name__", ""), str(tp))
    rng = ""
    if "min" in meta or "max" in meta:
        rng = f" between {meta.get('min')} and {meta.get('max')}"
    return f"a {name}{rng}."


# the family's part slots (trainer.families Part.slot) -> their section under parts:
PART_OF_SLOT = {"unet": "denoiser", "text_encoder": "text_encoder_1", "text_encoder_2": "text_encoder_2",
                "text_encoder_3": "text_encoder_3", "text_encoder_4": "text_encoder_4"}


def part_of(cfg: Any, slot: str) -> Any:
    """The ``parts.*`` section of a model slot (``unet`` -> ``parts.denoiser``)."""
    return cfg.parts[PART_OF_SLOT[slot]]


def part_key(slot: str, name: str) -> str:
    """The dotted key of a per-part setting: ``part_key("text_encoder", "train")`` -> ``parts.text_encoder_1.train``."""
    return f"parts.{PART_OF_SLOT[slot]}.{name}"
