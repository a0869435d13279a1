"""The web UI's runner: start, tail, stop, reattach, explain deaths, queue — against a fake
trainer script that speaks the run-folder contract, and once against the real demo preset."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List

import pytest
import yaml

from webui import runner
from webui.jobqueue import Job, JobQueue
from webui.monitor import OOM_ADVICE, RunMonitor
from webui.runner import RunManager

pytestmark = pytest.mark.slow

FAKE_TRAINER = r'''
"""Fake ``python -m trainer train CONFIG --run-dir DIR [--resume X]`` for the UI's runner tests.
Mode from general.run_name: crash (error+failed, exit 1), oom (SIGKILLs itself), badcfg (exit 2),
slowstop (ignores a stop request: control/stop and SIGINT). Steps: training.max_steps; FAKE_STEP_SECONDS per step."""
import json, os, signal, sys, time
from pathlib import Path
import yaml

def main(argv):
    config = Path(argv[1])
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else ""
    cfg = yaml.safe_load(config.read_text()) or {}
    mode = (cfg.get("general") or {}).get("run_name") or ""
    total = int((cfg.get("training") or {}).get("max_steps") or 20)
    delay = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    if "badcfg" in mode:
        print("error: 'training.epochs' = 0 is out of range", file=sys.stderr)
        return 2
    (run_dir / "trainer.pid").write_text(json.dumps({"pid": os.getpid(), "pgid": getattr(os, "getpgid", lambda _: None)(0)}))
    events = open(run_dir / "events.jsonl", "a")
    log = open(run_dir / "train.log", "a")

    def emit(type, **kw):
        events.write(json.dumps({"type": type, "time": time.time(), **kw}) + "\n"); events.flush()
        log.write(f"INFO {type} {kw}\n"); log.flush()

    stop = {"flag": False}
    if "slowstop" in mode:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda *a: stop.update(flag=True))
        signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=True))
    start = 0
    if resume:
        backups = sorted((run_dir / "backups").glob("backup-step*"))
        src = Path(resume) if resume != "last" else backups[-1]
        start = int(src.name.split("step")[1])
    emit("started", total_steps=total, epochs=1, steps_per_epoch=total, batch_size=1,
         resumed_from_step=start, dataset={})

    def backup(step):
        d = run_dir / "backups" / f"backup-step{step:06d}"
        d.mkdir(parents=True, exist_ok=True)
        emit("backup", step=step, path=str(d))

    def sample(step):
        (run_dir / "samples").mkdir(exist_ok=True)
        paths = []
        for i in range(2):
            p = run_dir / "samples" / f"step{step:06d}-p{i}.png"
            p.write_bytes(PNG)
            paths.append(str(p))
        emit("sample", step=step, epoch=1, paths=paths, prompts=["a red square", "a blue circle"])

    for step in range(start + 1, total + 1):
        time.sleep(delay)
        if "crash" in mode and step == 3:
            emit("error", message="RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
                 traceback="Traceback (most recent call last):\nRuntimeError: CUDA out of memory")
            emit("failed", step=step, message="RuntimeError: CUDA out of memory.")
            return 1
        if "oom" in mode and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("step", step=step, total_steps=total, epoch=1, loss=1.0 / step, lr={"unet": 1e-4},
             it_s=10.0, eta_s=(total - step) * delay)
        ctrl = run_dir / "control"
        if (ctrl / "sample").exists():
            sample(step); (ctrl / "sample").unlink()
        if (ctrl / "backup").exists():
            backup(step); (ctrl / "backup").unlink()
        if step % 5 == 0:
            sample(step)
        if (ctrl / "stop").exists() and "slowstop" not in mode:
            (ctrl / "stop").unlink(); stop["flag"] = True
        if stop["flag"]:
            backup(step)
            emit("stopped", step=step, message="stopped by signal")
            return 0
    sample(total)
    (run_dir / "model.safetensors").write_bytes(b"x")
    emit("saved", step=total, path=str(run_dir / "model.safetensors"), format="safetensors")
    emit("finished", step=total, message="done")
    return 0

# a 1x1 red PNG
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415408d763f8cfc000"
                    "000301010018dd8db00000000049454e44ae426082")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def fake_trainer_argv(folder: Path) -> List[str]:
    """The fake trainer written to ``folder``, as the manager's trainer command prefix."""
    script = folder / "fake_trainer.py"
    script.write_text(FAKE_TRAINER, encoding="utf-8")
    return [sys.executable, str(script)]


def fake_config(name: str = "", steps: int = 20) -> str:
    return yaml.safe_dump({"general": {"run_name": name}, "training": {"max_steps": steps}})


def wait_for(pred: Callable[[], bool], timeout: float, what: str = "") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def manager(tmp_path, monkeypatch) -> RunManager:
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.05")
    m = RunManager(tmp_path / "ws", trainer_argv=fake_trainer_argv(tmp_path), stop_timeout=60)
    yield m
    for run_dir in m.active_runs():  # never leave a trainer behind
        runner.stop(run_dir, force=True)


def start(m: RunManager, name: str = "", steps: int = 20) -> Path:
    status, run_dir, _ = m.submit(Job(name=name or "run", config_yaml=fake_config(name, steps)))
    assert status == "started" and run_dir is not None
    return run_dir


def state_of(run_dir: Path) -> str:
    return RunMonitor().view(run_dir).state


def test_start_tail_and_finish(manager):
    run_dir = start(manager, steps=12)
    assert (run_dir / "config.yaml").exists() and (run_dir / runner.LAUNCH).exists()
    info = json.loads((run_dir / runner.LAUNCH).read_text())
    assert os.getpgid(info["pid"]) == info["pgid"] != os.getpgid(0)  # its own process group
    monitor = RunMonitor()
    seen_running = []
    end = time.time() + 30
    while time.time() < end:
        view = monitor.view(run_dir)  # incremental tail, like the UI's timer
        seen_running.append(view.state)
        if view.state == "finished":
            break
        time.sleep(0.05)
    assert view.state == "finished", view
    assert view.step == view.total_steps == 12
    assert [s for s, _ in view.loss_points] == list(range(1, 13))
    assert view.lr_points[0] == (1, "unet", 1e-4)
    assert view.outputs and view.samples
    assert {s.prompt_index for s in view.samples} == {0, 1}
    assert view.samples[-1].prompt == "a blue circle" and "step 12" in view.samples[-1].caption
    wait_for(lambda: (run_dir / runner.EXIT).exists(), 10, "exit.json")
    assert json.loads((run_dir / runner.EXIT).read_text())["returncode"] == 0
    # exit.json is written by the supervisor just before it exits itself: the run leaves the active list then
    wait_for(lambda: manager.active_runs() == [], 10, "the run to leave the active list")


def test_stop_finishes_the_step_writes_a_backup_and_reports_stopped(manager, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.2")
    run_dir = start(manager, steps=500)
    wait_for(lambda: RunMonitor().view(run_dir).step >= 2, 30, "two steps")
    assert "Stopping" in runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped", 30, "stopped")
    view = RunMonitor().view(run_dir)
    assert view.backups and Path(view.backups[-1]).is_dir()
    assert 2 <= view.step < 500
    wait_for(lambda: not runner.process_alive(run_dir), 10, "process exit")


def test_second_stop_kills_and_is_explained(manager):
    run_dir = start(manager, name="slowstop", steps=100000)
    wait_for(lambda: state_of(run_dir) == "running", 30, "running")
    runner.stop(run_dir)
    assert state_of(run_dir) == "stopping"
    assert "Killed" in runner.stop(run_dir)  # second press: the process tree is killed
    wait_for(lambda: not runner.process_alive(run_dir), 10, "killed")
    view = RunMonitor().view(run_dir)
    assert view.state == "died" and "force-stopped" in view.message


def test_stop_timeout_escalates_to_kill(tmp_path, monkeypatch):
    m = RunManager(tmp_path / "ws", trainer_argv=fake_trainer_argv(tmp_path), stop_timeout=0.5)
    status, run_dir, _ = m.submit(Job(name="s", config_yaml=fake_config("slowstop", 100000)))
    wait_for(lambda: state_of(run_dir) == "running", 30, "running")
    runner.stop(run_dir)
    time.sleep(1.0)
    m.tick()  # the scheduler's step: past the timeout → SIGKILL
    wait_for(lambda: not runner.process_alive(run_dir), 10, "killed after the timeout")


def test_a_restarted_ui_reattaches_to_the_running_job(manager, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.2")
    run_dir = start(manager, steps=500)
    wait_for(lambda: RunMonitor().view(run_dir).step >= 1, 30, "a step")
    # a brand-new manager and monitor on the same workspace = the UI after a restart
    again = RunManager(manager.workspace, trainer_argv=manager.trainer_argv)
    assert again.active_runs() == [run_dir]
    assert again.busy()
    status, _, _ = again.submit(Job(name="next", config_yaml=fake_config()))
    assert status == "queued"  # one trainer at a time
    view = RunMonitor().view(run_dir)
    assert view.state == "running" and view.total_steps == 500
    runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped", 30, "stopped")


def test_crash_shows_the_error_and_memory_advice(manager):
    run_dir = start(manager, name="crash")
    wait_for(lambda: state_of(run_dir) == "failed", 30, "failed")
    view = RunMonitor().view(run_dir)
    assert "out of memory" in view.message and "Traceback" in view.traceback
    assert view.advice == OOM_ADVICE and "batch size" in view.advice


def test_death_without_a_failed_event_is_explained_in_plain_words(manager):
    run_dir = start(manager, name="oom")
    wait_for(lambda: state_of(run_dir) == "died", 30, "died")
    wait_for(lambda: (run_dir / runner.EXIT).exists(), 10, "exit.json")
    view = RunMonitor().view(run_dir)
    assert json.loads((run_dir / runner.EXIT).read_text())["returncode"] == -signal.SIGKILL
    assert "out-of-memory" in view.message and "SIGKILL" in view.message
    for advice in ("batch size", "gradient checkpointing", "mixed precision", "resolution"):
        assert advice in view.advice


def test_refused_config_shows_the_trainers_message(manager):
    run_dir = start(manager, name="badcfg")
    wait_for(lambda: state_of(run_dir) == "died", 30, "died")
    view = RunMonitor().view(run_dir)
    assert "refused the configuration" in view.message and "training.epochs" in view.message


def test_sample_now_and_backup_now(manager, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.1")
    run_dir = start(manager, steps=400)
    wait_for(lambda: RunMonitor().view(run_dir).step >= 1, 30, "a step")
    assert "sample" in runner.request_action(run_dir, "sample")
    assert "backup" in runner.request_action(run_dir, "backup")
    wait_for(lambda: not (run_dir / "control" / "backup").exists(), 20, "backup taken")
    wait_for(lambda: not (run_dir / "control" / "sample").exists(), 20, "sample taken")
    view = RunMonitor().view(run_dir)
    assert view.backups and view.samples
    runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped", 30, "stopped")


def test_resume_continues_in_the_same_folder(manager, monkeypatch):
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.1")
    run_dir = start(manager, steps=30)
    wait_for(lambda: RunMonitor().view(run_dir).step >= 3, 30, "three steps")
    runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped", 30, "stopped")
    wait_for(lambda: not runner.process_alive(run_dir), 10, "exit")
    stopped_at = RunMonitor().view(run_dir).step
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.01")
    status, same, _ = manager.submit(Job(name=run_dir.name, kind="resume", run_dir=str(run_dir), resume="last"))
    assert status == "started" and same == run_dir
    cmd = json.loads((run_dir / runner.LAUNCH).read_text())["cmd"]
    assert cmd[-2:] == ["--resume", "last"] and cmd[cmd.index("--run-dir") + 1] == str(run_dir)
    wait_for(lambda: state_of(run_dir) == "finished", 30, "finished after resume")
    view = RunMonitor().view(run_dir)
    assert view.step == 30 and [s for s, _ in view.loss_points] == list(range(1, 31))
    assert stopped_at < 30


def test_a_run_just_started_counts_as_running_before_its_process_shows_its_command(manager, monkeypatch):
    """Between fork and exec a new child's /proc command line is still the page's own, which the pid check does not
    take for a trainer: the page's own running child counts all the same, so a second Start queues instead of
    starting beside the first (on a busy box the page said no run was active)."""
    monkeypatch.setattr(runner, "_looks_like_ours", lambda pid: False)
    first = start(manager, name="a", steps=5)
    assert manager.busy() and manager.active_runs() == [first]
    status, _, _ = manager.submit(Job(name="b", config_yaml=fake_config("b", 5)))
    assert status == "queued"
    monkeypatch.undo()
    wait_for(lambda: state_of(first) == "finished", 30, "the first run to finish")


def test_queue_runs_in_order_reorders_cancels_and_persists(manager):
    first = start(manager, name="q1", steps=200)  # long enough to be running while three jobs queue on a busy box
    wait_for(lambda: state_of(first) == "running" or not manager.busy(), 60, "q1 to run")
    assert manager.busy(), (state_of(first), (first / runner.PROCESS_LOG).read_text()[-2000:])
    jobs = [Job(name=f"q{i}", config_yaml=fake_config(f"q{i}", 5)) for i in (2, 3, 4)]
    for job in jobs:
        status = manager.submit(job)[0]
        assert status == "queued", (job.name, status, state_of(first), (first / runner.PROCESS_LOG).read_text()[-2000:])
    manager.queue.move(jobs[2].id, -2)           # q4 to the front
    manager.queue.remove(jobs[0].id)             # cancel q2
    on_disk = JobQueue(manager.workspace / "queue.json").list()  # what a restarted UI sees
    assert [j.name for j in on_disk] == ["q4", "q3"]
    order = []
    end = time.time() + 60
    while time.time() < end and (manager.queue.list() or manager.active_runs()):
        started = manager.tick()
        if started:
            order.append(started.name)
        time.sleep(0.05)
    assert order == ["q4", "q3"]
    names = {d.name: state_of(d) for d in runner.list_run_dirs(manager.workspace)}
    assert names == {"q1": "finished", "q4": "finished", "q3": "finished"}
    assert first.name == "q1"


def test_scheduler_thread_moves_the_queue_without_a_browser(manager):
    start(manager, steps=5)
    manager.submit(Job(name="later", config_yaml=fake_config("", 5)))
    manager.start_scheduler(interval=0.1)
    try:
        wait_for(lambda: (runner.runs_root(manager.workspace) / "later").is_dir(), 30, "queued job started")
        wait_for(lambda: state_of(runner.runs_root(manager.workspace) / "later") == "finished", 30, "done")
    finally:
        manager.shutdown()


def test_real_trainer_runs_the_demo_preset(tmp_path):
    """The contract with the real CLI: ``python -m trainer train config.yaml --run-dir``."""
    from trainer.config.checks import load_config
    from trainer.config.load import to_yaml
    ws = tmp_path / "ws"
    cfg = load_config(preset="demo", overrides=[f"general.workspace={ws}", "training.max_steps=4"])
    m = RunManager(ws)
    status, run_dir, _ = m.submit(Job(name="demo", config_yaml=to_yaml(cfg)))
    assert status == "started"
    monitor = RunMonitor()
    try:
        wait_for(lambda: monitor.view(run_dir).state in ("finished", "failed", "died"), 300, "the demo run")
    finally:
        for d in m.active_runs():
            runner.stop(d, force=True)
    view = monitor.view(run_dir)
    assert view.state == "finished", (view.message, (run_dir / runner.PROCESS_LOG).read_text()[-3000:])
    assert view.step == view.total_steps == 4
    assert view.loss_points and view.samples and view.outputs
    assert all(Path(s.path).exists() for s in view.samples)
    assert (run_dir / "trainer.pid").exists() and (run_dir / "events.jsonl").exists()
