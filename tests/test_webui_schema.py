"""Schema → widgets, the exact config ↔ form round trip, and bad input that names its field.

Handlers are called directly (``ctx.handlers``) and values are passed through each component's
own ``postprocess``/``preprocess`` with a JSON hop in between, which is what a browser does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import gradio as gr
import pytest
import yaml

from trainer.config.checks import config_from_dict, load_config
from trainer.config.fields import field_info, iter_fields
from trainer.config.load import PRESETS_DIR, preset_names, to_yaml
from trainer.config.schema import GeneralConfig
from trainer.config.schema_training import TrainingConfig
from trainer.config import declare
from webui import schema_widgets as sw
from webui.app import build_app
from webui.form import Form, tab_layout
from webui.runner import RunManager, list_run_dirs


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from test_webui_runner import fake_trainer_argv
    ws = tmp_path_factory.mktemp("ws")
    manager = RunManager(ws, trainer_argv=fake_trainer_argv(tmp_path_factory.mktemp("fake")))
    demo = build_app(ws, manager=manager, start_scheduler=False)
    yield demo.atelier
    for run_dir in manager.active_runs():
        from webui import runner
        runner.stop(run_dir, force=True)


def through_browser(component: Any, value: Any) -> Any:
    """Server → JSON → server, as a value makes the trip through the page."""
    payload = component.postprocess(value)
    if hasattr(payload, "model_dump"):
        payload = type(payload)(**json.loads(json.dumps(payload.model_dump())))
    else:
        payload = json.loads(json.dumps(payload))
    return component.preprocess(payload)


def plain(updates: List[Any]) -> List[Any]:
    """Values out of handler outputs (gr.update dicts or bare values)."""
    return [u.get("value") if isinstance(u, dict) and u.get("__type__") == "update" else u for u in updates]


def form_values(ctx, cfg: Any) -> List[Any]:
    form = ctx.form
    values = form.values_for(cfg)
    return [through_browser(c, v) for c, v in zip(form.inputs, values)]


def set_value(ctx, values: List[Any], key: str, value: Any) -> List[Any]:
    values = list(values)
    values[[s.key for s in ctx.form.specs].index(key)] = value
    return values


# ---------------------------------------------------------------------------------------------
# schema → widgets
# ---------------------------------------------------------------------------------------------

KIND_CLASS = {sw.BOOL: gr.Checkbox, sw.CHOICE: gr.Dropdown, sw.INT: gr.Number, sw.FLOAT: gr.Number,
              sw.TEXT: gr.Textbox, sw.TEXTAREA: gr.Textbox, sw.PATH: gr.Textbox, sw.LIST: gr.Textbox,
              sw.YAML: gr.Textbox, sw.TABLE: gr.Dataframe}


def test_every_visible_leaf_field_gets_a_widget_of_the_right_kind(app):
    form = app.form
    keys = [k for k, _, _ in iter_fields()]
    hidden = [k for k, f, _ in iter_fields() if f.metadata.get("ui") == "hidden"]
    assert hidden and not any(k in form.widgets for k in hidden)
    assert sorted(form.widgets) == sorted(set(keys) - set(hidden))
    for spec in form.specs:
        widget = form.widgets[spec.key]
        assert isinstance(widget, KIND_CLASS[spec.kind]), spec.key
        assert widget.elem_id == spec.elem_id
        if spec.kind == sw.TABLE:
            assert widget.headers == [c.key for c in spec.items]
            continue
        fld, _ = field_info(spec.key)
        meta = fld.metadata
        assert meta.get("help", "") in widget.info, spec.key
        if "choices" in meta:
            assert [c[1] for c in widget.choices] == meta["choices"], spec.key
        if spec.kind in (sw.INT, sw.FLOAT):
            assert widget.minimum == meta.get("min") and widget.maximum == meta.get("max"), spec.key
            assert widget.precision == (0 if spec.kind == sw.INT else None)
        if spec.kind == sw.PATH:
            assert widget in app.browser.targets, f"{spec.key} has no browse button"


def test_table_columns_get_row_editor_widgets_with_choices(app):
    editor = app.form.editors["data.concepts"]
    by_name = {c.key: w for c, w in zip(editor.spec.items, editor.items)}
    assert isinstance(by_name["caption_source"], gr.Dropdown)
    assert [c[1] for c in by_name["caption_source"].choices] == ["txt", "concept_file", "filename"]
    assert by_name["repeats"].minimum == 0.0 and by_name["path"] in app.browser.targets
    assert "sampling.prompts" in app.form.editors


@dataclass
class NewItem:
    label: str = declare.f("", "A label.")
    weight: float = declare.f(1.0, "Weight.", min=0.0, max=5.0)


@dataclass
class NewSection:
    strength: float = declare.f(0.5, "How strong.", min=0.0, max=2.0)
    steps: int = declare.f(3, "How many.", min=1, max=9)
    mode: str = declare.f("a", "Mode.", choices=["a", "b"])
    folder: str = declare.f("", "A folder.", ui="path")
    notes: str = declare.f("", "Notes.", ui="textarea")
    on: bool = declare.f(False, "On.")
    maybe: Optional[float] = declare.f(None, "Blank = off.", min=0.0, max=1.0)
    secret: int = declare.f(1, "Hidden.", ui="hidden")
    items: List[NewItem] = declare.f(help="Items.", factory=list)


@dataclass
class NewRoot:
    general: GeneralConfig = declare.f(help="General.", factory=GeneralConfig)
    extra: NewSection = declare.f(help="A section the UI has never heard of.", factory=NewSection)


def test_a_new_schema_field_appears_without_ui_code():
    specs = {s.key: s for s in sw.all_specs(NewRoot)}
    assert specs["extra.strength"].kind == sw.FLOAT and specs["extra.strength"].maximum == 2.0
    assert specs["extra.steps"].kind == sw.INT
    assert specs["extra.mode"].kind == sw.CHOICE and specs["extra.mode"].choices == ("a", "b")
    assert specs["extra.folder"].kind == sw.PATH and specs["extra.notes"].kind == sw.TEXTAREA
    assert specs["extra.on"].kind == sw.BOOL and specs["extra.secret"].hidden
    assert specs["extra.maybe"].optional and specs["extra.items"].kind == sw.TABLE
    assert [c.key for c in specs["extra.items"].items] == ["label", "weight"]
    assert ("Extra", "extra", ["extra"]) in tab_layout(list(specs.values()))
    with gr.Blocks():
        form = Form(None, schema=NewRoot)
        with gr.Tabs():
            form.build()
    assert isinstance(form.widgets["extra.mode"], gr.Dropdown)
    assert form.tab_of["extra.strength"] == "extra" and "extra.secret" not in form.widgets
    data, errors = form.collect(form.lenient_values_for({"extra": {"items": [{"label": "x", "weight": 2}]}}))
    assert not errors and data["extra"]["items"] == [{"label": "x", "weight": 2.0}]


# ---------------------------------------------------------------------------------------------
# config ↔ form round trip
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", preset_names())
def test_preset_to_form_to_config_is_exact(app, preset):
    cfg = load_config(preset=preset)
    data, errors = app.form.collect(form_values(app, cfg))
    assert errors == []
    assert to_yaml(config_from_dict(data)) == to_yaml(cfg)


def test_load_then_save_changes_nothing(app, tmp_path):
    h = app.handlers
    values = plain(h["load_preset"]("demo"))[:len(app.form.inputs)]
    values = [through_browser(c, v) for c, v in zip(app.form.inputs, values)]
    first = app.workspace / "a.yaml"
    assert "Saved" in h["save_file"](str(first), *values)
    assert first.read_text() == to_yaml(load_config(preset="demo"))
    again = plain(h["load_file"](str(first)))[:len(app.form.inputs)]
    again = [through_browser(c, v) for c, v in zip(app.form.inputs, again)]
    second = app.workspace / "b.yaml"
    h["save_file"](str(second), *again)
    assert second.read_bytes() == first.read_bytes()
    assert "${atelier_root:}" in first.read_text()  # interpolations survive the trip


# ---------------------------------------------------------------------------------------------
# bad input: a message naming the field, and the form keeps what the user typed
# ---------------------------------------------------------------------------------------------

def _skipped(outputs: List[Any], n: int) -> bool:
    return all(isinstance(o, dict) and o.get("__type__") == "update" and "value" not in o for o in outputs[:n])


def test_out_of_range_value_names_the_field_and_starts_nothing(app):
    values = set_value(app, form_values(app, load_config(preset="demo")), "training.batch_size", 0)
    out = app.handlers["validate"](*values)
    message = out[-1]
    assert "training.batch_size" in message and "out of range" in message and "Training tab" in message
    annotated = [s.key for s in app.form.specs if s.kind != sw.TABLE]
    note = out[annotated.index("training.batch_size")]
    assert "atl-field-error" in note["elem_classes"] and "out of range" in note["info"]
    assert all("value" not in o for o in out[:-1] if isinstance(o, dict))  # the form is untouched
    before = list_run_dirs(app.workspace)
    out = app.handlers["submit"](tuple(values), False)
    assert "Nothing was started" in out[-3] and "training.batch_size" in out[-3]
    assert out[-2].selected == "training"  # shows the tab with the problem
    assert list_run_dirs(app.workspace) == before


def test_bad_table_cell_names_row_and_column(app):
    values = form_values(app, load_config(preset="demo"))
    idx = [s.key for s in app.form.specs].index("data.concepts")
    table = [list(r) for r in values[idx]]
    table[0][[c.key for c in app.form.specs[idx].items].index("repeats")] = "lots"
    values[idx] = table
    message = app.handlers["validate"](*values)[-1]
    assert "data.concepts.0.repeats" in message and "not a number" in message


def test_check_settings_names_every_problem_at_once(app):
    """A cell the form cannot read, a value out of range, a missing folder and a warning: Check settings names each
    (it stopped at the first), the cell's field once."""
    values = set_value(app, form_values(app, load_config(preset="demo", overrides=["lora.alpha=64"])),
                       "training.batch_size", 0)
    idx = [s.key for s in app.form.specs].index("data.concepts")
    columns = [c.key for c in app.form.specs[idx].items]
    table = [list(r) for r in values[idx]]
    table[0][columns.index("repeats")] = "lots"
    table[0][columns.index("path")] = "/no/such/folder"
    values[idx] = table
    message = app.handlers["validate"](*values)[-1]
    for key in ("data.concepts.0.repeats", "training.batch_size", "data.concepts.0.path", "lora.alpha"):
        assert f"`{key}`" in message, (key, message)
    assert message.count("`data.concepts.0.repeats`") == 1 and "does not exist" in message


def test_unknown_key_in_a_loaded_yaml_is_named_and_the_form_kept(app, tmp_path):
    bad = app.workspace / "bad.yaml"
    bad.write_text("training:\n  learning_rat: 0.1\n")
    out = app.handlers["load_file"](str(bad))
    assert "training.learning_rat" in out[-1] and "Did you mean 'training.learning_rate'" in out[-1]
    assert "form was not changed" in out[-1] and _skipped(out, len(out) - 1)


def test_invalid_yaml_is_refused_and_the_form_kept(app, tmp_path):
    bad = app.workspace / "broken.yaml"
    bad.write_text("training: [unclosed\n  epochs: 3\n")
    out = app.handlers["load_file"](str(bad))
    assert "not valid YAML" in out[-1] and _skipped(out, len(out) - 1)
    out = app.handlers["load_file"](str(app.workspace / "missing.yaml"))
    assert "does not exist" in out[-1]
    out = app.handlers["upload"](str(bad))
    assert "not valid YAML" in out[-1] and _skipped(out, len(out) - 1)


def test_out_of_range_value_in_a_loaded_yaml_is_named(app, tmp_path):
    bad = app.workspace / "range.yaml"
    bad.write_text("base: demo\nlora:\n  rank: 0\n")
    out = app.handlers["load_file"](str(bad))
    assert "lora.rank" in out[-1] and _skipped(out, len(out) - 1)


def test_warnings_are_shown_but_do_not_block_start(app):
    values = form_values(app, load_config(preset="demo", overrides=["lora.alpha=8", "general.run_name=warn"]))
    message = app.handlers["validate"](*values)[-1]
    assert "lora.alpha" in message and "Warnings" in message
    out = app.handlers["submit"](tuple(values), False)
    assert "Started" in out[-3] and "lora.alpha" in out[-3]
    run_dir = app.workspace / "runs" / "warn"
    written = load_config(run_dir / "config.yaml")
    assert written.lora.alpha == 8 and written.general.workspace == str(app.workspace)
    from test_webui_runner import state_of, wait_for
    wait_for(lambda: state_of(run_dir) == "finished", 60, "the fake run")


def test_draft_autosave_survives_a_restart(app, tmp_path):
    values = form_values(app, load_config(preset="demo"))
    values = set_value(app, values, "general.run_name", "half-typed")
    values = set_value(app, values, "training.learning_rate", 50.0)  # invalid, kept anyway
    app.handlers["save_draft"](*values)
    draft = yaml.safe_load(app.draft_path.read_text())
    assert draft["general"]["run_name"] == "half-typed" and draft["training"]["learning_rate"] == 50.0
    restarted = build_app(app.workspace, manager=app.manager, start_scheduler=False).atelier
    loaded = plain(restarted.handlers["on_load"]())
    keys = [s.key for s in restarted.form.specs]
    assert loaded[keys.index("general.run_name")] == "half-typed"
    assert loaded[keys.index("training.learning_rate")] == 50.0
    concepts = loaded[keys.index("data.concepts")]
    assert concepts and concepts[0][0] == "shapes"


def test_lenient_values_fall_back_to_defaults():
    specs = [s for s in sw.all_specs() if not s.hidden]
    raw = {"training": {"epochs": "many", "batch_size": 4}, "bogus": {"x": 1}}
    values = dict(zip([s.key for s in specs], sw.lenient_values(raw, specs)))
    assert values["training.epochs"] == TrainingConfig.epochs and values["training.batch_size"] == 4


def test_optional_number_blank_means_none(app):
    values = form_values(app, load_config(preset="demo"))
    key = "parts.denoiser.learning_rate"
    assert values[[s.key for s in app.form.specs].index(key)] is None
    data, errors = app.form.collect(values)
    assert not errors and data["parts"]["denoiser"]["learning_rate"] is None
    data, errors = app.form.collect(set_value(app, values, "training.epochs", None))
    assert errors and errors[0].key == "training.epochs" and "empty" in errors[0].message


def test_path_of_the_file_browser_is_limited_to_allowed_roots(app, tmp_path):
    roots = app.roots
    assert roots.allowed(app.workspace / "runs") and not roots.allowed("/etc")
    choices, _ = roots.listing(Path("/etc"))
    assert choices == []
    choices, _ = roots.listing(PRESETS_DIR)
    assert any(Path(v).name == "demo.yaml" for _, v in choices)
    out = app.browser._use(0, "/etc/passwd")
    assert all(isinstance(o, dict) and "value" not in o for o in out[1:])
