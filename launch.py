#!/usr/bin/env python3
"""Atelier bootstrap: makes .venv, installs the project, then starts the web UI (or runs the tests).

    python3 launch.py            # install (first time) and serve the UI on http://127.0.0.1:7860
    python3 launch.py --tests    # install the CPU torch wheel + test extras, then run pytest
    python3 launch.py --demo-cli # install and train the offline demo preset from the command line

Every other argument goes to the web UI (``--listen``, ``--port``, ``--share``, ``--auth user:pass`` …).

Why a bootstrap: torch must be installed *before* the project, in the right build. On an NVIDIA
machine we install the CUDA build; for tests we install the CPU wheel, so a bare ``torch`` requirement
never pulls a multi-GB CUDA download onto a CPU-only CI box. Set ATELIER_TORCH_INDEX_URL to install
torch from a specific wheel index (e.g. a CUDA-version-specific one, or a CPU-only one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("ATELIER_VENV", ROOT / ".venv"))
TORCH_VERSION = "2.13.0"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def torch_installed(py: Path) -> str:
    r = subprocess.run([str(py), "-c", "import torch,sys; sys.stdout.write(torch.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def install(extras: str = "", cpu_torch: bool = False) -> Path:
    """Create the venv and install torch + the project, skipping work already done."""
    if not venv_python().exists():
        print(f"Creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = venv_python()
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    have = torch_installed(py)
    if not have.startswith(TORCH_VERSION):
        index = os.environ.get("ATELIER_TORCH_INDEX_URL")
        args = [f"torch=={TORCH_VERSION}"] + (["--index-url", index] if index else [])
        if not cpu_torch and has_nvidia_gpu():
            print("NVIDIA GPU found: installing the CUDA build of torch.", flush=True)
        elif cpu_torch:
            print("Installing the CPU build of torch for the tests.", flush=True)
        run(pip + args)
    # Re-install the project only when pyproject.toml changed (editable install: code changes are live).
    stamp = VENV / f".atelier-installed{extras.replace('[', '-').replace(']', '')}"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        run(pip + ["-e", f"{ROOT}{extras}"])
        stamp.write_text(digest)
    return py


def main(argv: list) -> int:
    os.chdir(ROOT)
    if "--tests" in argv:
        rest = [a for a in argv if a != "--tests"]
        if not any(a.startswith(("-n", "--numprocesses")) for a in rest):
            rest = ["-n", "2", *rest]  # two workers (pytest-xdist): the suite waits on processes and browsers a lot
        py = install("[test]", cpu_torch=True)
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
        return subprocess.call([str(py), "-m", "pytest", *rest], env=env)
    py = install()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    if "--demo-cli" in argv:
        return subprocess.call([str(py), "-m", "trainer", "train", "--preset", "demo"], env=env)
    return subprocess.call([str(py), "-m", "webui", *argv], env=env)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as exc:
        print(f"\nInstallation step failed: {' '.join(map(str, exc.cmd))}\n"
              "Check your network / disk space and run the same command again.", file=sys.stderr)
        sys.exit(exc.returncode or 1)
    except KeyboardInterrupt:
        sys.exit(130)
