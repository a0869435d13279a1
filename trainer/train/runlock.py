"""One trainer at a time per run folder: an exclusive OS lock on ``<run>/trainer.lock``.

Two trainers on one folder would interleave their events, share backups and overwrite each other's
``config.yaml``. The lock is an advisory ``flock`` (``msvcrt.locking`` on Windows) held for the life of the
process; the OS drops it when the process ends in any way (``kill -9`` included), so a dead trainer's lock
is taken over by the next one without any clean-up. The file records the holder's pid for the message.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from trainer.host.procs import is_windows

LOCK_NAME = "trainer.lock"
_held: dict = {}  # run folder -> file descriptor, kept open for the life of the process


class RunFolderBusy(RuntimeError):
    """Another live trainer holds the run folder."""


WINDOWS_LOCK_OFFSET = 1 << 30  # the locked byte: far past the JSON, which other processes must still read


def _try_lock(fd: int) -> bool:
    try:
        if is_windows():  # Windows byte-range locks are mandatory: lock a byte past the end, not the pid record
            import msvcrt  # Windows only
            os.lseek(fd, WINDOWS_LOCK_OFFSET, os.SEEK_SET)
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
        else:
            import fcntl  # POSIX only
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def holder(run_dir: str | os.PathLike) -> Optional[dict]:
    """What the lock file says about its holder (pid, host, started), or None."""
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        return None


def acquire(run_dir: str | os.PathLike) -> int:
    """Lock ``run_dir`` for this process (idempotent); raises :class:`RunFolderBusy` naming the holder."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return _held[key]
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    if not _try_lock(fd):
        os.close(fd)
        info = holder(run_dir) or {}
        who = f"pid {info.get('pid', '?')}" + (f" on {info['host']}" if info.get("host") else "")
        raise RunFolderBusy(f"the run folder {run_dir} is in use by another trainer ({who}). Stop that run "
                            "first (the UI's Stop, or Ctrl+C in its terminal), or pick another general.run_name.")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
    _held[key] = fd
    return fd


def release(run_dir: str | os.PathLike) -> None:
    """Give the lock back (the process ending does the same)."""
    fd = _held.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)
