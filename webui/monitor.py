"""What a run folder says about its run: state, progress, curves, samples, problems.

Reads ``events.jsonl`` incrementally (one :class:`trainer.run_summary.RunTail` per run, shared by all browser sessions)
into running aggregates and bounded curves, never a list of every event: a request costs what changed since the
last one, and a run costs kilobytes however long it is. Also reads the samples folder (listed again only when its
mtime moves), the logs and the runner's ``launch.json``/``exit.json``.
A trainer that vanished without a ``failed`` event is explained in plain words, with advice when
it looks like the machine ran out of memory. Imports neither Gradio nor torch.
"""

from __future__ import annotations

import itertools
import re
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from trainer.events import TERMINAL
from trainer.run_summary import RunFold, RunTail
from webui import runner

# step<STEP>-p<PROMPT>[-ema][-<N>].png: -ema for the EMA weights' sample, -N for a second one at the same step
SAMPLE_RE = re.compile(r"step(\d+)-p(\d+)(-ema)?(?:-(\d+))?\.(png|jpg|jpeg|webp|mp4|webm)$", re.I)
VIDEO_SUFFIXES = (".mp4", ".webm")  # a video family's sample: the page's galleries play it
#: a run read this far past its summary (one from before summaries) gets a new one, so it is read once, not per UI
SAVE_SUMMARY_BYTES = 4 << 20
OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory",
               "memoryerror", "oom-kill", "killed process")
OOM_ADVICE = ("To use less memory: lower the batch size (training.batch_size), turn on gradient "
              "checkpointing (training.gradient_checkpointing), use mixed precision "
              "(training.mixed_precision = bf16 or fp16) and lower weight dtypes (parts.denoiser.dtype, "
              "parts.text_encoder_1.dtype), or train at a smaller resolution (data.resolution).")


@dataclass
class Sample:
    path: str
    step: int
    prompt_index: int
    prompt: str = ""

    @property
    def caption(self) -> str:
        text = self.prompt if len(self.prompt) <= 60 else self.prompt[:57] + "…"
        return f"step {self.step} · prompt {self.prompt_index}" + (f": {text}" if text else "")


@dataclass
class RunView:
    """Everything the Run and Runs tabs show about one run. The curves are a bounded digest of the run's
    (:class:`trainer.run_summary.Series`): every point of a short run, first, last, lowest and highest point per
    bucket of a long one."""
    name: str
    path: Path
    state: str = "new"            # new|starting|running|stopping|finished|stopped|failed|died
    step: int = 0
    total_steps: int = 0
    epoch: int = 0
    loss: Optional[float] = None
    it_s: Optional[float] = None
    eta_s: Optional[float] = None
    lr: Dict[str, float] = field(default_factory=dict)
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    message: str = ""             # end message, error message or death explanation
    traceback: str = ""
    advice: str = ""
    warnings: List[str] = field(default_factory=list)  # the last ones (WARNINGS_KEPT each side of "started")
    warning_count: int = 0        # all of this launch's warnings
    backups: List[str] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)
    loss_points: List[tuple] = field(default_factory=list)   # (step, loss)
    smooth_points: List[tuple] = field(default_factory=list)  # (step, smoothed loss)
    lr_points: List[tuple] = field(default_factory=list)     # (step, group, lr)
    loss_count: int = 0           # step events with a loss, all segments
    lr_count: int = 0
    samples: List[Sample] = field(default_factory=list)
    samples_key: tuple = ()       # changes when the samples folder does
    version: int = 0              # grows whenever new events arrived

    @property
    def active(self) -> bool:
        return self.state in ("starting", "running", "stopping")

    @property
    def progress(self) -> float:
        return min(1.0, self.step / self.total_steps) if self.total_steps else 0.0


class _Samples:
    """The samples folder's listing, kept while the folder's mtime says nothing was added or removed."""

    FRESH_S = 2.0  # a folder changed this recently is listed again (coarse file-system clocks)

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.samples: List[Sample] = []
        self.digest: tuple = ()

    def get(self, run_dir: Path, prompts: Dict[int, str]) -> tuple[List[Sample], tuple]:
        """(samples, a key that changes when they do)."""
        try:
            mtime = (run_dir / "samples").stat().st_mtime_ns
        except OSError:
            mtime = None
        key = (mtime, tuple(sorted(prompts.items())))
        if key != self.key or (mtime is not None and time.time() - mtime / 1e9 < self.FRESH_S):
            self.samples = scan_samples(run_dir, prompts)
            self.key = key
            self.digest = (mtime, hash(tuple(s.path for s in self.samples)), hash(key[1]))
        return self.samples, self.digest


class _Run:
    """What the monitor keeps of one run: its stream's reader (fold and offset) and its samples' listing."""

    def __init__(self, run_dir: Path, charts: bool):
        self.tail = RunTail(run_dir / "events.jsonl", charts=charts)
        self.samples = _Samples()
        # versions of a run read again after it was dropped from the cache never repeat one a page has seen
        self.base = next(_GENERATIONS) << 32

    @property
    def version(self) -> int:
        return self.base + self.tail.version


_GENERATIONS = itertools.count(1)


class RunMonitor:
    """Per-process cache of runs, each read incrementally and folded (kilobytes per run whatever its length).

    ``view`` keeps the runs last looked at with their curves (at most ``keep``, least recently used dropped);
    ``row`` keeps a curve-less fold of every run for the Runs table, started from the trainer's summary."""

    def __init__(self, keep: int = 8, keep_rows: int = 512) -> None:
        self._runs: "OrderedDict[str, _Run]" = OrderedDict()
        self._rows: "OrderedDict[str, _Run]" = OrderedDict()
        self.keep, self.keep_rows = keep, keep_rows
        self._lock = threading.Lock()

    def _get(self, cache: "OrderedDict[str, _Run]", run_dir: Path, charts: bool, cap: int) -> _Run:
        key = str(run_dir)
        run = cache.get(key)
        if run is None:
            run = cache[key] = _Run(run_dir, charts)
            while len(cache) > cap:
                cache.popitem(last=False)
        cache.move_to_end(key)
        if run.tail.catch_up():
            run.tail.save_summary(SAVE_SUMMARY_BYTES)
        return run

    def view(self, run_dir: Path) -> RunView:
        """The run as the Run tab shows it, curves and samples included."""
        run_dir = Path(run_dir)
        with self._lock:
            run = self._get(self._runs, run_dir, True, self.keep)
            view, facts = view_from(run_dir, run.tail.fold, run.version)
            view.samples, view.samples_key = run.samples.get(run_dir, _prompts(run.tail.fold))
        return finish_view(view, facts)

    def row(self, run_dir: Path) -> RunView:
        """The run as the Runs table lists it: state, progress, loss, backups and outputs, no curves or samples."""
        run_dir = Path(run_dir)
        with self._lock:
            run = self._runs.get(str(run_dir))
            if run is not None:
                if run.tail.catch_up():
                    run.tail.save_summary(SAVE_SUMMARY_BYTES)
            else:
                run = self._get(self._rows, run_dir, False, self.keep_rows)
            view, facts = view_from(run_dir, run.tail.fold, run.version, charts=False)
        return finish_view(view, facts)


def _prompts(fold: RunFold) -> Dict[int, str]:
    return {int(k): v for k, v in fold.prompts.items()}


def build_view(run_dir: Path, events: List[dict], version: int = 0) -> RunView:
    """The view of a list of events (all of a run's): the fold the monitor keeps, made in one go."""
    fold = RunFold()
    for ev in events:
        fold.add(ev)
    view, facts = view_from(run_dir, fold, version)
    view.samples = scan_samples(run_dir, _prompts(fold))
    return finish_view(view, facts)


@dataclass
class _Facts:
    """What the state needs besides the fold: the runner's launch record, whether this launch said "started", and
    whether the stream has any event."""
    launch: Optional[dict]
    started: bool
    empty: bool


def view_from(run_dir: Path, fold: RunFold, version: int = 0, charts: bool = True) -> tuple[RunView, _Facts]:
    """The fold's numbers as a view of the latest launch (the state is :func:`finish_view`'s)."""
    view = RunView(name=run_dir.name, path=run_dir, version=version, loss_count=fold.loss_count,
                   lr_count=fold.lr_count)
    seg = fold.seg
    launch = runner.read_json(run_dir / runner.LAUNCH)
    if seg["started"] and launch and (seg["started_at"] or 0) < launch.get("started", 0) - 1:
        seg = fold.next_segment()  # relaunched, the new process has not said "started" yet
    view.started_at, view.total_steps, view.step, view.epoch = (seg["started_at"], seg["total_steps"], seg["step"],
                                                                seg["epoch"])
    view.loss, view.it_s, view.eta_s, view.lr = seg["loss"], seg["it_s"], seg["eta_s"], dict(seg["lr"])
    view.warnings = list(seg["pre_warnings"]) + list(seg["warnings"])
    view.warning_count = seg["pre_count"] + seg["warning_count"]
    view.message, view.traceback, view.ended_at = seg["message"], seg["traceback"], seg["ended_at"]
    if seg["end"]:
        view.state = seg["end"]
    view.backups, view.outputs = list(fold.backups), list(fold.outputs)
    if charts and fold.charts:
        view.loss_points = list(fold.loss.points())
        view.smooth_points = fold.loss.smoothed()
        view.lr_points = sorted((s, g, v) for g, series in fold.lr.items() for s, v in series.points())
    return view, _Facts(launch, bool(seg["started"]), fold.count == 0)


def finish_view(view: RunView, facts: _Facts) -> RunView:
    """Backups that still exist, and the state: ended, alive (running, stopping) or gone without a word."""
    run_dir, launch, started = view.path, facts.launch, facts.started
    on_disk = {p.name: str(p) for p in runner.list_backups(run_dir)}  # pruned or half-written ones do not count
    view.backups = [b for b in view.backups if Path(b).name in on_disk] or list(on_disk.values())
    if view.state in TERMINAL:
        if view.state == "failed" and _is_oom(view.message + view.traceback):
            view.advice = OOM_ADVICE
        return view
    alive = runner.process_alive(run_dir)
    if alive:
        req = runner.stop_requested(run_dir)
        launched = (launch or {}).get("started", 0)
        if req and req.get("time", 0) >= launched - 1:
            view.state = "stopping"
        else:
            view.state = "running" if started else "starting"
        return view
    if not launch and not (run_dir / runner.PIDFILE).exists() and facts.empty:
        view.state = "new"
        return view
    req = runner.stop_requested(run_dir) or {}
    if runner.read_json(run_dir / runner.EXIT) is None and not req.get("forced") and \
            _active_within(run_dir, EXIT_GRACE_S):
        # the trainer has just ended and its supervisor is still writing down how (or a busy machine has not yet
        # let it): not "gone without an exit code" yet; the next refresh tells (a forced stop writes none)
        view.state = "stopping" if req else ("running" if started else "starting")
        return view
    view.state = "died"
    view.message, view.advice = explain_death(run_dir)
    return view


#: how long after a run's last sign of life a missing exit code still counts as "being written"
EXIT_GRACE_S = 5.0


def _active_within(run_dir: Path, seconds: float) -> bool:
    """Did the run's process log, pid files or events change in the last ``seconds``?"""
    now = time.time()
    for name in (runner.PROCESS_LOG, runner.PIDFILE, runner.LAUNCH, "events.jsonl"):
        try:
            if now - (run_dir / name).stat().st_mtime < seconds:
                return True
        except OSError:
            continue
    return False


def scan_samples(run_dir: Path, prompts: Dict[int, str]) -> List[Sample]:
    """Samples in ``samples/`` (``step{STEP:06d}-p{INDEX}[-ema][-N].png``), oldest step first. A video family's
    sample is an ``.mp4`` with a ``.png`` of its first frame beside it: the video stands for both."""
    out = []
    folder = run_dir / "samples"
    if not folder.is_dir():
        return out
    names = {p.name: p for p in folder.iterdir()}
    videos = {Path(n).stem for n in names if Path(n).suffix.lower() in VIDEO_SUFFIXES}
    for name, p in names.items():
        m = SAMPLE_RE.search(name)
        if not m or (p.suffix.lower() not in VIDEO_SUFFIXES and p.stem in videos):
            continue
        idx = int(m.group(2))
        caption = prompts.get(idx, "") + (" (EMA weights)" if m.group(3) else "")
        out.append(Sample(str(p), int(m.group(1)), idx, caption))
    return sorted(out, key=lambda s: (s.step, s.prompt_index, s.path))


def tail_text(path: Path, max_bytes: int = 24000, max_lines: int = 120) -> str:
    """The last lines of a log file (empty when it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = data.splitlines()
    if len(data) >= max_bytes and lines:
        lines = lines[1:]  # the first line is probably cut
    return "\n".join(lines[-max_lines:])


def log_tail(run_dir: Path, max_lines: int = 120) -> str:
    """train.log when the trainer wrote one, else what it printed (process.log)."""
    text = tail_text(run_dir / "train.log", max_lines=max_lines)
    return text if text.strip() else tail_text(run_dir / runner.PROCESS_LOG, max_lines=max_lines)


def _is_oom(text: str) -> bool:
    low = text.lower()
    return any(marker in low for marker in OOM_MARKERS)


def explain_death(run_dir: Path) -> tuple[str, str]:
    """(plain-words explanation, advice) for a trainer that ended without a final event."""
    exit_info = runner.read_json(run_dir / runner.EXIT)
    stop_req = runner.stop_requested(run_dir) or {}
    output = tail_text(run_dir / runner.PROCESS_LOG, max_lines=40)
    oom = _is_oom(output)
    advice = OOM_ADVICE if oom else ""
    if stop_req.get("forced"):
        return ("You force-stopped this run (the trainer was killed, so no backup was written at the end).",
                "Resume it from its last backup, if it has one.")
    if exit_info is None:
        return ("The trainer process is gone without reporting how it ended, and no exit code was recorded "
                "(the machine may have restarted, or the whole process group was killed).",
                advice or "Look at the last log lines below; resume from the last backup if there is one.")
    rc = exit_info.get("returncode")
    if stop_req and not (run_dir / "events.jsonl").exists():
        return ("Stopped before training began (the trainer was still starting up).", "")
    if exit_info.get("error"):
        return (f"The trainer could not be started: {exit_info['error']}", "")
    if rc == 2:
        return ("The trainer refused the configuration and did not start:\n" + _last_lines(output, 12),
                "Fix the setting it names and start again.")
    if rc is not None and rc < 0:
        sig = -rc
        name = _signal_name(sig)
        if sig == getattr(signal, "SIGKILL", 9):
            return (f"The trainer was killed by the operating system ({name}) without a chance to save. "
                    "This almost always means the machine ran out of memory (the Linux out-of-memory killer), "
                    "or someone ran `kill -9` on it.", OOM_ADVICE)
        if sig == getattr(signal, "SIGSEGV", 11):
            return (f"The trainer crashed inside native code ({name}). This usually points at a driver or "
                    "library mismatch (CUDA, xformers, bitsandbytes) rather than at your settings.",
                    advice or "Try model.attention = sdpa and check the GPU driver.")
        return f"The trainer was ended by a signal ({name}) without writing its final event.", advice
    if rc == 137:
        return ("The trainer was killed (exit code 137 = SIGKILL), most likely by the out-of-memory killer.",
                OOM_ADVICE)
    if oom:
        return ("The trainer ran out of memory and exited with code "
                f"{rc}:\n" + _last_lines(output, 8), OOM_ADVICE)
    if rc == 0:
        return ("The trainer exited normally but never reported the end of the run.",
                "Look at the last log lines below.")
    return (f"The trainer exited with code {rc} without reporting an error:\n" + _last_lines(output, 12),
            "The last log lines below usually say why.")


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def age(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "–"
