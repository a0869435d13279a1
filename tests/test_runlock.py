"""One trainer per run folder: a second one refuses, naming the holder; a dead holder's lock is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.train.runlock import RunFolderBusy, acquire, holder, release

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys, time; from trainer.train.runlock import acquire; acquire(sys.argv[1]); print('locked', flush=True); "
        "time.sleep(120)")


def _hold(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_holder_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "runs" / "r"
    proc = _hold(run)
    try:
        with pytest.raises(RunFolderBusy, match=f"pid {proc.pid}"):
            acquire(run)
        assert holder(run)["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    acquire(run)  # the killed holder left its file, but not its lock
    assert holder(run)["pid"] == os.getpid()
    release(run)


def test_the_cli_refuses_a_busy_run_folder_before_touching_it(tmp_path, capsys):
    from trainer.__main__ import main as cli
    run = tmp_path / "runs" / "busy"
    proc = _hold(run)
    try:
        args = ["train", "--preset", "demo", "--run-dir", str(run), "--no-progress",
                "--set", f"general.workspace={tmp_path}"]
        assert cli(args) == 2
        err = capsys.readouterr().err
        assert "in use by another trainer" in err and f"pid {proc.pid}" in err
        assert sorted(p.name for p in run.iterdir()) == ["trainer.lock"]  # no events, config or log written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_an_unwritable_run_folder_is_one_clear_message(tmp_path, capsys):
    from trainer.__main__ import main as cli
    if os.geteuid() == 0:  # root writes anywhere: make the parent a file instead
        parent = tmp_path / "a-file"
        parent.write_text("x")
    else:
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o500)
    assert cli(["train", "--preset", "demo", "--run-dir", str(parent / "run"), "--no-progress",
                "--set", f"general.workspace={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "cannot create or write the run folder" in err and "Traceback" not in err
