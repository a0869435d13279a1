"""What a run folder says about its run: state, progress, curves, samples, problems.

Reads ``events.jsonl`` incrementally (one :class:`trainer.events.EventTail` per run, shared by all
browser sessions), the samples folder, the logs and the runner's ``launch.json``/``exit.json``.
A trainer that vanished without a ``failed`` event is explained in plain words, with advice when
it looks like the machine ran out of memory. Imports neither Gradio nor torch.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from trainer.events import TERMINAL, EventTail
from webui import runner

# step<STEP>-p<PROMPT>[-ema][-<N>].png: -ema for the EMA weights' sample, -N for a second one at the same step
SAMPLE_RE = re.compile(r"step(\d+)-p(\d+)(-ema)?(?:-(\d+))?\.(png|jpg|jpeg|webp|mp4|webm)$", re.I)
VIDEO_SUFFIXES = (".mp4", ".webm")  # a video family's sample: the page's galleries play it
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
    """Everything the Run and Runs tabs show about one run."""
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
    warnings: List[str] = field(default_factory=list)
    backups: List[str] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)
    loss_points: List[tuple] = field(default_factory=list)   # (step, loss)
    lr_points: List[tuple] = field(default_factory=list)     # (step, group, lr)
    samples: List[Sample] = field(default_factory=list)
    version: int = 0              # grows whenever new events arrived

    @property
    def active(self) -> bool:
        return self.state in ("starting", "running", "stopping")

    @property
    def progress(self) -> float:
        return min(1.0, self.step / self.total_steps) if self.total_steps else 0.0


class _Cache:
    def __init__(self, path: Path):
        self.tail = EventTail(path / "events.jsonl")
        self.events: List[dict] = []
        self.version = 0


class RunMonitor:
    """Per-process cache of run event streams, read incrementally."""

    def __init__(self) -> None:
        self._cache: Dict[str, _Cache] = {}
        self._lock = threading.Lock()

    def events(self, run_dir: Path) -> tuple[List[dict], int]:
        run_dir = Path(run_dir)
        with self._lock:
            cache = self._cache.get(str(run_dir))
            if cache is None:
                cache = self._cache[str(run_dir)] = _Cache(run_dir)
            new = list(cache.tail.read_new())
            if new:
                cache.events.extend(new)
                cache.version += 1
            return cache.events, cache.version

    def view(self, run_dir: Path) -> RunView:
        run_dir = Path(run_dir)
        events, version = self.events(run_dir)
        return build_view(run_dir, events, version)


def _segment(run_dir: Path, events: List[dict]) -> tuple[List[dict], Optional[dict]]:
    """The events of the latest launch (a resumed run appends a new segment) and launch.json."""
    launch = runner.read_json(run_dir / runner.LAUNCH)
    starts = [i for i, ev in enumerate(events) if ev.get("type") == "started"]
    if not starts:
        return events, launch
    last = starts[-1]
    if launch and events[last].get("time", 0) < launch.get("started", 0) - 1:
        return [], launch  # relaunched, the new process has not said "started" yet
    return events[last:], launch


def build_view(run_dir: Path, events: List[dict], version: int = 0) -> RunView:
    view = RunView(name=run_dir.name, path=run_dir, version=version)
    segment, launch = _segment(run_dir, events)
    losses: Dict[int, float] = {}
    lrs: Dict[tuple, float] = {}
    prompts: Dict[int, str] = {}
    for ev in events:  # curves, samples, backups and outputs span all segments
        kind = ev.get("type")
        if kind == "step" and ev.get("loss") is not None:
            losses[int(ev.get("step", 0))] = float(ev["loss"])
            for group, value in (ev.get("lr") or {}).items():
                lrs[(int(ev.get("step", 0)), str(group))] = float(value)
        elif kind == "sample":
            for i, text in enumerate(ev.get("prompts") or []):
                prompts[i] = str(text)
        elif kind == "backup" and ev.get("path"):
            view.backups.append(str(ev["path"]))
        elif kind == "saved" and ev.get("path"):
            view.outputs.append(str(ev["path"]))
    # warnings the trainer emits before "started" (dataset problems found while planning) belong to this launch
    start = len(events) - len(segment)
    previous_end = max((i for i, ev in enumerate(events[:start]) if ev.get("type") in TERMINAL), default=-1)
    view.warnings += [str(ev.get("message", "")) for ev in events[previous_end + 1:start] if ev.get("type") == "warning"]
    for ev in segment:
        kind = ev.get("type")
        if kind == "started":
            view.started_at = ev.get("time")
            view.total_steps = int(ev.get("total_steps") or 0)
            view.step = int(ev.get("resumed_from_step") or 0)
        elif kind == "step":
            view.step = int(ev.get("step", view.step))
            view.total_steps = int(ev.get("total_steps") or view.total_steps)
            view.epoch = int(ev.get("epoch", view.epoch) or 0)
            view.loss, view.it_s, view.eta_s = ev.get("loss"), ev.get("it_s"), ev.get("eta_s")
            view.lr = dict(ev.get("lr") or {})
        elif kind == "warning":
            view.warnings.append(str(ev.get("message", "")))
        elif kind == "error":
            view.message = str(ev.get("message", ""))
            view.traceback = str(ev.get("traceback", "") or "")
        elif kind in TERMINAL:
            view.state = kind
            view.ended_at = ev.get("time")
            view.step = int(ev.get("step") or view.step)
            if kind != "failed" or not view.message:
                view.message = str(ev.get("message", "") or view.message)
    view.loss_points = sorted(losses.items())
    view.lr_points = sorted((s, g, v) for (s, g), v in lrs.items())
    view.samples = scan_samples(run_dir, prompts)
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
            view.state = "running" if any(ev.get("type") == "started" for ev in segment) else "starting"
        return view
    if not launch and not (run_dir / runner.PIDFILE).exists() and not events:
        view.state = "new"
        return view
    req = runner.stop_requested(run_dir) or {}
    if runner.read_json(run_dir / runner.EXIT) is None and not req.get("forced") and \
            _active_within(run_dir, EXIT_GRACE_S):
        # the trainer has just ended and its supervisor is still writing down how (or a busy machine has not yet
        # let it): not "gone without an exit code" yet; the next refresh tells (a forced stop writes none)
        view.state = "stopping" if req else \
            ("running" if any(ev.get("type") == "started" for ev in segment) else "starting")
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


def downsample(points: List[tuple], limit: int = 400) -> List[tuple]:
    """At most ``limit`` points, keeping the last one (charts do not need every step)."""
    if len(points) <= limit:
        return points
    stride = -(-len(points) // limit)
    out = points[::stride]
    return out if out[-1] == points[-1] else out + [points[-1]]


def smooth(values: List[float], weight: float = 0.9) -> List[float]:
    """Exponential moving average with TensorBoard's debiasing, for the loss chart."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def age(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "–"
