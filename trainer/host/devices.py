"""Which device a run trains on, and what each device cannot do. Torch-free (validate and the UI use it).

``general.device = auto`` picks CUDA (or ROCm, which torch also calls ``cuda``) when a GPU is visible,
else Apple's MPS when this is an Apple Silicon Mac with a PyTorch that has it, else the CPU.

MPS runs most of what training needs, but not everything:

* no float8 types: fp8 weight storage (``parts.<part>.fp8``) is refused;
* no bitsandbytes kernels: the ``*8bit`` optimizers are refused (their 32-bit twins are named);
* no xformers: ``model.attention = sdpa``;
* one device per Mac: no multi-process training, so no FSDP either;
* bf16 needs macOS 14 (Sonoma) or newer; fp16 autocast works;
* operations without an MPS kernel run on the CPU: the trainer sets ``PYTORCH_ENABLE_MPS_FALLBACK=1``
  (before torch is imported) and says so at the start of the run; torch warns once per operation.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, List, Tuple

from trainer.optim.registry import OPTIMIZERS

MPS_FALLBACK_ENV = "PYTORCH_ENABLE_MPS_FALLBACK"
MPS_FALLBACK_NOTE = ("Training on Apple's MPS. Operations without an MPS kernel run on the CPU instead "
                     f"({MPS_FALLBACK_ENV}=1): slower, but correct; PyTorch names each such operation once "
                     "in the log.")


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def enable_mps_fallback() -> None:
    """Before torch is imported: let operations MPS lacks fall back to the CPU (Apple Silicon only)."""
    if is_apple_silicon():
        os.environ.setdefault(MPS_FALLBACK_ENV, "1")


def macos_major() -> int:
    try:
        return int(platform.mac_ver()[0].split(".")[0] or 0)
    except ValueError:
        return 0


def device_problems(cfg: Any, device: str) -> List[Tuple[str, str, str]]:
    """(key, message, level) for settings the device cannot run; level "error" refuses the run."""
    if device != "mps":
        return []
    out: List[Tuple[str, str, str]] = []
    for slot in cfg.parts:
        if bool(cfg.parts[slot].get("fp8", False)):
            out.append((f"parts.{slot}.fp8", f"parts.{slot}.fp8: MPS has no float8 types. Turn fp8 storage off, or "
                                             "use bf16 weights (parts.<part>.dtype) to save memory.", "error"))
    name = str(cfg.training.optimizer.name)
    spec = OPTIMIZERS.get(name)
    if spec is not None and spec.eight_bit:
        out.append(("training.optimizer.name",
                    f"training.optimizer.name = {name}: bitsandbytes' 8-bit optimizers need a CUDA GPU and do not "
                    f"run on MPS. Use {spec.fallback} (the same optimizer with 32-bit state), or adafactor/came "
                    "for low memory.", "error"))
    if cfg.model.attention == "xformers":
        out.append(("model.attention", "model.attention = xformers: xformers does not run on MPS. Use sdpa.", "error"))
    if int(cfg.general.num_processes) > 1:
        out.append(("general.num_processes", "general.num_processes > 1: a Mac has one MPS device, so training "
                                             "runs in one process. Set it to 1.", "error"))
    if cfg.training.mixed_precision == "bf16" and sys.platform == "darwin" and 0 < macos_major() < 14:
        out.append(("training.mixed_precision", "training.mixed_precision = bf16 needs macOS 14 (Sonoma) or newer "
                                                "on MPS. Use fp16, or update macOS.", "error"))
    out.append(("general.device", MPS_FALLBACK_NOTE, "warning"))
    return out


def resolve_device(requested: str, cuda: bool, mps: bool) -> str:
    """``cuda``/``mps``/``cpu`` for ``general.device``; raises ValueError with the message for one that is missing."""
    if requested == "auto":
        return "cuda" if cuda else "mps" if mps else "cpu"
    if requested == "cuda" and not cuda:
        hint = " This Mac has MPS: use general.device = mps or auto." if mps else " Use auto or cpu."
        raise ValueError("general.device = cuda, but no CUDA GPU is visible (PyTorch "
                         "reports none: a CPU-only build, or a driver problem; `python launch.py --doctor` "
                         "shows which)." + hint)
    if requested == "mps" and not mps:
        raise ValueError("general.device = mps, but MPS is not available: it needs an Apple Silicon Mac with "
                         "macOS 12.3 or newer and a PyTorch build with MPS. Use auto or cpu.")
    return requested


__all__ = ["MPS_FALLBACK_ENV", "MPS_FALLBACK_NOTE", "device_problems", "enable_mps_fallback", "is_apple_silicon",
           "macos_major", "resolve_device"]
