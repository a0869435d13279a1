"""Processes the same way on Linux, macOS and Windows: start detached, ask to stop, kill, check alive.

Windows has no process groups in the POSIX sense, no ``SIGHUP``/``SIGKILL``, no ``os.killpg`` and
ignores ``start_new_session``; a detached process there has no console a Ctrl+C could reach. So the
portable contract is a file, not a signal:

* **Graceful stop** — the UI (or anyone) writes ``control/stop`` in the run folder; the trainer watches
  for it (:class:`StopFileWatcher`), finishes the current step, writes a backup and exits 0. The same
  request on every platform. Ctrl+C (and Ctrl+Break on Windows) in a console still work as signals.
* **Forced stop** — the whole process tree is killed: ``killpg(SIGKILL)`` on POSIX, ``taskkill /F /T``
  on Windows.
* **Detached start** — a new session on POSIX, a new process group without a console window on
  Windows, so closing the UI (or its console) leaves the run going.

Pure stdlib: the web UI imports it without torch. Everything that differs per platform asks
:func:`is_windows` at call time, so tests can simulate Windows on Linux.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

STOP_FILE = "stop"  # control/stop in the run folder

# Windows creation flags (constants of the subprocess module there; the values are the Win32 ones)
CREATE_NEW_PROCESS_GROUP = 0x00000200
CREATE_NO_WINDOW = 0x08000000
STILL_ACTIVE = 259
PROCESS_QUERY_LIMITED_INFORMATION = 0x1000


def is_windows() -> bool:
    return os.name == "nt"


def detached_popen_kwargs() -> Dict[str, object]:
    """Keyword arguments for ``subprocess.Popen`` that let the child outlive this process and its console."""
    if is_windows():
        return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", CREATE_NEW_PROCESS_GROUP)
                | getattr(subprocess, "CREATE_NO_WINDOW", CREATE_NO_WINDOW)}
    return {"start_new_session": True}


def stop_signals() -> List[int]:
    """The signals that mean "stop" on this platform (SIGHUP only on POSIX, SIGBREAK only on Windows)."""
    return [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, name)]


def _noop(signum: int, frame: object) -> None:  # noqa: ARG001
    pass


def ignore_stop_signals() -> None:
    """Install a no-op handler (not SIG_IGN, which children would inherit) for every stop signal here."""
    for sig in stop_signals():
        signal.signal(sig, _noop)


def process_group_id() -> Optional[int]:
    """This process's group id on POSIX; None on Windows (no process groups to signal)."""
    getpgid = getattr(os, "getpgid", None)
    if getpgid is None or is_windows():
        return None
    try:
        return int(getpgid(0))
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# alive?
# --------------------------------------------------------------------------------------------

def pid_alive(pid: Optional[int]) -> bool:
    """True when the process exists and has not ended (a zombie counts as ended)."""
    if not pid or int(pid) <= 0:
        return False
    pid = int(pid)
    if is_windows():
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    return True


def _windows_pid_alive(pid: int) -> bool:
    """Windows: open the process and ask for its exit code (``os.kill(pid, 0)`` there would *send*
    CTRL_C_EVENT — signal 0 is CTRL_C_EVENT — or terminate the process)."""
    try:
        import ctypes  # Windows only (its windll)
        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return _tasklist_has(pid)
    handle = kernel32.OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
    if not handle:
        return False  # no such process (or one we may not see, which is not ours)
    try:
        code = ctypes.c_ulong()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def _tasklist_has(pid: int) -> bool:
    try:
        out = subprocess.run(["tasklist", "/FI", f"PID eq {pid}", "/NH", "/FO", "CSV"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return f'"{pid}"' in out


# --------------------------------------------------------------------------------------------
# stop and kill
# --------------------------------------------------------------------------------------------

def stop_file(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / "control" / STOP_FILE


def request_stop(run_dir: os.PathLike | str, reason: str = "stop requested from the web UI") -> Path:
    """Ask the run's trainer to stop gracefully: write ``control/stop`` (the same on every platform)."""
    path = stop_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STOP_FILE}.tmp")
    tmp.write_text(json.dumps({"time": time.time(), "reason": reason}), encoding="utf-8")
    os.replace(tmp, path)
    return path


def kill_tree(pid: Optional[int], pgid: Optional[int] = None) -> None:
    """Kill a process and everything it started, now. Raises ProcessLookupError when it is already gone
    and PermissionError when this user may not kill it."""
    if is_windows():
        if not pid:
            raise ProcessLookupError("no process id")
        r = subprocess.run(["taskkill", "/F", "/T", "/PID", str(int(pid))], capture_output=True, text=True)
        if r.returncode != 0:
            text = (r.stdout + r.stderr).strip()
            if "not found" in text.lower() or r.returncode == 128:
                raise ProcessLookupError(text or f"process {pid} not found")
            raise PermissionError(text or f"taskkill failed with code {r.returncode}")
        return
    kill_signal = getattr(signal, "SIGKILL", signal.SIGTERM)
    if pgid and hasattr(os, "killpg"):
        os.killpg(int(pgid), kill_signal)
    elif pid:
        os.kill(int(pid), kill_signal)
    else:
        raise ProcessLookupError("no process id")


def _ignore(reason: str) -> None:
    """``on_stop`` of a closed watcher."""


class StopFileWatcher:
    """Polls ``control/stop`` in a daemon thread and calls ``on_stop(reason)`` once per request.

    A request older than ``since`` (a file left by an earlier run whose trainer died before reading it) is
    removed without stopping this run. The file is consumed (deleted) when seen."""

    def __init__(self, run_dir: os.PathLike | str, on_stop: Callable[[str], None], since: float = 0.0,
                 interval: float = 0.25):
        self.path = stop_file(run_dir)
        self.on_stop = on_stop
        self.since = since
        self.interval = interval
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> bool:
        """Check once; True when a (fresh) request was found and handed on."""
        try:
            raw = self.path.read_text(encoding="utf-8")
        except OSError:
            return False
        try:
            info = json.loads(raw or "{}")
        except ValueError:
            info = {}
        try:
            self.path.unlink()
        except OSError:
            pass
        asked_at = float(info.get("time", 0) or 0) if isinstance(info, dict) else 0.0
        if asked_at and asked_at < self.since:
            return False  # stale: asked of an earlier process
        reason = info.get("reason") if isinstance(info, dict) else None
        self.on_stop(str(reason or "stop file"))
        return True

    def start(self) -> "StopFileWatcher":
        def loop() -> None:
            while not self._done.wait(self.interval):
                try:
                    self.poll()
                except Exception:  # noqa: BLE001 — the watcher must never take the trainer down
                    pass

        self._thread = threading.Thread(target=loop, name="atelier-stop-file", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling and wait for the thread to end. The thread's target holds ``on_stop`` (in the trainer, the
        trainer and its model): a thread still dropping it while the interpreter shuts down ends in Python's
        ``pthread_exit`` inside torch's tensor destructor, which aborts the process ("terminate called without an
        active exception") after a finished run."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.on_stop = _ignore


__all__ = ["STOP_FILE", "StopFileWatcher", "detached_popen_kwargs", "ignore_stop_signals", "is_windows",
           "kill_tree", "pid_alive", "process_group_id", "request_stop", "stop_file", "stop_signals"]
