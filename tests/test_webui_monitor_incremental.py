"""The run monitor reads a run's events incrementally and keeps aggregates and bounded curves, not every event:
whatever the order of reads (a file appended to between them, a torn last line completed later, a file truncated,
rewritten in place or replaced, a summary left by the trainer), the view is the one a full read gives."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.events import read_events
from trainer.run_summary import SUMMARY, RunFold, Series, SummaryWriter, summary_path
from webui.monitor import RunMonitor, build_view


def run_events(steps: int = 700, seed: int = 0) -> list:
    """A stopped launch, then a resumed one that repeats steps, with warnings, samples, backups and a result."""
    rng = random.Random(seed)
    t = 1000.0
    out = [{"type": "warning", "message": "a.png is too small", "time": t},
           {"type": "started", "time": t + 1, "total_steps": steps}]
    stop = steps // 2
    for step in range(1, stop + 1):
        out.append({"type": "step", "step": step, "total_steps": steps, "epoch": step // 50, "time": t + step,
                    "loss": round(1 / step + rng.random() * 0.1, 6), "lr": {"unet": 1e-4, "te": 5e-5},
                    "it_s": 2.0, "eta_s": steps - step})
        if step % 100 == 0:
            out.append({"type": "sample", "step": step, "prompts": ["a cat", "a dog"], "time": t + step})
            out.append({"type": "backup", "step": step, "path": f"backups/step{step:06d}", "time": t + step})
    out.append({"type": "stopped", "step": stop, "message": "stopped by you", "time": t + stop})
    out += [{"type": "warning", "message": "resuming with a changed batch size", "time": t + stop + 1},
            {"type": "started", "time": t + stop + 2, "total_steps": steps, "resumed_from_step": stop - 20}]
    for step in range(stop - 19, steps + 1):
        out.append({"type": "step", "step": step, "total_steps": steps, "epoch": step // 50, "time": t + step + 9,
                    "loss": round(1 / step + rng.random() * 0.1, 6), "lr": {"unet": 1e-4 * (1 - step / steps)}})
    out += [{"type": "warning", "message": "late warning", "time": t + steps + 10},
            {"type": "saved", "step": steps, "path": "/out/r.safetensors", "time": t + steps + 11},
            {"type": "finished", "step": steps, "message": "done", "time": t + steps + 12}]
    return out


def lines(events: list) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def comparable(view) -> dict:
    data = dataclasses.asdict(view)
    for key in ("version", "samples_key"):
        data.pop(key)
    return data


def full_read(run: Path) -> dict:
    return comparable(build_view(run, read_events(run / "events.jsonl")))


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "runs" / "r"
    (folder / "backups" / "step000300").mkdir(parents=True)
    (folder / "samples").mkdir()
    (folder / "samples" / "step000300-p1.png").write_bytes(b"png")
    return folder


def test_reads_between_appends_and_a_torn_line_give_the_full_reads_view(run):
    data = lines(run_events())
    path = run / "events.jsonl"
    monitor = RunMonitor()
    cuts = sorted({0, 57, 58, 1000, 4096, 20000, len(data) // 2, len(data) - 3, len(data)})
    for a, b in zip(cuts, cuts[1:]):
        with open(path, "ab") as fh:
            fh.write(data[a:b])  # most cuts fall inside a line: the torn end waits for the next read
        complete = data[:b][:data[:b].rfind(b"\n") + 1]
        view = monitor.view(run)
        assert view.loss_count == sum(1 for e in read_events(path) if e["type"] == "step")
        assert comparable(view) == full_read(run), f"after {b} of {len(data)} bytes"
        assert monitor._runs[str(run)].tail.offset == len(complete)
    view = monitor.view(run)
    assert view.state == "finished" and view.step == 700 and view.total_steps == 700
    assert view.warnings == ["resuming with a changed batch size", "late warning"] and view.warning_count == 2
    assert view.backups == ["backups/step000300"] and view.outputs == ["/out/r.safetensors"]
    assert [s.caption for s in view.samples] == ["step 300 · prompt 1: a dog"]


def test_a_file_truncated_rewritten_in_place_or_replaced_is_read_again_from_the_start(run):
    path = run / "events.jsonl"
    events = run_events(200)
    monitor = RunMonitor()
    path.write_bytes(lines(events))
    assert monitor.view(run).state == "finished"
    path.write_bytes(lines(events[:50]))  # shrank
    assert comparable(monitor.view(run)) == full_read(run) and monitor.view(run).step == 48
    with open(path, "r+b") as fh:  # the same inode, longer, other first bytes
        fh.write(lines([{"type": "started", "time": 5.0, "total_steps": 9}] + events[2:80]))
    assert comparable(monitor.view(run)) == full_read(run)
    other = run / "new.jsonl"
    other.write_bytes(lines(events[:120]))
    os.replace(other, path)  # another file under the name
    assert comparable(monitor.view(run)) == full_read(run)
    path.unlink()
    assert monitor.view(run).loss_count == 0


def test_a_fresh_monitor_starts_from_the_trainers_summary_and_reads_only_what_came_after(run):
    path = run / "events.jsonl"
    writer = SummaryWriter(path)
    events = run_events(120)
    for ev in events[:-40]:
        writer.emit(**{k: v for k, v in ev.items() if k != "time"})
    saved = json.loads(summary_path(path).read_text())
    with open(path, "ab") as fh:  # another writer (the launcher's "failed") appends after the last summary
        fh.write(lines(events[-40:-1]) + b'{"type": "step", "st')
    assert saved["offset"] < path.stat().st_size
    monitor = RunMonitor()
    assert comparable(monitor.view(run)) == full_read(run)
    assert monitor._runs[str(run)].tail.offset == path.stat().st_size - len(b'{"type": "step", "st')
    assert comparable(monitor.row(run)) == {**full_read(run), "loss_points": [], "smooth_points": [],
                                            "lr_points": [], "samples": []}
    resumed = SummaryWriter(path)  # a resume: the torn line is cut, the fold carries on
    resumed.emit("finished", step=120)
    fresh = RunMonitor()
    assert comparable(fresh.view(run)) == full_read(run) and fresh.view(run).state == "finished"
    summary_path(path).write_text("{torn")
    assert comparable(RunMonitor().view(run)) == full_read(run)  # a broken summary: the stream itself


def test_the_summary_of_another_file_is_not_trusted(run):
    path = run / "events.jsonl"
    writer = SummaryWriter(path)
    for ev in run_events(60):
        writer.emit(**{k: v for k, v in ev.items() if k != "time"})
    path.write_bytes(lines(run_events(100)[:20]))  # rewritten: the summary describes what was there before
    assert (run / SUMMARY).exists()
    assert comparable(RunMonitor().view(run)) == full_read(run)


def test_bounded_curves_keep_first_last_and_lowest_points():
    rng = random.Random(1)
    series = Series()
    values = [(step, 2.0 + rng.random()) for step in range(1, 20001)]
    values[7777] = (7778, 0.125)  # the lowest loss, mid-run
    for step, value in values:
        series.add(step, value)
    points = series.points()
    assert len(series.buckets) <= series.size and len(points) <= 4 * series.size
    assert points[0] == values[0] and points[-1] == values[-1]
    assert min(v for _, v in points) == 0.125 and (7778, 0.125) in points
    assert [s for s, _ in points] == sorted({s for s, _ in points})
    assert series.count == len(values)
    again = Series.from_dict(json.loads(json.dumps(series.to_dict())))
    assert again.points() == points
    short = Series()
    for step in range(1, 256):
        short.add(step, 1.0 / step)
    assert [s for s, _ in short.points()] == list(range(1, 256))  # a short run charts every point


def test_a_resumed_step_keeps_its_latest_value_like_a_full_list():
    fold = RunFold()
    for ev in [{"type": "step", "step": s, "loss": 1.0} for s in (1, 2, 3)] + [{"type": "step", "step": 2,
                                                                               "loss": 0.5}]:
        fold.add(ev)
    assert fold.loss.points() == [(1, 1.0), (2, 0.5), (3, 1.0)]


def test_the_monitor_keeps_only_the_runs_last_looked_at(tmp_path):
    monitor = RunMonitor(keep=2)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events.jsonl").write_bytes(lines(run_events(40)))
        monitor.view(tmp_path / name)
    assert list(monitor._runs) == [str(tmp_path / "b"), str(tmp_path / "c")]
    assert comparable(monitor.view(tmp_path / "a")) == full_read(tmp_path / "a")


def test_the_runs_table_lists_a_normal_run_as_before(tmp_path):
    from webui.monitor import age
    from webui.tabs.runs import runs_table
    run = tmp_path / "runs" / "r"
    (run / "backups" / "step000030").mkdir(parents=True)
    events = [{"type": "started", "time": 1700000000.0, "total_steps": 30}]
    events += [{"type": "step", "step": i, "total_steps": 30, "loss": 1 / i, "time": 1700000000.0 + i}
               for i in range(1, 31)]
    events += [{"type": "backup", "step": 30, "path": str(run / "backups" / "step000030")},
               {"type": "saved", "step": 30, "path": str(run / "r.safetensors")},
               {"type": "finished", "step": 30, "message": "done", "time": 1700000031.0}]
    (run / "events.jsonl").write_bytes(lines(events))
    table = runs_table(SimpleNamespace(workspace=tmp_path, monitor=RunMonitor()))
    assert table.values.tolist() == [["r", "Finished", "30/30", "0.03333", age(1700000000.0), 1, "r.safetensors"]]


def test_the_change_check_makes_no_output(run, monkeypatch):
    """The page asks every second what the Run tab would show: signatures only, no chart, gallery or log."""
    from webui.tabs import run as run_tab
    (run / "events.jsonl").write_bytes(lines(run_events(60)))
    view = RunMonitor().view(run)
    for name in ("loss_frame", "lr_frame", "gallery_items", "log_tail", "status_html", "problems_md",
                 "download_button"):
        monkeypatch.setattr(run_tab, name, lambda *a, **k: pytest.fail("an output was made"))
    sigs = [sig for _, _, sig in run_tab.parts(SimpleNamespace(), view, "newest first")]
    assert len(sigs) == 9 and all(sigs)


def test_the_trainers_summary_covers_lines_another_writer_appended_while_it_was_open(run):
    from trainer.events import EventWriter
    path = run / "events.jsonl"
    writer = SummaryWriter(path)
    writer.emit("started", total_steps=3)
    EventWriter(path).emit("warning", message="from another process")
    writer.emit("step", step=1, total_steps=3, loss=0.5)
    writer.emit("saved", step=1, path="r.safetensors")
    assert json.loads(summary_path(path).read_text())["offset"] == path.stat().st_size
    assert comparable(RunMonitor().view(run)) == full_read(run)
    assert RunMonitor().view(run).warnings == ["from another process"]


def test_a_long_run_from_before_summaries_gets_one_after_its_first_read(run, monkeypatch):
    import webui.monitor as monitor_module
    monkeypatch.setattr(monitor_module, "SAVE_SUMMARY_BYTES", 10_000)
    path = run / "events.jsonl"
    path.write_bytes(lines(run_events(200)))
    assert not summary_path(path).exists()
    RunMonitor().row(run)  # the Runs table's read leaves a summary without curves
    assert json.loads(summary_path(path).read_text())["fold"]["loss"] is None
    first = RunMonitor()
    assert comparable(first.view(run)) == full_read(run)  # curves wanted: read in full, a summary with curves left
    again = RunMonitor()
    assert comparable(again.view(run)) == full_read(run)
    assert again._runs[str(run)].tail.saved == path.stat().st_size  # started from the summary
