"""``python -m trainer.host.doctor``: what the installed torch can use here, and what of Atelier does not fit.

``python launch.py --doctor`` runs this in the project's virtual environment after its own part (OS, GPUs the
launcher found, the torch build it chooses). ``report()`` returns the lines, so tests can call it in-process;
it works without torch too (it says torch is missing).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import platform
import sys
from typing import Any, List, Optional, Tuple

from trainer.optim.registry import OPTIMIZERS

GiB = 1024 ** 3


def _short(version: Optional[str]) -> str:
    return ".".join((version or "").split("-")[0].split(".")[:2])


def _quiet_import(name: str) -> Tuple[Optional[Any], str]:
    """(module, "") or (None, why); what the import prints (bitsandbytes talks on CPU machines) is swallowed."""
    if importlib.util.find_spec(name) is None:
        return None, "not installed"
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return importlib.import_module(name), ""
    except Exception as exc:  # a broken install, a missing native library …
        return None, f"installed, but does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"


def _eight_bit_optimizers() -> str:
    names = [n for n, spec in OPTIMIZERS.items() if spec.eight_bit]
    return f" ({', '.join(names[:4])}{', …' if len(names) > 4 else ''})" if names else ""


def report() -> List[str]:
    """Human-readable lines: torch and its build, devices with free/total memory, MPS, distributed backends,
    optional libraries, then what of Atelier does not fit on this machine."""
    system = platform.system()
    lines = [f"Python: {platform.python_version()} ({sys.executable})"]
    torch, why = _quiet_import("torch")
    if torch is None:
        return lines + [f"torch: {why}. Run `python launch.py` to install it."]
    hip = getattr(torch.version, "hip", None)
    cuda = torch.version.cuda
    build = f"ROCm {_short(hip)}" if hip else f"CUDA {cuda}" if cuda else "CPU build (no CUDA or ROCm)"
    mps_mod = getattr(torch.backends, "mps", None)
    try:
        mps = bool(mps_mod is not None and mps_mod.is_available())
        mps_built = bool(mps_mod is not None and mps_mod.is_built())
    except Exception:
        mps = mps_built = False
    if mps and not hip and not cuda:
        build = "MPS (Apple GPU)"
    lines.append(f"torch: {torch.__version__}, {build}")
    misfits: List[str] = []

    try:
        cuda_ok = bool(torch.cuda.is_available())
        count = torch.cuda.device_count() if cuda_ok else 0
    except Exception as exc:
        cuda_ok, count = False, 0
        lines.append(f"CUDA: error while asking torch ({exc})")
    if cuda_ok:
        lines.append(f"CUDA: available, {count} device{'s' if count != 1 else ''}" + (" (ROCm)" if hip else ""))
    else:
        lines.append("CUDA: not available" + (" (this torch has no CUDA or ROCm)" if not (cuda or hip) else
                                              " (this torch has it, but sees no GPU: driver?)"))
    low_cc = []
    for i in range(count):
        try:
            props = torch.cuda.get_device_properties(i)
            if hip:
                kind = f"arch {getattr(props, 'gcnArchName', '?')}"
            else:
                kind = f"compute capability {props.major}.{props.minor}"
                if (props.major, props.minor) < (8, 9):
                    low_cc.append(f"cuda:{i}")
            free, total = torch.cuda.mem_get_info(i)
            lines.append(f"  cuda:{i} {props.name}: {kind}, {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB")
        except Exception as exc:
            lines.append(f"  cuda:{i}: could not be queried ({exc})")

    if mps:
        extra = ""
        try:
            extra = f", about {torch.mps.recommended_max_memory() / GiB:.1f} GiB usable"
        except Exception:
            pass
        lines.append(f"MPS: available{extra}")
    else:
        lines.append("MPS: not available" + (" (this torch has MPS, but this Mac cannot run it: macOS 12.3+?)"
                                            if mps_built else " (Apple Silicon Macs only)"))
    device = "cuda" if cuda_ok else "mps" if mps else "cpu"
    lines.append(f"general.device = auto trains on: {device}")

    try:
        import torch.distributed as dist  # torch inside: the doctor also reports a missing or broken torch
        dist_ok = dist.is_available()
        nccl = dist_ok and dist.is_nccl_available()
        gloo = dist_ok and dist.is_gloo_available()
        lines.append(f"Distributed: {'available' if dist_ok else 'not in this torch'}; "
                     f"NCCL {'yes' if nccl else 'no'}, gloo {'yes' if gloo else 'no'}")
    except Exception as exc:
        nccl = gloo = False
        lines.append(f"Distributed: could not be checked ({exc})")

    bnb, why = _quiet_import("bitsandbytes")
    lines.append(f"bitsandbytes: {getattr(bnb, '__version__', '?')} importable" if bnb else f"bitsandbytes: {why}")
    xf, xwhy = _quiet_import("xformers")
    lines.append(f"xformers: {getattr(xf, '__version__', '?')} importable" if xf else
                 f"xformers: {xwhy} (optional: model.attention = sdpa needs nothing extra)")
    fp8 = hasattr(torch, "float8_e4m3fn")
    lines.append("fp8 weight storage: " + ("this torch has float8 types" if fp8 else "this torch has no float8 types"))

    if device in ("cuda", "cpu"):  # torch.compile's kernels: Triton on NVIDIA GPUs, C++ on the CPU
        try:
            from trainer.train.compile import backend_problem
            compile_problem = backend_problem(device)
        except Exception as exc:
            compile_problem = f"training.compile could not be checked here ({type(exc).__name__}: {exc})."
        lines.append(f"training.compile ({'Triton' if device == 'cuda' else 'C++'} kernels): "
                     + ("can compile here" if compile_problem is None else "cannot compile here"))
    else:
        compile_problem = None

    # What of Atelier does not fit on this machine.
    opt8 = _eight_bit_optimizers()
    if not cuda_ok or hip:
        where = "on ROCm they depend on the bitsandbytes build" if hip else "there is none here"
        misfits.append(f"bitsandbytes' 8-bit optimizers{opt8} need a CUDA GPU ({where}): use their 32-bit twins, "
                       "or adafactor/came for low memory.")
    elif bnb is None:
        misfits.append(f"bitsandbytes {why}: the 8-bit optimizers{opt8} are unavailable; "
                       "`pip install bitsandbytes` in the venv.")
    if system == "Darwin" or hip:
        misfits.append("xformers does not run " + ("on macOS" if system == "Darwin" else "on ROCm")
                       + ": use model.attention = sdpa.")
    elif xf is None:
        misfits.append("model.attention = xformers needs the xformers package (not installed): sdpa works without it.")
    if device == "mps" or not fp8:
        misfits.append("fp8 weight storage (parts.<part>.fp8): " + ("MPS has no float8 types" if fp8 else
                       "this torch has no float8 types") + "; store the weights in bf16 instead.")
    if low_cc or (device == "cpu"):
        misfits.append("fp8 math in hardware needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper, "
                       "Blackwell)" + (f"; not {', '.join(low_cc)}" if low_cc else "; there is none here")
                       + ". Atelier's fp8 weight storage only stores in fp8 and upcasts each layer, so it still "
                       "saves memory here, without the speed-up.")
    if compile_problem:
        misfits.append(compile_problem)
    if not nccl:
        reason = "Windows and macOS builds of torch have none" if system in ("Windows", "Darwin") else \
            "this torch has none"
        misfits.append(f"NCCL: {reason}, so several training processes talk through gloo"
                       + (" (slower between GPUs)." if gloo else "; and gloo is missing too: one process only."))
    if device == "mps":
        misfits.append("A Mac has one MPS device: training runs in one process (no multi-GPU, no FSDP).")
    if device == "cpu":
        misfits.append("No GPU that torch can use: training runs on the CPU, which is slow beyond the demo. "
                       "`python launch.py --doctor` also shows which GPUs the launcher found and the torch build it picks.")
    long_paths = windows_long_paths()
    if long_paths is not None:
        lines.append(f"Windows long paths: {'on' if long_paths else 'off'}")
        if not long_paths:
            misfits.append("Windows long paths are off: a file path over 260 characters (deep workspaces, long run "
                           "names) cannot be written. Switch LongPathsEnabled on (Group Policy, or the registry key "
                           "HKLM\\SYSTEM\\CurrentControlSet\\Control\\FileSystem), or keep general.workspace short.")
    lines.append("What does not fit here:")
    lines += [f"  - {m}" for m in misfits] or ["  - nothing: everything Atelier offers runs here."]
    return lines


def windows_long_paths() -> Optional[bool]:
    """Windows: whether paths longer than 260 characters work (LongPathsEnabled); None elsewhere."""
    if os.name != "nt":
        return None
    try:
        import winreg  # Windows only
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SYSTEM\CurrentControlSet\Control\FileSystem") as key:
            return bool(winreg.QueryValueEx(key, "LongPathsEnabled")[0])
    except (ImportError, OSError):
        return False


def main() -> int:
    for line in report():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
