"""The page never reads or writes files outside its folders: Load file, Save to file and the Run tab's run
chooser all go through one check (webui/context.py ``AppContext.confined`` / ``run_dir``)."""

from __future__ import annotations

import os
from pathlib import Path


from trainer.config.checks import load_config
from trainer.config.load import PRESETS_DIR
from webui.app import build_app


def _values(ctx):
    return ctx.form.values_for(load_config(preset="demo"))


def test_load_file_reads_only_inside_the_allowed_folders(ui_app, tmp_path):
    ws, ctx = ui_app
    secret = tmp_path / "secret.yaml"
    secret.write_text("model:\n  path: my-secret-token-123\n")
    message = ctx.handlers["load_file"](str(secret))[-1]
    assert "outside the folders this page may read" in message and "my-secret-token-123" not in message
    assert "--browse-root" in message
    message = ctx.handlers["load_file"]("/etc/passwd")[-1]
    assert "outside the folders" in message and "root:" not in message
    link = ws / "innocent.yaml"  # a link inside the workspace to a file outside it is outside
    os.symlink(secret, link)
    assert "outside the folders" in ctx.handlers["load_file"](str(link))[-1]
    # inside: a missing file has its own message; a real config loads
    assert "does not exist" in ctx.handlers["load_file"]("nope.yaml")[-1]
    mine = ws / "mine.yaml"
    mine.write_text("base: demo\ntraining:\n  epochs: 3\n")
    assert "Loaded" in ctx.handlers["load_file"]("mine.yaml")[-1]
    assert "Loaded" in ctx.handlers["load_file"](str(PRESETS_DIR / "demo.yaml"))[-1]  # presets: readable


def test_save_file_writes_only_inside_the_workspace_and_browse_roots(ui_app, tmp_path):
    ws, ctx = ui_app
    outside = tmp_path / "evil.yaml"
    message = ctx.handlers["save_file"](str(outside), *_values(ctx))
    assert message.startswith("Error: Not saved") and "outside the folders this page may write" in message
    assert not outside.exists()
    preset = PRESETS_DIR / "demo.yaml"
    before = preset.read_bytes()
    assert "outside the folders" in ctx.handlers["save_file"](str(preset), *_values(ctx))
    assert preset.read_bytes() == before  # Atelier's presets are never overwritten from the page
    assert "Saved" in ctx.handlers["save_file"]("configs/run.yaml", *_values(ctx))
    assert (ws / "configs" / "run.yaml").is_file()


def test_the_run_chooser_shows_only_runs_of_the_workspace(ui_app, tmp_path):
    ws, ctx = ui_app
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "train.log").write_text("secret log line\n")
    assert ctx.run_dir(str(other)) is None and ctx.run_dir("..") is None and ctx.run_dir("../elsewhere") is None
    (ws / "runs" / "r1").mkdir(parents=True)
    (ws / "runs" / "r1" / "train.log").write_text("my own run\n")
    assert ctx.run_dir("r1") == Path(ws / "runs" / "r1")
    shown = " ".join(str(v) for v in ctx.handlers["poll"](str(other), "newest first", {}))
    assert "secret log line" not in shown and "my own run" in shown  # falls back to the workspace's newest run


def test_the_browser_reaches_home_and_browse_roots_and_names_a_missing_concept_folder(tmp_path, monkeypatch):
    home, extra, ws = tmp_path / "home", tmp_path / "data-disk", tmp_path / "ws"
    for d in (home / "pictures" / "cats", extra):
        d.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    ctx = build_app(ws, browse_roots=[extra], start_scheduler=False).atelier
    assert [ctx.roots.allowed(p) for p in (ws, home / "pictures" / "cats", extra, tmp_path, "/etc")] == \
        [True, True, True, False, False]
    preview = ctx.handlers["concept_preview"]
    assert "does not exist" in preview(str(home / "pictures" / "dogs"), False, "txt_file", ".txt", "")[0]
    assert "outside the folders" in preview(str(tmp_path / "elsewhere"), False, "txt_file", ".txt", "")[0]
    assert preview(str(home / "pictures" / "cats"), False, "txt_file", ".txt", "")[0].startswith("0 images")
    monkeypatch.setenv("HOME", "/")  # a home that is the disk's root is not a root of the browser
    assert not build_app(ws, start_scheduler=False).atelier.roots.allowed("/etc")
