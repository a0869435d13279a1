"""The form follows the model's family: which family ``model.path`` holds (told without loading it, from
the torch-free registry), its parts, per-part fields labelled by the part (Transformer, T5 …) or hidden when
the family has no such part, and fields only some families read (``FamilyInfo.own_fields``: Stable Cascade's
``model.effnet_path`` …) shown for those alone. Presentation only: hidden fields keep their values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import gradio as gr
import yaml

from trainer.config.fields import PART_OF_SLOT, all_keys, part_key
from trainer.data.frames import CONCEPT_CLIP_SETTINGS, DATA_CLIP_SETTINGS
from trainer.families import family_only_fields, info_for
from trainer.families.checks import family_without_loading
from trainer.objectives import OBJECTIVE_NAMES
from webui import schema_widgets as sw


def _slot_fields() -> Dict[str, Tuple[str, ...]]:
    """The per-part settings of each model slot: every ``parts.<part>.*`` key of the schema."""
    keys = all_keys()
    return {slot: tuple(k for k in keys if k.startswith(f"parts.{part}.")) for slot, part in PART_OF_SLOT.items()}


SLOT_FIELDS: Dict[str, Tuple[str, ...]] = _slot_fields()
# shown only for a video family: the concept editor's clip fields and the data section's
CLIP_KEYS: Tuple[str, ...] = tuple(f"data.concepts.{k}" for k in CONCEPT_CLIP_SETTINGS) + DATA_CLIP_SETTINGS


def describe(path: Any, family: Any) -> Tuple[str, Dict[str, bool], Dict[str, str]]:
    """(markdown summary, key -> shown, key -> part label) for a model path and ``model.family``."""
    try:
        variant = family_without_loading(SimpleNamespace(path=str(path or ""), family=str(family or "auto")))
    except Exception as exc:  # a family's detection refused the weights: say so at the model
        return f"**Model:** {exc}", {}, {}
    if not variant:
        return ("**Model family:** told when the model loads (a hub id or a .ckpt file; set model.family "
                "to choose it now)."), {}, {}
    info = info_for(variant)
    parts = {p.slot: p for p in info.parts}
    lines = [f"**Model family:** {info.label} (`{variant}`) — objective: {OBJECTIVE_NAMES[info.objective]}; parts: "
             + ", ".join(f"{p.label} (`{part_key(p.slot, 'train')}`)" for p in info.parts)]
    shown = {key: slot in parts for slot, keys in SLOT_FIELDS.items() for key in keys}
    shown.update({key: key in info.own_fields for key in family_only_fields()})  # e.g. Cascade's model.effnet_path
    shown.update({key: info.video is not None for key in CLIP_KEYS})  # what a folder of clips is cut into
    labels = {key: parts[slot].label for slot, keys in SLOT_FIELDS.items() for key in keys if slot in parts}
    return "\n".join(lines), shown, labels


_RUN_LABELS: Dict[Tuple[str, int], Dict[str, str]] = {}  # (config.yaml, its mtime) -> slot -> label


def run_part_labels(run_dir: Path) -> Dict[str, str]:
    """What a run's family calls each of its trained parts (``unet`` → "Transformer" for Flux, "UNet" for SD), from
    the run's ``config.yaml`` without loading the model; {} when the family cannot be told that way (the page then
    shows the trainer's own names). The trainer names its optimizer groups after the model's slots, so the
    learning-rate chart labels its series with these."""
    path = Path(run_dir) / "config.yaml"
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except OSError:
        return {}
    if key not in _RUN_LABELS:
        labels: Dict[str, str] = {}
        try:
            model = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("model") or {}
            variant = family_without_loading(SimpleNamespace(path=str(model.get("path") or ""),
                                                             family=str(model.get("family") or "auto")))
            if variant:
                labels = {p.slot: p.label for p in info_for(variant).parts}
        except Exception:  # an unreadable config or a detection that refuses the file: the trainer's names
            labels = {}
        _RUN_LABELS[key] = labels
    return _RUN_LABELS[key]


def wire(form: Any) -> Any:
    """On model.path / model.family changes: the summary, and per-part fields shown and labelled."""

    note = getattr(form, "family_note", None)
    if note is None or "model.path" not in form.widgets:
        return None
    keys: List[str] = [k for keys in SLOT_FIELDS.values() for k in keys if k in form.widgets]
    keys += [k for k in family_only_fields() if k in form.widgets]
    keys += [k for k in DATA_CLIP_SETTINGS if k in form.widgets]
    base_labels = {s.key: s.label for s in form.specs}
    concepts = getattr(form, "editors", {}).get("data.concepts")  # the concept row editor's clip fields
    items = [(f"data.concepts.{c.key}", w) for c, w in zip(concepts.spec.items, concepts.items)
             if c.key in CONCEPT_CLIP_SETTINGS] if concepts is not None else []

    def update(path: Any, family: Any = "auto") -> list:
        text, shown, labels = describe(path, family)
        out = [gr.Markdown(value=text)]
        for key in keys:
            label = base_labels.get(key, sw.label_of(key.split(".")[-1]))
            if key in labels:
                label = f"{label} — {labels[key]}"
            out.append(gr.update(visible=shown.get(key, True), label=label))
        out += [gr.update(visible=shown.get(key, True)) for key, _ in items]
        return out

    inputs = [form.widgets["model.path"]] + ([form.widgets["model.family"]] if "model.family" in form.widgets else [])
    for widget in inputs:
        widget.change(update, inputs, [note] + [form.widgets[k] for k in keys] + [w for _, w in items],
                      show_progress="hidden")
    return update
