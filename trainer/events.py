"""The run's event stream: ``<run>/events.jsonl``, append-only, one JSON object a line.

Every event has ``type`` and ``time`` (Unix seconds). Types and their fields:

- ``started``: total_steps, epochs, steps_per_epoch, batch_size, resumed_from_step, dataset (report),
  world_size, global_micro_batch, global_batch, distributed (none / ddp / fsdp), cache (latents/text
  encoded and reused, seconds)
- ``step``: step, total_steps, epoch, loss, lr (dict group -> lr), it_s, eta_s
- ``sample``: step, epoch, paths (list), prompts (list)
- ``backup``: step, path
- ``saved``: step, path, format
- ``warning``: message
- ``error``: message, traceback
- ``validation``: step, epoch, loss, images (validation concepts)
- ``finished`` / ``stopped`` / ``failed``: step, message (``failed`` may name the ``rank``)

The web UI, the CLI progress bar and the tests all read this one stream. The module is pure
standard library so the UI can import it without torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional

TERMINAL = ("finished", "stopped", "failed")
DURABLE = ("error", *TERMINAL)  # fsync'd: how a run ended survives a crash of the machine


class EventWriter:
    """Appends events, one whole line each: a line is written with one ``os.write`` on an append-only
    descriptor, so a reader never sees half a line; a write that fails part-way (a full disk) is cut back to the
    previous end. The terminal and error events are fsync'd, so a crash of the machine never loses how a run ended;
    the others (a step event every step) are not: an fsync costs a disk flush (milliseconds) per step, and a
    process that dies still leaves them in the page cache for the readers. Opening repairs a
    torn last line left by a process that died mid-write, so the next event starts on a line of its own."""

    RESERVE_BYTES = 256 * 1024  # room for the last error and ``failed`` events when the disk fills

    def __init__(self, path: str | os.PathLike, enabled: bool = True, reserve: bool = False):
        self.path = Path(path)
        self.enabled = enabled
        self.reserve = self.path.with_name(f".{self.path.name}.reserve")
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            repair_torn_tail(self.path)
            if reserve:  # the trainer's writer: a run must be able to say why it ended
                self._make_reserve()

    def _make_reserve(self) -> None:
        """A hidden file of zeros beside the stream: when the disk fills, deleting it frees the room the
        run's last events need (the error and ``failed``), so a full disk never ends a run silently."""
        try:
            if not self.reserve.exists():
                with open(self.reserve, "wb") as fh:
                    fh.write(b"\0" * self.RESERVE_BYTES)
        except OSError:  # the disk is already full: nothing to reserve, nothing lost
            try:
                self.reserve.unlink()
            except OSError:
                pass

    def emit(self, type: str, **fields: Any) -> dict:
        event = {"type": type, "time": time.time(), **fields}
        if self.enabled:
            data = (json.dumps(event, default=_default) + "\n").encode("utf-8")
            try:
                end = self._append(data, sync=type in DURABLE)
            except OSError:
                if not self.reserve.exists():
                    raise
                self.reserve.unlink()  # a full disk: free the room the run's last events need
                if type not in ("error", *TERMINAL):
                    raise  # the run ends on this error; its error and failed events go into the freed room
                end = self._append(data, sync=True)
            self.written(data, end, type)
            if type in TERMINAL:
                try:
                    self.reserve.unlink()
                except OSError:
                    pass
        return event

    def written(self, data: bytes, end: int, type: str) -> None:
        """Called with each line once it is in the file at offset ``end`` (a subclass keeps a summary)."""

    def _append(self, data: bytes, sync: bool = True) -> int:
        """One whole line or nothing, flushed to the disk when ``sync``; returns where it begins."""
        if True:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                end = os.fstat(fd).st_size
                try:
                    written = os.write(fd, data)
                    if written != len(data):
                        raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes)")
                    if sync:
                        os.fsync(fd)
                except OSError:
                    try:  # take the partial line back out, so the stream stays one event a line
                        os.ftruncate(fd, end)
                    except OSError:
                        pass
                    raise
            finally:
                os.close(fd)
            return end


def repair_torn_tail(path: str | os.PathLike) -> bool:
    """Drop an unterminated last line (a writer died mid-line); True when something was cut."""
    path = Path(path)
    try:
        with open(path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return False
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return False
            start = max(0, size - (1 << 20))
            fh.seek(start)
            tail = fh.read()
            cut = tail.rfind(b"\n")
            fh.truncate(start + cut + 1 if cut >= 0 else start)
            return True
    except FileNotFoundError:
        return False


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def read_events(path: str | os.PathLike) -> List[dict]:
    """All complete events in the file (a half-written last line is ignored)."""
    return list(EventTail(path).read_new())


class EventTail:
    """Incremental reader: ``read_new()`` returns only events appended since the last call."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> Iterator[dict]:
        if not self.path.exists():
            return iter(())
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        out = []
        consumed = 0
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break  # partial line: read it next time
            consumed += len(raw)
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
        self.offset += consumed
        return iter(out)


def last_of(events: List[dict], type: str) -> Optional[dict]:
    for ev in reversed(events):
        if ev.get("type") == type:
            return ev
    return None


def run_state(events: List[dict]) -> str:
    """'finished' / 'stopped' / 'failed' when the run ended, 'running' when it has events but no
    end, 'new' when it has none."""
    for ev in reversed(events):
        if ev.get("type") in TERMINAL:
            return ev["type"]
    return "running" if events else "new"
