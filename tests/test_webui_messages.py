"""The page's messages belong to their cause: Quick start names every wrong input and is not followed by a "looks
good" about the form it did not change; a queued job says where it waits; the Queue tab shows the running job's
progress; the learning-rate chart names a family's parts; a TERM signal to the UI stops its TensorBoard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gradio as gr
import pytest

from trainer.config.checks import load_config
from webui.jobqueue import Job
from webui.monitor import RunView
from webui.tabs.config_bar import queued_note
from webui.tabs.quickstart import STEPS, fill
from webui.tabs.queue import now_running
from webui.tabs.run import lr_frame

ROOT = Path(__file__).resolve().parent.parent


def _blocks(block):
    yield block
    for child in getattr(block, "children", None) or []:
        yield from _blocks(child)


def test_quick_start_names_every_wrong_input_and_check_settings_then_says_it_was_not_applied(ui_app, tmp_path):
    ws, ctx = ui_app
    message = fill("sd15", "LoRA", str(tmp_path / "nope.safetensors"), str(tmp_path / "no-folder"), None)[2]
    assert "does not exist" in message and "is not a folder" in message, message  # both, in one answer
    assert f"- Error: {STEPS[3]}" in message and f"- Error: {STEPS[4]}" in message and "Nothing was filled" in message
    assert fill("", "LoRA", "", "", None)[2].count("- Error:") == 1  # no model kind: that alone (the demo's inputs)

    out = ctx.handlers["quickstart_fill"]("sd15", "LoRA", str(tmp_path / "nope.safetensors"), "", None)
    refused = out[-1]
    assert refused == out[-3] and "Give the folder" in refused and "does not exist" in refused
    assert all(isinstance(o, type(gr.skip())) for o in out[:-3])  # the form is as it was

    values = ctx.form.values_for(load_config(preset="demo"))
    plain = ctx.handlers["validate_shown"](*values, "")[-1]
    assert plain.startswith("OK: Settings look good")
    after = ctx.handlers["validate_shown"](*values, refused)[-1]
    assert "not applied" in after and "looks good" not in after and "no problems" in after

    # the steps are numbered in the order they are laid out, and no GPU memory is made up on a machine without one
    fields = [b for b in _blocks(ctx["quickstart"]) if getattr(b, "elem_id", "") in
              ("qs-kind", "qs-what", "qs-card", "qs-model", "qs-images")]
    assert [f.label[0] for f in fields] == list(STEPS), [f.label for f in fields]
    card = next(f for f in fields if f.elem_id == "qs-card")
    from webui import devices
    gpus, _ = devices.detect_gpus()
    assert card.value == (round(gpus[0].memory_mib / 1024) if gpus else None)


def _run(ws: Path, name: str, config: str, events: list) -> Path:
    run = ws / "runs" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_a_queued_job_says_where_it_waits_and_the_queue_shows_the_running_jobs_progress(ui_app, monkeypatch):
    ws, ctx = ui_app
    for job in ctx.manager.queue.list():
        ctx.manager.queue.remove(job.id)
    first, second = Job(name="first"), Job(name="second")
    ctx.manager.queue.add(first)
    assert "position 1 in the queue, it starts within a few seconds" in queued_note(ctx, first)
    running = _run(ws, "busy", "model:\n  path: builtin:tiny-sd\n",
                   [{"type": "started", "time": time.time(), "total_steps": 10}]
                   + [{"type": "step", "step": i, "total_steps": 10, "loss": 0.5, "time": time.time()}
                      for i in (1, 2, 3)])
    monkeypatch.setattr(ctx.manager, "active_runs", lambda: [running])
    ctx.manager.queue.remove(first.id)  # the scheduler started it
    ctx.manager.queue.add(second)
    note = queued_note(ctx, second)
    assert "position 1" in note and "behind the running **busy**" in note, note
    text = now_running(ctx)
    assert "**busy**" in text and "step 3 / 10 (30 %)" in text and "loss 0.5" in text, text
    ctx.manager.queue.remove(second.id)


def test_the_learning_rate_chart_names_the_parts_as_the_family_does(tmp_path):
    points = [(1, "unet", 1e-4), (1, "text_encoder", 5e-5), (1, "embedding", 1e-3)]
    flux = _run(tmp_path, "flux", "model:\n  path: builtin:tiny-flux\n", [])
    frame = lr_frame(RunView(name="flux", path=flux, lr_points=points))
    assert set(frame["series"]) == {"Transformer", "CLIP-L", "embedding"}
    sd = _run(tmp_path, "sd", "model:\n  path: builtin:tiny-sd\n", [])
    assert "UNet" in set(lr_frame(RunView(name="sd", path=sd, lr_points=points))["series"])
    unknown = _run(tmp_path, "unknown", "model:\n  path: org/some-model\n", [])  # told only when it loads
    assert set(lr_frame(RunView(name="unknown", path=unknown, lr_points=points))["series"]) == \
        {"unet", "text_encoder", "embedding"}


STOPPED_BY_TERM = """
import subprocess, sys, time
from pathlib import Path
from webui.tensorboard import TensorBoard, stop_with_this_process
board = TensorBoard(Path(sys.argv[1]))
board.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
stop_with_this_process(board)
try:
    print(board.proc.pid, flush=True)
    while True:  # as the page's serving loop does
        time.sleep(0.1)
except KeyboardInterrupt:
    pass
finally:
    board.stop()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_term_signal_to_the_ui_stops_its_tensorboard(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ui = subprocess.Popen([sys.executable, "-c", STOPPED_BY_TERM, str(tmp_path)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, text=True)
    board_pid = int(ui.stdout.readline())
    ui.send_signal(signal.SIGTERM)
    assert ui.wait(timeout=60) == 0
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(board_pid, 0)
        except ProcessLookupError:
            return
        done = subprocess.run(["ps", "-o", "stat=", "-p", str(board_pid)], capture_output=True, text=True)
        if done.stdout.strip().startswith("Z") or not done.stdout.strip():
            return
        time.sleep(0.1)
    raise AssertionError("TensorBoard outlived the UI")


def _finished_run(ws: Path, name: str, model: str, groups: list) -> Path:
    t = time.time()
    steps = [{"type": "step", "step": i, "total_steps": 3, "loss": 0.5 / i, "time": t + i,
              "lr": {g: 1e-4 for g in groups}} for i in (1, 2, 3)]
    return _run(ws, name, f"model:\n  path: {model}\n",
                [{"type": "started", "time": t, "total_steps": 3}, *steps,
                 {"type": "finished", "time": t + 4, "step": 3}])


def test_the_live_charts_are_emptied_then_drawn_anew_when_the_run_shown_changes(ui_app):
    """Gradio's native plot keeps the colour domain of its first data: switching from an SD run to a transformer
    run once kept the SD legend and left "Transformer" undrawn. The poll empties the charts when the run changes
    and names the run in ``charts_of``, whose change polls again and draws them; empty charts are drawn at once."""
    ws, ctx = ui_app
    _finished_run(ws, "sd-run", "builtin:tiny-sd", ["unet", "text_encoder"])
    _finished_run(ws, "flux-run", "builtin:tiny-flux", ["unet"])
    poll = ctx.handlers["poll"]
    drawn = poll("sd-run", "newest first", {})  # empty charts (a new page): drawn at once
    assert set(drawn[2]["series"]) == {"UNet", "CLIP text encoder"} and set(drawn[1]["series"]) == {"loss", "smoothed"}
    assert isinstance(drawn[-3], type(gr.skip()))  # no second event
    switched = poll("flux-run", "newest first", drawn[-2])
    assert switched[1] is None and switched[2] is None and switched[-3] == "flux-run"  # emptied; charts_of redraws
    again = poll("flux-run", "newest first", switched[-2])
    assert set(again[2]["series"]) == {"Transformer"} and isinstance(again[-3], type(gr.skip()))


def test_resume_on_the_live_panel_is_always_clickable_and_says_why_there_is_nothing_to_resume(ui_app, monkeypatch):
    ws, ctx = ui_app
    button = next(b for b in _blocks(ctx["tabs"])
                  if getattr(b, "elem_id", "") == "run-resume-btn")
    assert button.interactive is not False
    resume = ctx.handlers["run_resume"]
    monkeypatch.setattr(ctx, "resolve_watched", lambda name: None)
    assert resume("(follow the current run)")[0].startswith("Nothing to resume: no run is chosen")
    monkeypatch.undo()
    _finished_run(ws, "done", "builtin:tiny-sd", ["unet"])
    assert "finished at step 3: there is nothing left to resume" in resume("done")[0]
    busy = _run(ws, "busy2", "model:\n  path: builtin:tiny-sd\n", [{"type": "started", "time": time.time()}])
    monkeypatch.setattr("webui.runner.process_alive", lambda run_dir: run_dir == busy)
    assert resume("busy2")[0] == "Nothing to resume: **busy2** is still running."
    for out in (resume("done"), resume("busy2")):
        assert "\n" not in out[0]  # one line


def test_start_training_is_only_on_the_train_tab(ui_app):
    """One Start button, on Train beside Check settings and Add to queue: the other task tabs show none."""
    _, ctx = ui_app
    tabs = {t.id: t for t in ctx["tabs"].children if isinstance(t, gr.Tab)}
    assert set(tabs) == {"train", "run", "data", "tools"}
    starts = {key: [b for b in _blocks(tab) if isinstance(b, gr.Button) and "start" in str(b.value).lower()]
              for key, tab in tabs.items()}
    assert [b.elem_id for b in starts["train"]] == ["start-btn"]
    assert not any(starts[k] for k in ("run", "data", "tools"))


def test_each_event_shows_its_progress_on_one_component_at_most(ui_app):
    """What the browser is told: Gradio's page re-reads, after every status message of any event, each component
    some event has shown progress on since the page loaded (and everything inside it). On the form's fields and
    the tab bar that cost 0.3-0.45 s of script per event on a 2-core machine (docs/performance.md, "While a run is
    shown": the measurements before and after)."""
    from gradio.blocks import BlockContext
    _, ctx = ui_app
    page = ctx["preset"]
    while getattr(page, "parent", None) is not None:
        page = page.parent
    blocks = {b._id: b for b in page.blocks.values()}
    shown = set()
    for dep in page.get_config_file()["dependencies"]:
        targets = dep["outputs"] if dep.get("show_progress_on") is None else dep["show_progress_on"]
        assert len(targets) <= 1, (dep["id"], len(targets))
        if dep["show_progress"] == "hidden":
            assert targets == [], dep["id"]
        shown.update(targets)
    assert shown  # the events that show progress still do
    for t in shown:  # a layout as target is re-read with all it holds: none holds more than the file browser
        if isinstance(blocks[t], BlockContext):
            assert len(list(_blocks(blocks[t]))) < 20, blocks[t]
