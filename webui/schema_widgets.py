"""Schema → widgets, and widget values ↔ config values.

The web UI never lists config fields by hand: every field of ``trainer.config.schema.AtelierConfig`` is
described here as a :class:`FieldSpec` (read from the dataclass metadata: help, choices, min/max,
ui hint), and a spec decides its widget kind. A field added to the schema therefore shows up in
the form without any UI code. The conversion functions are pure (no Gradio state), so the exact
config ↔ form round trip can be unit-tested without a browser.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import yaml

from trainer.config.fields import field_info, iter_fields
from trainer.config.schema import AtelierConfig

# widget kinds
BOOL, INT, FLOAT, CHOICE, TEXT, TEXTAREA, PATH, TABLE, LIST, YAML = (
    "bool", "int", "float", "choice", "text", "textarea", "path", "table", "list", "yaml")


@dataclass(frozen=True)
class FieldSpec:
    """What the UI needs to know about one schema field."""
    key: str                      # dotted key (relative to the list item for table columns)
    kind: str                     # one of the kinds above
    help: str
    default: Any
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    optional: bool = False        # None is a valid value ("blank = ...")
    hidden: bool = False
    items: tuple = ()             # column specs of a TABLE (list of dataclass)

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def group(self) -> str:
        """The dotted path of the dataclass holding the field (``training.optimizer``)."""
        return self.key.rsplit(".", 1)[0] if "." in self.key else ""

    @property
    def label(self) -> str:
        return label_of(self.name)

    @property
    def elem_id(self) -> str:
        return "cfg-" + self.key.replace(".", "-").replace("_", "-")

    def info(self) -> str:
        """Help text plus the allowed range, shown under the widget."""
        extra = []
        if self.minimum is not None or self.maximum is not None:
            extra.append(f"{_fmt(self.minimum)} … {_fmt(self.maximum)}")
        if self.optional:
            extra.append("blank allowed")
        return self.help + (f" ({'; '.join(extra)})" if extra else "")


LABEL_WORDS = {"lr": "LR", "cfg": "CFG", "ema": "EMA", "unet": "UNet", "vae": "VAE", "dtype": "dtype",
               "lora": "LoRA", "n": "N", "id": "ID"}


def label_of(name: str) -> str:
    words = [LABEL_WORDS.get(w, w) for w in name.split("_")]
    first = words[0] if words[0] in LABEL_WORDS.values() else words[0].capitalize()
    return " ".join([first] + words[1:])


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "∞"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        x = int(x)
    return f"{x:g}" if isinstance(x, float) else str(x)


def _is_optional(fld: dataclasses.Field) -> bool:
    text = str(fld.type)
    return fld.default is None or "Optional[" in text or "None" in text.replace("NoneType", "None")


def _default(fld: dataclasses.Field) -> Any:
    if fld.default is not dataclasses.MISSING:
        return fld.default
    if fld.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return fld.default_factory()  # type: ignore[misc]
    return None


def spec_of(key: str, fld: dataclasses.Field, tp: Any) -> FieldSpec:
    """Decide the widget kind of one field from its type and metadata."""
    meta = dict(fld.metadata)
    common = dict(key=key, help=meta.get("help", ""), default=_default(fld), optional=_is_optional(fld),
                  hidden=meta.get("ui") == "hidden", minimum=meta.get("min"), maximum=meta.get("max"))
    origin = typing.get_origin(tp)
    if origin in (list, List):
        (item_tp,) = typing.get_args(tp) or (Any,)
        if dataclasses.is_dataclass(item_tp):
            items = tuple(spec_of(k, f, t) for k, f, t in iter_fields(item_tp))
            return FieldSpec(kind=TABLE, items=items, **common)
        return FieldSpec(kind=LIST, **common)
    if "choices" in meta:
        return FieldSpec(kind=CHOICE, choices=tuple(meta["choices"]), **common)
    if tp is bool:
        return FieldSpec(kind=BOOL, **common)
    if tp is int:
        return FieldSpec(kind=INT, **common)
    if tp is float:
        return FieldSpec(kind=FLOAT, **common)
    if tp is str:
        kind = {"path": PATH, "textarea": TEXTAREA}.get(meta.get("ui"), TEXT)
        return FieldSpec(kind=kind, **common)
    return FieldSpec(kind=YAML, **common)


def choice_notes(help_text: str, choices: Iterable[Any]) -> dict:
    """What a field's help says of each choice: the words in parentheses right after the choice's name
    ("validation (never trained on, …)" → {"validation": "never trained on, …"}); choices it does not explain are
    left out. For fields whose help is written that way (a concept's role), so the dropdown explains each option."""
    notes = {}
    for choice in choices:
        m = re.search(r"(?<![\w.-])" + re.escape(str(choice)) + r"\s*\(", help_text)
        if not m:
            continue
        depth, i = 1, m.end()
        while i < len(help_text) and depth:
            depth += {"(": 1, ")": -1}.get(help_text[i], 0)
            i += 1
        notes[choice] = " ".join(help_text[m.end():i - 1].split())
    return notes


def all_specs(cls: type = AtelierConfig) -> List[FieldSpec]:
    """Every leaf and list field of the schema, hidden ones included, in schema order."""
    return [spec_of(k, f, t) for k, f, t in iter_fields(cls)]


def section_help(section_key: str) -> str:
    """Help text of a dataclass-valued field such as ``training`` or ``training.optimizer``."""
    try:
        fld, _ = field_info(section_key)
    except KeyError:
        return ""
    return fld.metadata.get("help", "")


# --------------------------------------------------------------------------------------------
# values: config → widget and widget → config
# --------------------------------------------------------------------------------------------

@dataclass
class FieldError:
    """A problem attached to a field key (``data.concepts.0.path`` for table cells)."""
    key: str
    message: str
    level: str = "error"


def get_path(data: Any, key: str) -> Any:
    node = data
    for part in key.split("."):
        if node is None:
            return None
        try:
            node = node[int(part)] if part.isdigit() else node[part]
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return node


def set_path(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """A config value as its widget wants it."""
    if spec.kind == TABLE:
        return [[to_widget(c, (item or {}).get(c.key) if isinstance(item, dict) else get_path(item, c.key))
                 for c in spec.items] for item in (value or [])]
    if spec.kind == LIST:
        return "\n".join(str(v) for v in (value or []))
    if spec.kind == YAML:
        return "" if value is None else yaml.safe_dump(value, default_flow_style=True).strip()
    if spec.kind == BOOL:
        return bool(value)
    if spec.kind in (TEXT, TEXTAREA, PATH):
        return "" if value is None else str(value)
    return value


def from_widget(spec: FieldSpec, raw: Any, key: Optional[str] = None) -> tuple[Any, Optional[FieldError]]:
    """A widget value as a config value, or a FieldError naming the field (never raises)."""
    key = key or spec.key
    try:
        if spec.kind == TABLE:
            return _table_from_widget(spec, raw, key)
        if spec.kind in (INT, FLOAT):
            return _number(spec, raw, key)
        if spec.kind == BOOL:
            if isinstance(raw, str):
                low = raw.strip().lower()
                if low in ("true", "yes", "1", "on"):
                    return True, None
                if low in ("false", "no", "0", "off", ""):
                    return False, None
                return None, FieldError(key, f"{key}: '{raw}' is not true or false.")
            return bool(raw) if raw is not None and not _isnan(raw) else False, None
        if spec.kind == CHOICE:
            if spec.optional and raw in (None, ""):
                return None, None
            if raw not in spec.choices:
                return raw, FieldError(key, f"{key} = {raw!r} is not allowed: one of {', '.join(spec.choices)}.")
            return raw, None
        if spec.kind == LIST:
            return [line.strip() for line in str(raw or "").splitlines() if line.strip()], None
        if spec.kind == YAML:
            return (yaml.safe_load(raw) if str(raw or "").strip() else None), None
        if raw is None or _isnan(raw):
            return ("" if not spec.optional else None), None
        return str(raw), None
    except Exception as exc:  # a broken cell must not take the whole form down
        return None, FieldError(key, f"{key}: {exc}")


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _number(spec: FieldSpec, raw: Any, key: str) -> tuple[Any, Optional[FieldError]]:
    if isinstance(raw, str):
        raw = raw.strip()
        if raw == "":
            raw = None
    if raw is None or _isnan(raw):
        if spec.optional:
            return None, None
        return None, FieldError(key, f"{key} is empty: give a number ({spec.info()}).")
    if isinstance(raw, bool):
        raw = int(raw)
    try:
        num = float(raw)
    except (TypeError, ValueError):
        return raw, FieldError(key, f"{key} = {raw!r} is not a number.")
    if spec.kind == INT:
        if not num.is_integer():
            return num, FieldError(key, f"{key} = {raw!r} must be a whole number.")
        value: Any = int(num)
    else:
        value = num
    lo, hi = spec.minimum, spec.maximum
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        return value, FieldError(key, f"{key} = {raw!r} is out of range: allowed {_fmt(lo)} to {_fmt(hi)}.")
    return value, None


def _row_is_blank(row: Iterable[Any]) -> bool:
    return all(c is None or c == "" or _isnan(c) for c in row)


def _table_from_widget(spec: FieldSpec, raw: Any, key: str) -> tuple[Any, Optional[FieldError]]:
    items, errors = table_from_widget(spec, raw, key)
    return items, (errors[0] if errors else None)


def table_from_widget(spec: FieldSpec, raw: Any, key: Optional[str] = None) -> tuple[list, List[FieldError]]:
    """Rows of a gr.Dataframe (list of lists, a pandas frame or its JSON form) → list of dicts,
    with an error for every bad cell (named ``<list key>.<row>.<column>``)."""
    key = key or spec.key
    headers = [c.key for c in spec.items]
    if raw is None:
        return [], []
    if hasattr(raw, "columns"):  # pandas
        headers = [str(h) for h in raw.columns]
        raw = raw.values.tolist()
    elif isinstance(raw, dict):
        headers = list(raw.get("headers") or headers)
        raw = raw.get("data") or []
    items: list = []
    errors: List[FieldError] = []
    by_name = {c.key: c for c in spec.items}
    for r, row in enumerate(r for r in raw if not _row_is_blank(r)):
        item = {}
        for header, cell in zip(headers, row):
            col = by_name.get(header)
            if col is None:
                continue
            value, err = from_widget(col, cell, f"{key}.{r}.{col.key}")
            if err:
                errors.append(err)
            item[col.key] = value
        items.append(item)
    return items, errors


def config_to_values(cfg: Any, specs: Iterable[FieldSpec]) -> List[Any]:
    """Widget values of a config (a DictConfig or a plain nested dict), in spec order."""
    out = []
    for spec in specs:
        value = get_path(cfg, spec.key)
        if spec.kind == TABLE and value is not None and not isinstance(value, list):
            value = list(value)
        out.append(to_widget(spec, value))
    return out


def values_to_dict(specs: Iterable[FieldSpec], values: Iterable[Any]) -> tuple[dict, List[FieldError]]:
    """A nested dict (ready for ``config_from_dict``) from widget values, plus every field error."""
    data: dict = {}
    errors: List[FieldError] = []
    for spec, raw in zip(specs, values):
        if spec.kind == TABLE:
            value, errs = table_from_widget(spec, raw)
            errors += errs
        else:
            value, err = from_widget(spec, raw)
            if err:
                errors.append(err)
                continue
        set_path(data, spec.key, value)
    return data, errors


def lenient_values(raw: dict, specs: List[FieldSpec]) -> List[Any]:
    """Widget values from a possibly invalid nested dict (a draft): what fits is kept, the rest
    falls back to the default, so a half-typed form survives a restart."""
    out = []
    for spec in specs:
        value = get_path(raw, spec.key)
        if value is None and not spec.optional:
            value = spec.default
        try:
            widget_value = to_widget(spec, value)
            if spec.kind in (INT, FLOAT) and widget_value is not None:
                widget_value = float(widget_value) if spec.kind == FLOAT else int(float(widget_value))
            out.append(widget_value)
        except Exception:
            out.append(to_widget(spec, spec.default))
    return out


__all__ = ["FieldSpec", "FieldError", "all_specs", "choice_notes", "spec_of", "section_help", "to_widget",
           "from_widget", "config_to_values", "values_to_dict", "table_from_widget", "lenient_values", "get_path",
           "set_path", "label_of"]
