"""A run's event stream in kilobytes: running aggregates and bounded curves, read from where the last read stopped.

Why: a 100k-step fine-tune is an ordinary run, and its ``events.jsonl`` holds a line a step. A page that kept every
event, and walked them all on every refresh, cost a core and a gigabyte on a long run. Instead a reader folds each
new event into a :class:`RunFold` (latest launch's progress and state, warnings, backups, outputs, prompts) and
:class:`Series` curves of a fixed number of buckets, and :class:`RunTail` reads from the last byte offset. The
trainer's :class:`SummaryWriter` keeps the same fold and leaves it beside the stream (:data:`SUMMARY`), so a reader
that starts late (the page after a restart, the Runs table) reads the summary and the last few events only.
Pure standard library, like :mod:`trainer.events`: the page imports it without torch.
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from typing import Any, List, Optional

from trainer.events import TERMINAL, EventWriter
from trainer.io import atomic_write_bytes

SUMMARY = "events.summary.json"  # beside events.jsonl: the fold of the stream up to a byte offset
SUMMARY_EVERY = 100  # the trainer's writer rewrites the summary after this many events (and at every non-step one)
WARNINGS_KEPT = 50  # a run may warn every step; the view shows the last few, counts all
PATHS_KEPT = 64  # backups and outputs named by events (the page checks which still exist)
HEAD_BYTES = 64  # the first bytes of the stream: a file rewritten in place is told by them
SMOOTHING = 0.9  # the loss chart's exponential moving average (TensorBoard's, debiased)
_B_FS, _B_FV, _B_LS, _B_LV, _B_MINS, _B_MINV, _B_MAXS, _B_MAXV, _B_N, _B_SFV, _B_SLV = range(11)


class Series:
    """A chart's points in at most ``size`` buckets of equal step width: the width doubles (neighbouring buckets
    merge pairwise) as the run grows, so memory stays the same at any length. A bucket keeps its first and last
    point by step (a repeated step keeps its latest value, as a resumed run overwrites), its lowest and highest
    value with their steps, a count, and the smoothed value at its first and last step. While a bucket spans at
    most 2 steps every point is kept, so a run of up to ``2 * size - 1`` steps charts exactly as it logged."""

    def __init__(self, size: int = 128):
        self.size = size
        self.width = 1
        self.buckets: dict = {}  # step // width -> array of the _B_* fields
        self._points: Optional[list] = None

    def add(self, step: int, value: float, smoothed: float = 0.0) -> None:
        index = step // self.width
        while index >= self.size:
            self._widen()
            index = step // self.width
        b = self.buckets.get(index)
        self._points = None
        if b is None:
            self.buckets[index] = array("d", (step, value, step, value, step, value, step, value, 1,
                                              smoothed, smoothed))
            return
        if step <= b[_B_FS]:
            b[_B_FS], b[_B_FV], b[_B_SFV] = step, value, smoothed
        if step >= b[_B_LS]:
            b[_B_LS], b[_B_LV], b[_B_SLV] = step, value, smoothed
        if value < b[_B_MINV]:
            b[_B_MINS], b[_B_MINV] = step, value
        if value > b[_B_MAXV]:
            b[_B_MAXS], b[_B_MAXV] = step, value
        b[_B_N] += 1

    def _widen(self) -> None:
        self.width *= 2
        merged: dict = {}
        for index in sorted(self.buckets):
            b = self.buckets[index]
            a = merged.get(index // 2)
            if a is None:
                merged[index // 2] = b
                continue  # a (lower steps) then b: first from a, last from b
            a[_B_LS], a[_B_LV], a[_B_SLV] = b[_B_LS], b[_B_LV], b[_B_SLV]
            if b[_B_MINV] < a[_B_MINV]:
                a[_B_MINS], a[_B_MINV] = b[_B_MINS], b[_B_MINV]
            if b[_B_MAXV] > a[_B_MAXV]:
                a[_B_MAXS], a[_B_MAXV] = b[_B_MAXS], b[_B_MAXV]
            a[_B_N] += b[_B_N]
        self.buckets = merged

    @property
    def count(self) -> int:
        return int(sum(b[_B_N] for b in self.buckets.values()))

    def points(self) -> List[tuple]:
        """(step, value) in step order: per bucket its first, lowest, highest and last point (one point when the
        bucket saw a single step)."""
        if self._points is None:
            out = []
            for index in sorted(self.buckets):
                b = self.buckets[index]
                if b[_B_FS] == b[_B_LS]:
                    out.append((int(b[_B_LS]), b[_B_LV]))
                    continue
                chosen = {int(b[_B_FS]): b[_B_FV], int(b[_B_LS]): b[_B_LV]}
                chosen[int(b[_B_MINS])] = b[_B_MINV]  # the extremes win a step they share with first/last
                chosen[int(b[_B_MAXS])] = b[_B_MAXV]
                out += sorted(chosen.items())
            self._points = out
        return self._points

    def smoothed(self) -> List[tuple]:
        """(step, smoothed value) at each bucket's first and last step."""
        out = []
        for index in sorted(self.buckets):
            b = self.buckets[index]
            out.append((int(b[_B_FS]), b[_B_SFV]))
            if b[_B_LS] != b[_B_FS]:
                out.append((int(b[_B_LS]), b[_B_SLV]))
        return out

    def to_dict(self) -> dict:
        return {"size": self.size, "width": self.width,
                "buckets": [[i, *b] for i, b in sorted(self.buckets.items())]}

    @classmethod
    def from_dict(cls, data: dict) -> "Series":
        s = cls(int(data["size"]))
        s.width = int(data["width"])
        s.buckets = {int(row[0]): array("d", row[1:]) for row in data["buckets"]}
        if any(len(b) != _B_SLV + 1 for b in s.buckets.values()):
            raise ValueError("not a series of this version")
        return s


def _new_segment(pre_warnings: Optional[List[str]] = None) -> dict:
    return {"started": False, "started_at": None, "total_steps": 0, "step": 0, "epoch": 0, "loss": None,
            "it_s": None, "eta_s": None, "lr": {}, "pre_warnings": list(pre_warnings or []), "pre_count": 0,
            "warnings": [], "warning_count": 0, "message": "", "traceback": "", "end": None, "ended_at": None}


class RunFold:
    """Everything the page shows of a run's stream, folded one event at a time, in kilobytes whatever its length.

    The latest launch (a resumed run appends a new segment that begins with ``started``) gives progress and state;
    curves, sample prompts, backups and outputs span all segments; warnings written before ``started`` (dataset
    problems found while planning) belong to the launch they precede. ``charts=False`` keeps no curves (the Runs
    table needs none). :meth:`to_dict`/:meth:`from_dict` let the trainer's writer hand the fold to readers."""

    def __init__(self, charts: bool = True):
        self.charts = charts
        self.count = 0  # events folded
        self.seg = _new_segment()
        self.since_end: List[str] = []  # the last warnings since the last terminal event
        self.since_end_count = 0
        self.backups: List[str] = []
        self.outputs: List[str] = []
        self.prompts: dict = {}  # index -> text (str keys in JSON)
        self.loss = Series()
        self.lr: dict = {}  # group -> Series
        self.loss_count = 0
        self.lr_count = 0
        self.ema = [0.0, 0]  # moving average, points

    def add(self, ev: dict) -> None:
        self.count += 1
        kind = ev.get("type")
        seg = self.seg
        if kind == "step":
            if ev.get("loss") is not None:
                step, loss = int(ev.get("step", 0)), float(ev["loss"])
                self.loss_count += 1
                self.ema[0] = SMOOTHING * self.ema[0] + (1 - SMOOTHING) * loss
                self.ema[1] += 1
                if self.charts:
                    self.loss.add(step, loss, self.ema[0] / (1 - SMOOTHING ** self.ema[1]))
                for group, value in (ev.get("lr") or {}).items():
                    self.lr_count += 1
                    if self.charts:
                        self.lr.setdefault(str(group), Series()).add(step, float(value))
            seg["step"] = int(ev.get("step", seg["step"]))
            seg["total_steps"] = int(ev.get("total_steps") or seg["total_steps"])
            seg["epoch"] = int(ev.get("epoch", seg["epoch"]) or 0)
            seg["loss"], seg["it_s"], seg["eta_s"] = ev.get("loss"), ev.get("it_s"), ev.get("eta_s")
            seg["lr"] = dict(ev.get("lr") or {})
        elif kind == "started":
            seg = self.seg = _new_segment(self.since_end[-WARNINGS_KEPT:])
            seg["pre_count"] = self.since_end_count
            seg["started"] = True
            seg["started_at"] = ev.get("time")
            seg["total_steps"] = int(ev.get("total_steps") or 0)
            seg["step"] = int(ev.get("resumed_from_step") or 0)
        elif kind == "sample":
            for i, text in enumerate(ev.get("prompts") or []):
                self.prompts[str(i)] = str(text)
        elif kind == "backup" and ev.get("path"):
            self.backups = (self.backups + [str(ev["path"])])[-PATHS_KEPT:]
        elif kind == "saved" and ev.get("path"):
            self.outputs = (self.outputs + [str(ev["path"])])[-PATHS_KEPT:]
        elif kind == "warning":
            message = str(ev.get("message", ""))
            self.since_end = (self.since_end + [message])[-WARNINGS_KEPT:]
            self.since_end_count += 1
            seg["warnings"] = (seg["warnings"] + [message])[-WARNINGS_KEPT:]
            seg["warning_count"] += 1
        elif kind == "error":
            seg["message"] = str(ev.get("message", ""))
            seg["traceback"] = str(ev.get("traceback", "") or "")
        if kind in TERMINAL:
            self.since_end, self.since_end_count = [], 0
            seg["end"] = kind
            seg["ended_at"] = ev.get("time")
            seg["step"] = int(ev.get("step") or seg["step"])
            if kind != "failed" or not seg["message"]:
                seg["message"] = str(ev.get("message", "") or seg["message"])

    def next_segment(self) -> dict:
        """The segment a relaunch begins before its ``started``: empty, with the warnings since the last end."""
        seg = _new_segment(self.since_end)
        seg["pre_count"] = self.since_end_count
        return seg

    def to_dict(self) -> dict:
        return {"count": self.count, "seg": self.seg, "since_end": self.since_end,
                "since_end_count": self.since_end_count, "backups": self.backups,
                "outputs": self.outputs, "prompts": self.prompts, "loss_count": self.loss_count,
                "lr_count": self.lr_count, "ema": self.ema,
                "loss": self.loss.to_dict() if self.charts else None,
                "lr": {g: s.to_dict() for g, s in self.lr.items()} if self.charts else None}

    @classmethod
    def from_dict(cls, data: dict, charts: bool = True) -> "RunFold":
        fold = cls(charts=charts and data.get("loss") is not None)
        fold.count, fold.seg = int(data["count"]), dict(data["seg"])
        fold.since_end, fold.since_end_count = list(data["since_end"]), int(data["since_end_count"])
        fold.backups, fold.outputs = list(data["backups"]), list(data["outputs"])
        fold.prompts = {str(k): str(v) for k, v in data["prompts"].items()}
        fold.loss_count, fold.lr_count, fold.ema = int(data["loss_count"]), int(data["lr_count"]), list(data["ema"])
        if fold.charts:
            fold.loss = Series.from_dict(data["loss"])
            fold.lr = {str(g): Series.from_dict(s) for g, s in data["lr"].items()}
        missing = set(_new_segment()) - set(fold.seg)
        if missing:
            raise ValueError(f"summary lacks {sorted(missing)}")
        return fold


def summary_path(events_path: str | os.PathLike) -> Path:
    return Path(events_path).with_name(SUMMARY)


class RunTail:
    """A stream read from where the last read stopped, each new event folded into a :class:`RunFold`.

    A torn last line (a writer mid-line) is read again once complete; a file that shrank, was replaced (another
    inode) or rewritten in place (other first bytes) is read again from the start. A fresh reader starts from the
    trainer's summary (:data:`SUMMARY`) when it still describes this file, so a long run is not read twice."""

    CHUNK = 4 << 20

    def __init__(self, path: str | os.PathLike, charts: bool = True):
        self.path = Path(path)
        self.charts = charts
        self.version = 0  # grows whenever the fold changed
        self.reset()

    def reset(self) -> None:
        self.fold = RunFold(self.charts)
        self.offset = 0  # bytes folded: whole lines only
        self.head = b""  # the file's first bytes (up to HEAD_BYTES) as last read
        self.inode: Optional[int] = None
        self.stat_key: Optional[tuple] = None
        self.saved = 0  # the offset of the summary on disk (0: none of this file)

    def catch_up(self) -> bool:
        """Fold what was appended since the last call; True when the fold changed."""
        try:
            st = os.stat(self.path)
        except OSError:
            if self.inode is None and not self.fold.count:
                return False
            self.reset()  # the stream is gone
            self.version += 1
            return True
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self.stat_key:
            return False
        before, changed = (self.fold.count, self.offset), False
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            self.reset()
            changed = True
        with open(self.path, "rb") as fh:
            if self.head and fh.read(len(self.head)) != self.head:
                self.reset()
                changed = True
            if self.offset == 0:
                self._from_summary(fh, st)
            self._read(fh)
            if len(self.head) < min(HEAD_BYTES, self.offset):
                fh.seek(0)
                self.head = fh.read(min(HEAD_BYTES, self.offset))
        self.inode, self.stat_key = st.st_ino, key
        if changed or (self.fold.count, self.offset) != before:
            self.version += 1
            return True
        return False

    def _read(self, fh: Any) -> None:
        fh.seek(self.offset)
        rest = b""
        while True:
            chunk = fh.read(self.CHUNK)
            if not chunk:
                return
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            for line in data[:cut].split(b"\n"):
                if line:
                    self.add_line(line)
            self.offset += cut
            rest = data[cut:]

    def add_line(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return  # not an event (a stray line): skipped, as read_events does
        if isinstance(event, dict):
            self.fold.add(event)

    def _from_summary(self, fh: Any, st: os.stat_result) -> None:
        """Start from the summary when it is of this very file (inode, first bytes) and not ahead of it."""
        try:
            data = json.loads(summary_path(self.path).read_text(encoding="utf-8"))
            offset, head = int(data["offset"]), bytes.fromhex(data["head"])
            if data.get("inode") != st.st_ino or offset > st.st_size or len(head) != min(HEAD_BYTES, offset):
                return
            fh.seek(0)
            if fh.read(len(head)) != head:
                return
            fold = RunFold.from_dict(data["fold"], charts=self.charts)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # none, torn or of another version: read the stream itself
        if fold.charts == self.charts:
            self.fold, self.offset, self.head, self.saved = fold, offset, head, offset

    def save_summary(self, past: int) -> bool:
        """Leave the summary beside the stream when this reader has read ``past`` bytes or more beyond the one
        there (a run from before summaries, or a trainer that could not write one), so the next reader, in this
        process or another, does not read them again. Any summary of a prefix of this file is right, whoever
        wrote it last. False when there was nothing to save or the folder is not writable."""
        if self.offset - self.saved < past or self.inode is None:
            return False
        try:
            atomic_write_bytes(summary_path(self.path), json.dumps(self.summary()).encode("utf-8"))
        except (OSError, ValueError):
            return False
        self.saved = self.offset
        return True

    def summary(self) -> dict:
        return {"offset": self.offset, "inode": self.inode, "head": self.head.hex(), "fold": self.fold.to_dict()}


class SummaryWriter(EventWriter):
    """The trainer's writer: also keeps the stream's :class:`RunFold` and rewrites it beside the stream
    (:data:`SUMMARY`) after every non-step event and every :data:`SUMMARY_EVERY` events. A resumed run's writer
    starts from the summary (or reads the stream once). A summary that cannot be written is only a slower page,
    never a failed run: the writer then stops keeping one."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True, reserve: bool = False):
        super().__init__(path, enabled=enabled, reserve=reserve)
        self.reserving = reserve
        self.tail: Optional[RunTail] = None
        self.unsaved = 0  # events folded since the summary was last written
        if enabled:
            self.tail = RunTail(self.path)
            self.tail.catch_up()

    def written(self, data: bytes, end: int, type: str) -> None:
        tail = self.tail
        if tail is None:
            return
        try:
            if end == tail.offset and tail.inode is not None:  # the line follows what was folded: fold it
                tail.add_line(data)
                tail.offset += len(data)
                if len(tail.head) < HEAD_BYTES:
                    tail.head = (tail.head + data)[:HEAD_BYTES]
            else:  # the first line, or another writer appended in between: read the stream itself
                tail.stat_key = None
                tail.catch_up()
            self.unsaved += 1
            # a full disk: the room the reserve freed is for the run's last events, not for a summary
            short_of_room = type == "error" or (self.reserving and not self.reserve.exists() and type not in TERMINAL)
            if (type != "step" or self.unsaved >= SUMMARY_EVERY) and not short_of_room:
                atomic_write_bytes(summary_path(self.path), json.dumps(tail.summary()).encode("utf-8"))
                self.unsaved = 0
        except (OSError, ValueError, TypeError):
            self.tail = None
