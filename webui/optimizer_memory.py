"""Remember the last settings used per optimizer, and show only the chosen optimizer's fields.

Switching ``training.optimizer.name`` from Prodigy (d_coef, safeguard_warmup, ...) to AdamW and back
should not lose the Prodigy settings. The settings live server-side in
``<workspace>/ui-optimizer-settings.json`` (``{optimizer name: {field key: config value}}``), so they
survive a restart and a second browser sees them.

Events (both on the name dropdown, so loading a config never triggers a restore):

* ``focus`` (the user opens the dropdown; the name is still the old one): the optimizer fields are
  stored under that name;
* ``input`` (the user picked another optimizer): that optimizer's stored fields come back (fields it
  never had stored keep their current value);
* ``change`` (user or a loaded config): only the fields of the chosen optimizer are visible
  (``trainer.optim.registry.optimizer_fields``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import gradio as gr

from trainer.optim.registry import OPTIMIZERS, optimizer_fields
from webui import schema_widgets as sw
from webui.context import AppContext

NAME_KEY = "training.optimizer.name"
PREFIX = "training.optimizer."
FILE_NAME = "ui-optimizer-settings.json"


class OptimizerMemory:
    """``{optimizer: {key: value}}`` in a JSON file of the workspace (written atomically)."""

    def __init__(self, workspace: Path):
        self.path = Path(workspace) / FILE_NAME

    def load(self) -> Dict[str, Dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def remember(self, name: str, settings: Dict[str, Any]) -> None:
        if name not in OPTIMIZERS or not settings:
            return
        data = self.load()
        data[name] = settings
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)

    def recall(self, name: str) -> Optional[Dict[str, Any]]:
        found = self.load().get(name)
        return found if isinstance(found, dict) else None


def field_specs(form) -> List[sw.FieldSpec]:
    """The form's optimizer-setting fields (everything under training.optimizer except the name)."""
    return [s for s in form.specs if s.key.startswith(PREFIX) and s.key != NAME_KEY]


def wire(ctx: AppContext) -> None:
    """Attach the handlers to the name dropdown (after the form is built)."""
    form = ctx.form
    assert form is not None
    if NAME_KEY not in form.widgets:
        return
    memory = OptimizerMemory(ctx.workspace)
    specs = field_specs(form)
    widgets = [form.widgets[s.key] for s in specs]
    name_widget = form.widgets[NAME_KEY]

    def shown(name: Optional[str]) -> set:
        return set(optimizer_fields(name)) if name in OPTIMIZERS else {s.key for s in specs}

    def store(name: Optional[str], *values: Any) -> None:
        """Keep the fields that optimizer ``name`` takes (and extra_args), as config values."""
        if name not in OPTIMIZERS:
            return
        keep = shown(name)
        settings = {}
        for spec, raw in zip(specs, values):
            if spec.key not in keep:
                continue
            value, err = sw.from_widget(spec, raw)
            if err is None:
                settings[spec.key] = value
        memory.remember(name, settings)

    def switch(name: Optional[str], *values: Any) -> List[Any]:  # noqa: ARG001 (the fields are outputs too)
        """The user picked ``name``: its remembered settings, and only its fields visible."""
        saved = (memory.recall(name) or {}) if name in OPTIMIZERS else {}
        keep = shown(name)
        out = []
        for spec in specs:
            if spec.key in saved:
                out.append(gr.update(value=sw.to_widget(spec, saved[spec.key]), visible=spec.key in keep))
            else:
                out.append(gr.update(visible=spec.key in keep))
        return out

    def visibility(name: Optional[str]) -> List[Any]:
        keep = shown(name)
        return [gr.update(visible=s.key in keep) for s in specs]

    first = shown(name_widget.value)  # a fresh page shows only the default optimizer's fields, not all of them
    for spec, widget in zip(specs, widgets):
        widget.visible = spec.key in first
    ctx.handlers["optimizer_store"] = store
    ctx.handlers["optimizer_switch"] = switch
    ctx.handlers["optimizer_visibility"] = visibility
    ctx.components["optimizer_memory"] = memory
    name_widget.focus(store, [name_widget, *widgets], None, show_progress="hidden")
    name_widget.input(switch, [name_widget, *widgets], widgets, show_progress="hidden")
    name_widget.change(visibility, [name_widget], widgets, show_progress="hidden")


__all__ = ["OptimizerMemory", "wire", "field_specs", "FILE_NAME"]
