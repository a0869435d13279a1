"""The page's Start path confined to its folders: the page refuses a config whose paths lie outside them (links
resolved), and the trainer it starts refuses the same on its own (a queued job edited on disk, an old run resumed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from test_webui_runner import wait_for
from test_webui_schema import form_values

from trainer.config.checks import load_config
from webui import runner
from webui.app import build_app
from webui.jobqueue import Job
from webui.monitor import RunMonitor
from webui.runner import RunManager, list_run_dirs


def _tree(root: Path) -> list:
    return sorted((str(p), p.stat().st_mtime_ns if p.is_file() else 0) for p in root.rglob("*"))


@pytest.fixture
def page(tmp_path, monkeypatch):
    """A page on a workspace with a home of its own; ``outer`` is a folder outside both, holding images."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    outer = tmp_path / "outer"
    (outer / "data").mkdir(parents=True)
    Image.new("RGB", (64, 64), (10, 200, 30)).save(outer / "data" / "a.png")
    (outer / "data" / "a.txt").write_text("a photo", encoding="utf-8")
    ws = tmp_path / "ws"
    manager = RunManager(ws)  # the real trainer
    ctx = build_app(ws, manager=manager, start_scheduler=False).atelier
    yield ctx, outer
    for run_dir in manager.active_runs():
        runner.stop(run_dir, force=True)


def test_start_refuses_a_config_reaching_outside_and_touches_nothing(page, tmp_path):
    ctx, outer = page
    (ctx.workspace / "linked").symlink_to(outer / "data", target_is_directory=True)  # inside by name only
    before = _tree(outer)
    for overrides, keys in [
        ([f"data.concepts=[{{path: {outer / 'data'}}}]"], ["data.concepts.0.path"]),
        ([f"data.concepts=[{{path: {ctx.workspace / 'linked'}}}]"], ["data.concepts.0.path"]),
        ([f"output.path={outer / 'out'}", f"data.cache_dir={outer / 'cache'}"], ["output.path", "data.cache_dir"]),
        ([f"general.workspace={outer / 'ws'}"], ["general.workspace"]),
    ]:
        values = form_values(ctx, load_config(preset="demo", overrides=overrides))
        assert "outside the folders" in ctx.handlers["validate"](*values)[-1]
        for queue_only in (False, True):
            out = ctx.handlers["submit"](tuple(values), queue_only)
            assert "Nothing was started" in out[-3], out[-3]
            for key in keys:
                assert key in out[-3] and "--browse-root" in out[-3], out[-3]
    assert list_run_dirs(ctx.workspace) == [] and ctx.manager.queue.list() == []
    assert _tree(outer) == before
    # inside the page's folders the same data starts
    values = form_values(ctx, load_config(preset="demo", overrides=["training.max_steps=1", "general.run_name=ok"]))
    out = ctx.handlers["submit"](tuple(values), True)  # queued only: nothing runs in this test
    assert "Queued" in out[-3], out[-3]


def test_the_trainer_the_page_starts_refuses_on_its_own(page, tmp_path):
    """A job that never passed the page's check (the queue file edited, an old run folder): the trainer started
    with the page's folders fails with the fields named, before it writes anything outside them."""
    ctx, outer = page
    before = _tree(outer)
    bad = load_config(preset="demo", overrides=[f"data.concepts=[{{path: {outer / 'data'}}}]",
                                                  f"data.cache_dir={outer / 'cache'}", f"output.path={outer / 'out'}"])
    from trainer.config.load import to_yaml
    status, run_dir, _ = ctx.manager.submit(Job(name="edited", config_yaml=to_yaml(bad)))
    assert status == "started"
    wait_for(lambda: runner.read_json(run_dir / runner.EXIT) is not None, 120, "the refusal")
    view = RunMonitor().view(run_dir)  # what the Run tab shows
    assert "refused the configuration" in view.message, view.message
    for key in ("data.concepts.0.path", "data.cache_dir", "output.path"):
        assert f"{key} = '{outer}" in view.message and "outside the folders" in view.message, view.message
    assert "--allowed-root" in " ".join(runner.read_json(run_dir / runner.LAUNCH)["cmd"])
    assert _tree(outer) == before
