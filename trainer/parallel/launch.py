"""Launching several training processes and reading how they ended (torch-free: the launcher and the CLI use it).

- Starting them: :func:`launch_argv` (``accelerate launch`` with its torchrun-based launcher), :func:`check_devices`.
- Failures: a failing process writes ``rank-K-error.json`` into the run folder, and every process records a crash
  below Python (segfault, abort) with faulthandler in ``rank-K-crash.log``, so rank 0 (or the launcher) can name the
  rank that failed and where (:func:`explain_failure`) in the ``failed`` event.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from trainer.host.procs import pid_alive
from trainer.parallel.plan import accelerate_config_file

# ------------------------------------------------------------------------------------------------
# failures: which rank, and why
# ------------------------------------------------------------------------------------------------

def rank_file(run_dir: Path, rank: int, what: str) -> Path:
    return Path(run_dir) / f"rank-{rank}-{what}.json"


def crash_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank-{rank}-crash.log"


def write_rank_info(run_dir: Path, rank: int) -> None:
    """``rank-K-process.json``: pid and host, so rank 0 can tell a rank that died without a word."""
    _write_json(rank_file(run_dir, rank, "process"), {"rank": rank, "pid": os.getpid(),
                                                      "host": socket.gethostname(), "time": time.time()})


def write_rank_error(run_dir: Path, rank: int, message: str, tb: str = "") -> None:
    _write_json(rank_file(run_dir, rank, "error"), {"rank": rank, "message": message, "traceback": tb,
                                                    "host": socket.gethostname(), "time": time.time()})


_CRASH_LOG = None  # the open file faulthandler writes to (it must stay open for the process's life)


def record_crashes(run_dir: Path, rank: int) -> None:
    """``rank-K-crash.log``: where Python's faulthandler writes every thread's stack if this process dies
    below Python (a segfault in a native library, an abort in a collective), so rank 0 can say where
    another rank crashed instead of only that its process is gone. Emptied at each start."""
    global _CRASH_LOG
    try:
        f = open(crash_log(run_dir, rank), "w", encoding="utf-8")
    except OSError:
        return  # the trainer still runs; a crash then only shows on stderr
    faulthandler.enable(file=f, all_threads=True)
    if _CRASH_LOG is not None:
        _CRASH_LOG.close()
    _CRASH_LOG = f


def stop_recording_crashes(run_dir: Path, rank: int) -> None:
    """A normal end: faulthandler back on stderr, the empty crash log removed."""
    global _CRASH_LOG
    if _CRASH_LOG is None:
        return
    faulthandler.enable(all_threads=True)
    _CRASH_LOG.close()
    _CRASH_LOG = None
    path = crash_log(run_dir, rank)
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def crash_report(run_dir: Path, rank: int) -> Tuple[str, str]:
    """(summary, whole text) of ``rank-K-crash.log``: e.g. "Segmentation fault in fault_injection
    (trainer/parallel/distributed.py, line 12)" — the crash and the innermost Python frame of the thread that
    crashed; ("", "") when the rank left no crash report."""
    try:
        text = crash_log(run_dir, rank).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "", ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = next((ln for ln in lines if ln.startswith("Fatal Python error:")), "")
    if not fatal:
        return "", text
    what = fatal.split(":", 1)[1].strip()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    frame = next((ln for ln in lines[start + 1:] if ln.startswith("File ")), "") if start is not None else ""
    if frame:  # File "/path/trainer/x.py", line 12 in name
        m = re.match(r'File "(.+)", line (\d+) in (.+)', frame)
        if m:
            parts = Path(m.group(1)).parts  # from Atelier's package folder on; a library's file by its last two parts
            top = max((i for i, part in enumerate(parts) if part in ("trainer", "webui")), default=len(parts) - 2)
            short = "/".join(parts[top:])
            return f"{what} in {m.group(3)} ({short}, line {m.group(2)})", text
    return what, text


def rank_errors(run_dir: Path) -> List[dict]:
    out = []
    for p in sorted(Path(run_dir).glob("rank-*-error.json")):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: e.get("time", 0))


def dead_ranks(run_dir: Path, world: int) -> List[int]:
    """Ranks on this host whose process is gone (died without writing an error, e.g. killed)."""
    host = socket.gethostname()
    dead = []
    for k in range(world):
        try:
            info = json.loads(rank_file(run_dir, k, "process").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if info.get("host") != host:
            continue
        try:
            if not pid_alive(int(info["pid"])):
                dead.append(k)
        except (TypeError, ValueError, KeyError):
            pass
    return dead


def explain_failure(run_dir: Path, own_rank: int, own_message: str, peer_lost: bool, world: int,
                    wait_s: float = 3.0) -> Tuple[int, str]:
    """(rank, message) that a ``failed`` event should name. When this process only lost its peers,
    the cause is another rank's error file (waited for briefly) or a rank whose process is gone."""
    if not peer_lost:
        return own_rank, own_message
    deadline = time.time() + wait_s
    while True:
        others = [e for e in rank_errors(run_dir) if e.get("rank") != own_rank]
        if others:
            e = others[0]
            return int(e["rank"]), str(e.get("message", ""))
        gone = [k for k in dead_ranks(run_dir, world) if k != own_rank]
        if gone and time.time() > deadline - wait_s / 2:
            crash, _ = crash_report(run_dir, gone[0])
            if crash:
                return gone[0], (f"process rank {gone[0]} crashed: {crash} (every thread's stack: "
                                 f"rank-{gone[0]}-crash.log in the run folder). Rank {own_rank} saw: {own_message}")
            return gone[0], (f"process rank {gone[0]} ended without a Python error (killed, out of memory, "
                             f"or exited). Rank {own_rank} saw: {own_message}")
        if time.time() > deadline:
            return own_rank, (f"rank {own_rank} lost contact with the other processes (one died or hung "
                              f"past general.dist_timeout_s): {own_message}")
        time.sleep(0.2)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# launching (no torch)
# ------------------------------------------------------------------------------------------------

def launch_argv(cfg, trainer_args: Sequence[str], python: str) -> List[str]:
    """``python -m accelerate.commands.launch --multi_gpu --num_processes N … -m trainer ARGS``.

    ``--multi_gpu`` picks accelerate's torchrun-based launcher, which also starts N CPU processes
    (gloo) on a machine without GPUs; ``--cpu`` would instead ask for mpirun. With
    ``general.accelerate_config`` the file comes first as ``--config_file``; when it is an FSDP config,
    ``--multi_gpu`` is left out (it would override the file's ``distributed_type``), so accelerate
    hands its FSDP settings to the processes (see :func:`trainer.parallel.fsdp.fsdp_from_launcher`)."""
    g = cfg.general
    n = int(g.num_processes)
    conf_path = str(g.get("accelerate_config", "") or "").strip()
    head: List[str] = ["--multi_gpu"]
    if conf_path:
        conf = accelerate_config_file(cfg) or {}
        head = ["--config_file", str(Path(conf_path).expanduser())]
        if str(conf.get("distributed_type", "")).upper() != "FSDP":
            head.append("--multi_gpu")
    argv = [python, "-m", "accelerate.commands.launch", *head, "--num_processes", str(n),
            "--num_machines", "1", "--mixed_precision", str(cfg.training.mixed_precision),
            "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    ids = str(getattr(g, "gpu_ids", "") or "").strip()
    if ids and g.device != "cpu":
        argv += ["--gpu_ids", ids]
    return argv + ["-m", "trainer", *trainer_args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_devices(cfg) -> Optional[str]:
    """An error message when ``general.num_processes`` cannot run here, else None."""
    g = cfg.general
    n = int(g.num_processes)
    if n <= 1:
        return None
    ids = [s.strip() for s in str(getattr(g, "gpu_ids", "") or "").split(",") if s.strip()]
    if ids and len(ids) != n:
        return (f"general.gpu_ids lists {len(ids)} GPU(s) ({','.join(ids)}) but general.num_processes = {n}: "
                "give one GPU per process, or empty gpu_ids to use the first N.")
    if g.device == "cpu":
        return None
    import torch  # torch only to count GPUs: the launcher stays torch-free
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if g.device == "cuda" or (g.device == "auto" and count > 0):
        if n > count:
            return (f"general.num_processes = {n}, but only {count} CUDA GPU(s) are visible: use at most {count} "
                    "processes (one per GPU), or general.device = cpu for CPU processes.")
        bad = [i for i in ids if not i.isdigit() or int(i) >= count]
        if bad:
            return f"general.gpu_ids names GPU {bad[0]}, but the visible GPUs are 0..{count - 1}."
    return None
