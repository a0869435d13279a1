"""The form remembers each optimizer's settings across switches, and shows only the chosen one's fields."""

from __future__ import annotations

import json

import pytest

from webui.app import build_app
from webui.optimizer_memory import FILE_NAME, OptimizerMemory, field_specs


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from test_webui_runner import fake_trainer_argv
    from webui.runner import RunManager
    ws = tmp_path_factory.mktemp("ws")
    manager = RunManager(ws, trainer_argv=fake_trainer_argv(tmp_path_factory.mktemp("fake")))
    return build_app(ws, manager=manager, start_scheduler=False).atelier


def fields(ctx, **changes):
    """Widget values of the optimizer fields: the defaults with ``changes`` (short keys)."""
    from webui import schema_widgets as sw
    specs = field_specs(ctx.form)
    out = []
    for s in specs:
        short = s.key.rsplit(".", 1)[-1]
        out.append(sw.to_widget(s, changes[short]) if short in changes else sw.to_widget(s, s.default))
    return out


def as_dict(ctx, updates):
    return {s.key.rsplit(".", 1)[-1]: u for s, u in zip(field_specs(ctx.form), updates)}


def test_switching_away_and_back_restores_the_optimizer_settings(app):
    store, switch = app.handlers["optimizer_store"], app.handlers["optimizer_switch"]
    prodigy = fields(app, d_coef=2.0, safeguard_warmup=True, weight_decay=0.01, beta3=0.5)
    store("prodigy", *prodigy)  # the user opens the dropdown while Prodigy is chosen
    saved = json.loads((app.workspace / FILE_NAME).read_text())["prodigy"]
    assert saved["training.optimizer.d_coef"] == 2.0 and saved["training.optimizer.safeguard_warmup"] is True
    assert "training.optimizer.momentum" not in saved  # only the fields Prodigy takes

    # ... and picks AdamW, never set before: values stay, only AdamW's fields are visible
    out = as_dict(app, switch("adamw", *prodigy))
    assert "value" not in out["d_coef"] and out["d_coef"]["visible"] is False
    assert out["beta1"]["visible"] is True and out["amsgrad"]["visible"] is True
    assert out["extra_args"]["visible"] is True

    adamw = fields(app, weight_decay=0.1, amsgrad=True)
    store("adamw", *adamw)
    out = as_dict(app, switch("prodigy", *adamw))  # back to Prodigy: its settings return
    assert out["d_coef"]["value"] == 2.0 and out["safeguard_warmup"]["value"] is True
    assert out["weight_decay"]["value"] == 0.01 and out["beta3"]["value"] == 0.5
    assert out["amsgrad"]["visible"] is False and "value" not in out["amsgrad"]
    out = as_dict(app, switch("adamw", *prodigy))
    assert out["weight_decay"]["value"] == 0.1 and out["amsgrad"]["value"] is True


def test_the_memory_survives_a_new_page_and_ignores_bad_entries(app, tmp_path):
    mem = OptimizerMemory(tmp_path)
    assert mem.recall("lion") is None
    mem.remember("lion", {"training.optimizer.beta1": 0.95})
    mem.remember("no-such-optimizer", {"x": 1})
    assert OptimizerMemory(tmp_path).recall("lion") == {"training.optimizer.beta1": 0.95}
    assert set(json.loads((tmp_path / FILE_NAME).read_text())) == {"lion"}
    (tmp_path / FILE_NAME).write_text("not json")
    assert OptimizerMemory(tmp_path).recall("lion") is None


def test_a_loaded_config_only_changes_which_fields_are_visible(app):
    out = as_dict(app, app.handlers["optimizer_visibility"]("sgd"))
    assert all("value" not in u for u in out.values())
    assert out["momentum"]["visible"] and out["nesterov"]["visible"] and not out["beta1"]["visible"]
