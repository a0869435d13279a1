"""Starts ``python -m trainer train`` as a detached subprocess, finds it again, and stops it.

The run folder is the state: the UI writes ``config.yaml`` and ``launch.json`` (the supervisor's
pid = the process group id), the trainer writes ``trainer.pid`` and ``events.jsonl``, and
``webui.supervise`` writes ``exit.json`` when the trainer ends. Because nothing lives only in the
UI's memory, a reloaded page, a second browser or a restarted UI reattaches to a running job.

The trainer is started detached (a new session on POSIX, a new process group without a console on
Windows: ``trainer.host.procs``) so it survives a UI restart. Stop writes ``control/stop`` in the run folder,
the same on every platform (the trainer finishes the step, writes a backup and exits 0); a second Stop,
or ``stop_timeout`` seconds without an exit, kills the process tree (SIGKILL to the group on POSIX,
``taskkill /F /T`` on Windows). This module imports neither Gradio nor torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from trainer.events import TERMINAL
from trainer.host import procs
from trainer.host.paths import Confinement
from webui.jobqueue import Job, JobQueue

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCH, EXIT, STOP, PIDFILE = "launch.json", "exit.json", "ui-stop.json", "trainer.pid"
PROCESS_LOG = "process.log"


def read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# run folders
# --------------------------------------------------------------------------------------------

def runs_root(workspace: str | os.PathLike) -> Path:
    return Path(workspace) / "runs"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:60]


def make_run_dir(workspace: str | os.PathLike, name: str = "") -> Path:
    """A new, empty run folder; ``name`` (or a timestamp) made unique with -2, -3, …"""
    base = slug(name) or time.strftime("run-%Y%m%d-%H%M%S")
    root = runs_root(workspace)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10000):
        cand = root / (base if i == 1 else f"{base}-{i}")
        try:
            cand.mkdir()
            return cand
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name for {base!r}")


def list_backups(run_dir: str | os.PathLike) -> List[Path]:
    """The run's backups on disk, oldest first — never a hidden temporary (``.backup-….tmp-…``) a killed save
    left behind (a backup is written under a hidden name and renamed into place only once complete)."""
    folder = Path(run_dir) / "backups"
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def list_run_dirs(workspace: str | os.PathLike) -> List[Path]:
    """Run folders, newest first."""
    root = runs_root(workspace)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(dirs, key=lambda p: _mtime(p), reverse=True)


def _mtime(p: Path) -> float:
    for name in (LAUNCH, "config.yaml"):
        try:
            return (p / name).stat().st_mtime
        except OSError:
            pass
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


# --------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------

def pid_alive(pid: Optional[int]) -> bool:
    """True when the process exists and is not a zombie (any platform: ``trainer.host.procs``)."""
    return procs.pid_alive(pid)


def _looks_like_ours(pid: int) -> bool:
    """Guard against pid reuse (after a reboot): the process must be a supervisor or trainer."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # no /proc (macOS): trust the pid
    return b"trainer" in cmd or b"supervise" in cmd


def run_pids(run_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """(pid, process group) of a run: the supervisor from launch.json, else the trainer's own."""
    for name in (LAUNCH, PIDFILE):
        info = read_json(run_dir / name)
        if info and info.get("pid"):
            return int(info["pid"]), int(info.get("pgid") or 0) or None
    return None, None


def process_alive(run_dir: Path) -> bool:
    """Is any process of this run still alive (supervisor or trainer)? A supervisor that has written ``exit.json``
    is only finishing (its last act): the run has ended unless the trainer's own process lives on."""
    ended = read_json(run_dir / EXIT) is not None
    for name in ((PIDFILE,) if ended else (LAUNCH, PIDFILE)):
        info = read_json(run_dir / name)
        if info and info.get("pid") and pid_alive(int(info["pid"])) and _looks_like_ours(int(info["pid"])):
            return True
    return False


def trainer_command(config_path: Path, run_dir: Path, resume: str = "",
                    trainer_argv: Optional[List[str]] = None, confinement: Optional[Confinement] = None) -> List[str]:
    """The contract's CLI: ``python -m trainer train CONFIG --run-dir DIR [--resume X]``, confined to the page's
    folders (``--allowed-root`` each, ``--read-only-root`` for Atelier's presets) when ``confinement`` is given."""
    cmd = list(trainer_argv or [sys.executable, "-m", "trainer"])
    cmd += ["train", str(config_path), "--run-dir", str(run_dir)]
    if confinement is not None:
        cmd += [a for r in confinement.roots for a in ("--allowed-root", str(r))]
        cmd += [a for r in confinement.read_only for a in ("--read-only-root", str(r))]
    if resume:
        cmd += ["--resume", resume]
    return cmd


def child_env(**extra: str) -> dict:
    """The environment of a process the UI starts (trainer, tools, estimator): this project importable, output
    unbuffered, the libraries' chatter down to errors."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def launch(run_dir: Path, resume: str = "", trainer_argv: Optional[List[str]] = None,
           python: str = sys.executable, confinement: Optional[Confinement] = None) -> subprocess.Popen:
    """Start the trainer (under the supervisor) for ``run_dir/config.yaml`` in a new session."""
    run_dir = Path(run_dir).resolve()
    for stale in (EXIT, STOP):
        (run_dir / stale).unlink(missing_ok=True)
    procs.stop_file(run_dir).unlink(missing_ok=True)  # a request the previous trainer never read
    cmd = trainer_command(run_dir / "config.yaml", run_dir, resume, trainer_argv, confinement)
    full = [python, "-m", "webui.supervise", str(run_dir / EXIT), "--", *cmd]
    launched_at = time.time()
    env = child_env(ATELIER_LAUNCHED_AT=repr(launched_at))
    with open(run_dir / PROCESS_LOG, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(full, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, **procs.detached_popen_kwargs())
    pgid = None if procs.is_windows() else proc.pid  # POSIX: the new session's group is the supervisor's pid
    write_json(run_dir / LAUNCH, {"pid": proc.pid, "pgid": pgid, "cmd": cmd, "resume": resume,
                                  "started": launched_at})
    return proc


def stop_requested(run_dir: Path) -> Optional[dict]:
    return read_json(Path(run_dir) / STOP)


def stop(run_dir: Path, force: bool = False) -> str:
    """Ask a run to stop (``control/stop``: the trainer finishes the step and writes a backup); a second
    call, or ``force``, kills its whole process tree."""
    run_dir = Path(run_dir)
    if not process_alive(run_dir):
        return "This run is not running."
    pid, pgid = run_pids(run_dir)
    previous = stop_requested(run_dir)
    force = force or bool(previous)
    write_json(run_dir / STOP, {"time": (previous or {}).get("time", time.time()), "forced": force})
    if not force:
        try:
            procs.request_stop(run_dir)
        except OSError as exc:
            return f"Could not ask the trainer to stop (writing {procs.stop_file(run_dir)} failed: {exc})."
        return "Stopping: the trainer finishes the current step and writes a backup. Press Stop again to kill it."
    try:
        procs.kill_tree(pid, pgid)
    except ProcessLookupError:
        return "The run had already ended."
    except PermissionError as exc:
        return f"Not allowed to stop the trainer: {exc}"
    return "Killed the trainer (forced stop, no backup written)."


def last_event_type(run_dir: Path) -> str:
    """Type of the last complete event in events.jsonl (reads only the file's end)."""
    try:
        with open(Path(run_dir) / "events.jsonl", "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            lines = fh.read().splitlines()
    except OSError:
        return ""
    for raw in reversed(lines):
        try:
            return str(json.loads(raw).get("type", ""))
        except (ValueError, AttributeError):
            continue
    return ""


def request_action(run_dir: Path, action: str) -> str:
    """``sample`` / ``backup`` now: an empty file in control/ that the trainer picks up next step."""
    if action not in ("sample", "backup"):
        raise ValueError(action)
    run_dir = Path(run_dir)
    if not process_alive(run_dir):
        return f"No running trainer to ask for a {action}."
    (run_dir / "control").mkdir(exist_ok=True)
    (run_dir / "control" / action).touch()
    return f"Asked for a {action} at the next step."


# --------------------------------------------------------------------------------------------
# the manager: one trainer at a time, a queue behind it
# --------------------------------------------------------------------------------------------

class RunManager:
    """Starts runs for one workspace, keeps the queue moving and enforces the stop timeout.

    One trainer runs at a time per workspace (one GPU); more configs wait in the queue. The manager
    keeps no state that matters beyond its own process: everything is re-read from the workspace.
    """

    def __init__(self, workspace: str | os.PathLike, trainer_argv: Optional[List[str]] = None,
                 stop_timeout: float = 60.0, python: str = sys.executable,
                 confinement: Optional[Confinement] = None):
        self.workspace = Path(workspace).resolve()
        self.confinement = confinement  # the page's folders: every run it starts is confined to them
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.trainer_argv = trainer_argv
        self.stop_timeout = stop_timeout
        self.python = python
        self.queue = JobQueue(self.workspace / "queue.json")
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        self._stop_event = threading.Event()
        self.last_error = ""

    # -- state --------------------------------------------------------------------------------
    def active_runs(self) -> List[Path]:
        """Run folders whose trainer (or supervisor) is alive, reaping our finished children. A child of this page
        still running counts without its pid's command line (between its fork and exec that is the page's own)
        until its supervisor writes the run's end (then it is only finishing, as :func:`process_alive` says)."""
        with self._lock:
            for key, proc in list(self._procs.items()):
                if proc.poll() is not None:
                    del self._procs[key]
            ours = {Path(key).resolve() for key in self._procs}
        return [d for d in list_run_dirs(self.workspace)
                if (ours and d.resolve() in ours and not (d / EXIT).exists())
                or ((d / LAUNCH).exists() or (d / PIDFILE).exists()) and process_alive(d)]

    def busy(self) -> bool:
        return bool(self.active_runs())

    # -- starting -----------------------------------------------------------------------------
    def _start_job(self, job: Job) -> Path:
        if job.kind == "resume":
            run_dir = Path(job.run_dir)
        else:
            run_dir = make_run_dir(self.workspace, job.name)
            (run_dir / "config.yaml").write_text(job.config_yaml, encoding="utf-8")
        proc = launch(run_dir, job.resume, self.trainer_argv, self.python, self.confinement)
        self._procs[str(run_dir)] = proc
        return run_dir

    def wait_for_ending_runs(self, timeout: float = 20.0) -> None:
        """Give trainers that already reported their end a moment to exit (they free memory
        last), so Start right after a run finishes starts instead of queueing."""
        end = time.time() + timeout
        while time.time() < end:
            active = self.active_runs()
            if not active or not all(last_event_type(d) in TERMINAL for d in active):
                return
            time.sleep(0.2)

    def submit(self, job: Job) -> tuple[str, Optional[Path], Job]:
        """Start now when idle (and nothing is waiting), else append to the queue.
        Returns (``started``|``queued``, run folder or None, job)."""
        with self._lock:
            self.wait_for_ending_runs()
            if not self.busy() and not self.queue.list():
                return "started", self._start_job(job), job
            self.queue.add(job)
            return "queued", None, job

    def tick(self) -> Optional[Path]:
        """One scheduler step: kill runs past their stop timeout, start the next job when idle."""
        with self._lock:
            active = self.active_runs()
            for run_dir in active:
                req = stop_requested(run_dir)
                launched = (read_json(run_dir / LAUNCH) or {}).get("started", 0)
                if req and not req.get("forced") and req.get("time", 0) >= launched - 1 \
                        and time.time() - req.get("time", 0) > self.stop_timeout:
                    stop(run_dir, force=True)
            if active:
                return None
            job = self.queue.pop_next()
            if job is None:
                return None
            try:
                started = self._start_job(job)
                self.last_error = ""  # the failure to start an earlier job is over once one starts
                return started
            except Exception as exc:  # a bad job must not stall the queue
                self.last_error = f"Could not start queued job {job.name!r}: {exc}"
                return None

    def start_scheduler(self, interval: float = 1.0) -> None:
        """Run :meth:`tick` in a daemon thread so the queue moves with no browser open."""
        if self._thread and self._thread.is_alive():
            return

        def loop() -> None:
            while not self._stop_event.wait(interval):
                try:
                    self.tick()
                except Exception as exc:  # keep the scheduler alive
                    self.last_error = str(exc)

        self._thread = threading.Thread(target=loop, name="atelier-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop_event.set()


__all__ = ["RunManager", "Job", "JobQueue", "launch", "stop", "request_action", "process_alive",
           "make_run_dir", "list_run_dirs", "runs_root", "read_json", "trainer_command"]
