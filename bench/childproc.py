"""Run a child process the way a user would and watch it: wall time, its own peak RSS, timestamped output.

Why a helper of its own: the bench measures two different trainers (Atelier's CLI and diffusers'
example script) and both must be timed the same way. ``resource.getrusage(RUSAGE_CHILDREN)`` gives the
largest RSS of *all* children waited for so far (the warm-up run and the other trainer included), so
each child is reaped with ``os.wait4``, which returns that one child's usage.

Output is read as it arrives and split on ``\\n`` *and* ``\\r`` (tqdm redraws its bar with ``\\r``);
every piece is handed to ``watch(text, t)`` with the time it arrived. The unterminated tail of a read
is handed over too (tqdm writes a whole bar per write and flushes, but ends it only with the next
redraw), so a watcher must treat repeats of the same text as harmless ("first seen wins").
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, List, Optional

Watch = Callable[[str, float], None]


@dataclass
class ChildResult:
    cmd: List[str]
    returncode: int
    t0: float                       # time.time() just before the process was started
    wall_s: float                   # start to exit, seconds
    max_rss_mib: Optional[float]    # this child's peak resident memory (None where os.wait4 is missing)
    tail: List[str] = field(default_factory=list)  # last lines of stdout+stderr, for error messages
    log_path: Optional[Path] = None


def _reader(stream, watch: Optional[Watch], tail: Deque[str], log, lock: threading.Lock) -> None:
    partial = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        now = time.time()
        if not chunk:
            break
        data = partial + chunk
        pieces = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        partial = pieces.pop()  # unterminated: may still grow
        with lock:
            if log is not None:
                log.write(chunk)
            for piece in pieces:
                text = piece.decode("utf-8", "replace")
                if text.strip():
                    tail.append(text)
                if watch is not None:
                    watch(text, now)
            if partial and watch is not None:
                watch(partial.decode("utf-8", "replace"), now)
    if partial.strip():
        with lock:
            tail.append(partial.decode("utf-8", "replace"))
            if watch is not None:
                watch(partial.decode("utf-8", "replace"), time.time())


def run_child(cmd: List[str], *, cwd: Optional[Path] = None, env: Optional[dict] = None,
              watch: Optional[Watch] = None, log_path: Optional[Path] = None) -> ChildResult:
    """Run ``cmd`` to completion, feeding its output to ``watch``; never raises on a non-zero exit."""
    log = open(log_path, "wb") if log_path is not None else None
    tail: Deque[str] = collections.deque(maxlen=60)
    lock = threading.Lock()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    threads = [threading.Thread(target=_reader, args=(s, watch, tail, log, lock), daemon=True)
               for s in (proc.stdout, proc.stderr)]
    for th in threads:
        th.start()
    max_rss = None
    try:
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            # ru_maxrss is KiB on Linux, bytes on macOS
            max_rss = usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)
        else:  # pragma: no cover - Windows
            proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    wall = time.time() - t0
    for th in threads:
        th.join(timeout=10)
    if log is not None:
        log.close()
    return ChildResult(cmd=cmd, returncode=proc.returncode, t0=t0, wall_s=wall,
                       max_rss_mib=None if max_rss is None else round(max_rss, 1), tail=list(tail),
                       log_path=log_path)


def loop_rate(marks: List[tuple]) -> Optional[float]:
    """Steps per second between the first and the last ``(step, time)`` mark (None with < 2 marks).

    Uses the step numbers, not the count of marks, so a progress bar that skipped redraws still
    gives the right rate."""
    if len(marks) < 2:
        return None
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return round((s1 - s0) / (t1 - t0), 2) if t1 > t0 else None


def steady_rate(marks: List[tuple]) -> Optional[float]:
    """Steps per second of the median step: one-time stalls (a first-step warm-up, a garbage
    collection, an epoch boundary) do not move it, so it tells the loop's own speed."""
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(marks, marks[1:]) if s1 > s0]
    if not gaps:
        return None
    gaps.sort()
    mid = len(gaps) // 2
    median = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return round(1 / median, 2) if median > 0 else None
