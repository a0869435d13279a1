"""The GPUs of this machine, for the General tab's device picker — without importing torch.

``nvidia-smi`` (installed with every NVIDIA driver) lists the cards; the UI process never imports torch
(DESIGN.md), and asking the driver is also what tells a user "no GPU found" before a run starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int

    @property
    def label(self) -> str:
        return f"{self.index}: {self.name} ({self.memory_mib / 1024:.0f} GiB)"


def detect_gpus(timeout: float = 10.0) -> Tuple[List[Gpu], str]:
    """(GPUs, note). The note says why the list is empty when it is."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "No NVIDIA GPU found (nvidia-smi is not on PATH): training runs on the CPU (or Apple MPS)."
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi did not answer ({exc}): is the NVIDIA driver working?"
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()
        return [], f"nvidia-smi failed: {why[0] if why else f'exit code {out.returncode}'}"
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        try:
            mem = int(float(parts[-1]))
        except ValueError:
            mem = 0
        gpus.append(Gpu(int(parts[0]), ", ".join(parts[1:-1]), mem))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = "" if gpus else "nvidia-smi lists no GPU."
    if gpus and visible is not None:
        note = (f"CUDA_VISIBLE_DEVICES={visible} is set for this UI: trainer processes see only those GPUs, "
                "numbered from 0.")
    return gpus, note


def parse_ids(text: str) -> List[str]:
    return [s.strip() for s in str(text or "").split(",") if s.strip()]


def selection_to_fields(selected: Sequence[str]) -> Tuple[str, int]:
    """Ticked GPU labels -> (general.gpu_ids, general.num_processes): one process per GPU."""
    ids = sorted({int(s.split(":", 1)[0]) for s in selected if s.split(":", 1)[0].strip().isdigit()})
    return ",".join(str(i) for i in ids), max(1, len(ids))


def fields_to_selection(gpus: Sequence[Gpu], gpu_ids: str, num_processes: int) -> List[str]:
    """The labels to tick for a config: its gpu_ids, or the first num_processes GPUs when gpu_ids is empty."""
    ids = parse_ids(gpu_ids)
    if ids:
        wanted = {int(i) for i in ids if i.isdigit()}
    else:
        wanted = {g.index for g in list(gpus)[:max(1, int(num_processes or 1))]} if gpus else set()
    return [g.label for g in gpus if g.index in wanted]


def launch_summary(num_processes: int, gpu_ids: str, batch_size: Optional[int], accumulation: Optional[int],
                   device: str = "auto", gpus: Sequence[Gpu] = ()) -> str:
    """What Start will do with these settings, in one paragraph."""
    n = max(1, int(num_processes or 1))
    ids = parse_ids(gpu_ids)
    b, a = int(batch_size or 1), int(accumulation or 1)
    eff = f"Effective batch = {b} per process x {a} accumulation x {n} process(es) = **{b * a * n}**."
    if device == "cpu":
        where = "on the CPU"
    elif ids:
        where = f"on GPU {', '.join(ids)}"
    elif gpus:
        where = f"on GPU {', '.join(str(g.index) for g in list(gpus)[:n])}"
    else:
        where = "on the default device"
    if n == 1:
        return f"Start runs one training process {where}. {eff}"
    return (f"Start launches **{n} processes** {where} through accelerate (`accelerate launch --multi_gpu "
            f"--num_processes {n}`), each with its slice of every batch. {eff}")
