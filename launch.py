#!/usr/bin/env python3
"""Atelier bootstrap: makes .venv, installs torch and the project, then starts the web UI (or runs the tests).

    python3 launch.py            # install (first time) and serve the UI on http://127.0.0.1:7860
    python3 launch.py --tests    # install torch + the test extras, then run pytest
    python3 launch.py --demo-cli # install and train the offline demo preset from the command line
    python3 launch.py --doctor   # say what this machine has and what torch build it gets; installs nothing
    python3 launch.py --help     # every flag (the launcher's and the UI's); installs nothing

On Windows, double-click ``launch.bat`` (or run ``launch.bat --doctor`` in a terminal): it runs this file
with the ``py`` launcher or ``python`` and keeps the window open when something fails.

Every other argument goes to the web UI (``--listen``, ``--port``, ``--share``, ``--auth user:pass`` …).
``--tests`` needs Chromium for the browser tests: it installs Debian's ``chromium`` with apt-get when it runs as
root, and otherwise stops with one line saying what to install (the browser tests are never skipped).

Why a bootstrap: torch must be installed *before* the project, in the build this machine can use, and
PyPI's wheel is not always that build (on Windows PyPI has only the CPU build). So the launcher looks
for GPUs first (``nvidia-smi``; ``rocminfo`` on Linux; Apple Silicon) and picks:

* NVIDIA (Linux, Windows): the CUDA build the driver runs (``CUDA_BUILDS``) from download.pytorch.org;
* AMD (Linux): the ROCm build from download.pytorch.org (there is no Windows ROCm build there: CPU);
* Apple Silicon: PyPI's wheel, which has MPS (Intel Macs have no torch 2.13 wheels);
* no GPU: the CPU build (download.pytorch.org/whl/cpu on Linux, where PyPI's wheel is the big CUDA one).

After installing, and on every start, one small subprocess asks the installed torch what it can use and
prints it; when a GPU was found but torch cannot use it, a warning says what to do. ``--tests`` installs
``torch==2.13.0`` from the configured index without looking for GPUs. Set ATELIER_TORCH_INDEX_URL to
install torch from another wheel index (a mirror, a different CUDA version, a Windows ROCm build).
To switch builds later, delete .venv and run the launcher again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("ATELIER_VENV", ROOT / ".venv"))
TORCH_VERSION = "2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/"
# torch 2.13's CUDA builds on download.pytorch.org, newest first: (local label, CUDA version, oldest NVIDIA
# driver major version we pick it for). The first row whose driver minimum the GPU's driver meets wins.
# CHECK THIS TABLE AT EVERY TORCH UPGRADE: each torch release adds and drops CUDA builds
# (https://pytorch.org/get-started/locally/), and the driver each CUDA version needs is in NVIDIA's
# CUDA release notes. MIN_NVIDIA_DRIVER is the oldest driver any of these builds runs on.
CUDA_BUILDS: Tuple[Tuple[str, str, int], ...] = (
    ("cu130", "13.0", 580),
    ("cu128", "12.8", 570),
    ("cu126", "12.6", 0),
)
MIN_NVIDIA_DRIVER = 525
ROCM_BUILD = ("rocm7.2", "7.2")  # the same check at every torch upgrade
PROBE_TIMEOUT = 20


class TorchChoice(NamedTuple):
    """Which torch build to install and why."""
    build: str                # cu130 / cu128 / cu126 / rocm7.2 / cpu / mps / custom
    index_url: Optional[str]  # None: pip's configured index (PyPI)
    spec: str                 # the pip requirement
    expect: str               # what the installed torch should use: cuda / rocm / mps / cpu
    reason: str               # one plain sentence for the user
    keep: Tuple[str, ...] = ()  # installed local labels that also do (no reinstall); "*": any


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


# --- finding GPUs (stdlib only: torch is not installed yet) -------------------------------------------

def _output(cmd: List[str], timeout: float = PROBE_TIMEOUT) -> Optional[str]:
    """stdout of ``cmd`` when it exists on PATH and exits 0, else None."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _mib(text: str) -> Optional[int]:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]" on some boards


def parse_nvidia_smi(text: str) -> List[Dict]:
    """Rows of ``nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 3)]  # a name may hold a comma; the numbers do not
        if len(parts) == 4 and parts[0]:
            gpus.append({"name": parts[0], "driver": parts[1], "total_mib": _mib(parts[2]),
                         "free_mib": _mib(parts[3])})
    return gpus


def detect_nvidia() -> List[Dict]:
    """NVIDIA GPUs as ``{"name", "driver", "total_mib", "free_mib"}``; none when nvidia-smi is missing or fails."""
    out = _output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.free",
                   "--format=csv,noheader,nounits"])
    return parse_nvidia_smi(out) if out else []


def parse_rocminfo(text: str) -> List[Dict]:
    """GPU agents of ``rocminfo``: the ones whose ``Name`` is a gfx architecture (CPU agents are skipped)."""
    gpus = []
    for block in re.split(r"^\s*Agent \d+\s*$", text, flags=re.M)[1:]:
        name = re.search(r"^\s*Name:\s*(\S.*?)\s*$", block, re.M)  # the agent's first Name line
        if not name or not name.group(1).startswith("gfx"):
            continue
        marketing = re.search(r"^\s*Marketing Name:\s*(\S.*?)\s*$", block, re.M)
        gpus.append({"name": marketing.group(1) if marketing else name.group(1), "arch": name.group(1)})
    return gpus


def detect_amd(system: str) -> List[Dict]:
    """AMD GPUs: rocminfo's GPU agents on Linux; the display adapters Windows names on Windows."""
    if system == "Linux":
        out = _output(["rocminfo"])
        return parse_rocminfo(out) if out else []
    if system == "Windows":
        out = _output(["powershell", "-NoProfile", "-Command", "(Get-CimInstance Win32_VideoController).Name"])
        return [{"name": line.strip()} for line in (out or "").splitlines()
                if re.search(r"\b(AMD|Radeon)\b", line, re.I)]
    return []


def is_apple_silicon(system: str, machine: str) -> bool:
    return system == "Darwin" and machine.lower() in ("arm64", "aarch64")


def driver_major(driver: str) -> int:
    m = re.match(r"\s*(\d+)", driver or "")
    return int(m.group(1)) if m else 0


# --- which torch build ---------------------------------------------------------------------------------

def _gpu_names(gpus: Sequence[Dict]) -> str:
    names = [g["name"] for g in gpus]
    return names[0] if len(names) == 1 else f"{len(names)} GPUs ({', '.join(names)})"


def _expect(system: str, machine: str, nvidia: Sequence[Dict], amd: Sequence[Dict]) -> str:
    if nvidia and system in ("Linux", "Windows"):
        return "cuda"
    if amd and system == "Linux":
        return "rocm"
    return "mps" if is_apple_silicon(system, machine) else "cpu"


def choose_torch(system: str, machine: str, nvidia: Sequence[Dict], amd: Sequence[Dict],
                 env: Mapping[str, str], tests: bool = False) -> TorchChoice:
    """The torch build for this machine. Raises SystemExit (with the reason) where torch has no wheels."""
    plain = f"torch=={TORCH_VERSION}"
    custom = env.get("ATELIER_TORCH_INDEX_URL")
    if custom:
        return TorchChoice("custom", custom, plain, "cpu" if tests else _expect(system, machine, nvidia, amd),
                           f"ATELIER_TORCH_INDEX_URL is set: installing torch {TORCH_VERSION} from {custom}.")
    if tests:  # the configured index (PyPI): the tests run on the CPU, no GPU probing
        return TorchChoice("cpu", None, plain, "cpu", f"Installing torch {TORCH_VERSION} for the tests.", ("*",))
    if system == "Darwin":
        if is_apple_silicon(system, machine):
            return TorchChoice("mps", None, plain, "mps",
                               f"Apple Silicon Mac: installing torch {TORCH_VERSION} from PyPI (it has MPS, the "
                               "Apple GPU backend).")
        raise SystemExit(f"torch {TORCH_VERSION} has no wheels for Intel Macs ({machine}): Atelier needs an Apple "
                         "Silicon Mac, Linux or Windows. On an Apple Silicon Mac this Python runs under Rosetta: "
                         "install the arm64 (universal2) Python from python.org and run launch.py with it.")
    if nvidia and system in ("Linux", "Windows"):
        driver = min((g["driver"] for g in nvidia), key=driver_major)
        major = driver_major(driver)
        build, cuda, _ = next(row for row in CUDA_BUILDS if major >= row[2])
        index = TORCH_INDEX + build
        keep = tuple(row[0] for row in CUDA_BUILDS if major >= row[2])  # older CUDA builds run on this driver too
        what = f"{_gpu_names(nvidia)}, driver {driver}: "
        if major < MIN_NVIDIA_DRIVER:
            what += (f"this driver is too old for torch {TORCH_VERSION}'s CUDA builds (they need "
                     f"{MIN_NVIDIA_DRIVER} or newer), so torch will not see the GPU until you update the NVIDIA "
                     "driver (https://www.nvidia.com/drivers); meanwhile ")
        reason = what + f"installing torch {TORCH_VERSION} with CUDA {cuda} from {index}"
        return TorchChoice(build, index, f"{plain}+{build}", "cuda", reason, keep)
    if amd and system == "Linux":
        build, rocm = ROCM_BUILD
        index = TORCH_INDEX + build
        return TorchChoice(build, index, f"{plain}+{build}", "rocm",
                           f"{_gpu_names(amd)}: installing torch {TORCH_VERSION} with ROCm {rocm} from {index}")
    if amd and system == "Windows":
        return TorchChoice("cpu", None, plain, "cpu",
                           f"{_gpu_names(amd)}: PyTorch's index has no ROCm build for Windows, so torch "
                           f"{TORCH_VERSION} is installed in its CPU build from PyPI and trains on the CPU. To train "
                           "on this GPU, run Atelier under WSL2 (Linux), or set ATELIER_TORCH_INDEX_URL to a wheel "
                           "index with a Windows ROCm build of torch.", ("*",))
    if system == "Linux":  # PyPI's Linux wheel is the multi-GB CUDA build: take the CPU one
        index = TORCH_INDEX + "cpu"
        return TorchChoice("cpu", index, f"{plain}+cpu", "cpu",
                           f"No NVIDIA or AMD GPU found: installing the CPU build of torch {TORCH_VERSION} from "
                           f"{index} (training on the CPU is slow).", ("*",))
    return TorchChoice("cpu", None, plain, "cpu",
                       f"No NVIDIA GPU found: installing torch {TORCH_VERSION} from PyPI (the CPU build; training "
                       "on the CPU is slow).", ("*",))


def needs_torch_install(installed: str, spec: str, keep: Sequence[str] = ()) -> bool:
    """Whether ``spec`` (``torch==2.13.0`` or ``torch==2.13.0+cu128``) must be installed over ``installed``
    (``torch.__version__``, "" when torch is missing). A local label in ``keep`` also does ("*": any label;
    every build runs on the CPU, so the CPU choice never replaces a GPU build)."""
    if not installed:
        return True
    version, _, label = installed.partition("+")
    want_version, _, want_label = spec.partition("==")[2].partition("+")
    if version != want_version:
        return True
    if not want_label or label == want_label:
        return False
    return not ("*" in keep or label in keep)


def install_torch(pip: list, choice: TorchChoice) -> None:
    cmd = pip + [choice.spec]
    if choice.index_url:
        cmd += ["--index-url", choice.index_url]
    ours = bool(choice.index_url) and choice.index_url.startswith(TORCH_INDEX)
    if ours:
        cmd += ["--retries", "1", "--timeout", "20"]  # a closed network fails in seconds, not minutes
    try:
        run(cmd)
    except subprocess.CalledProcessError:
        if not ours:
            raise
        if choice.build == "cpu":
            print(f"\nCould not install torch from {choice.index_url}: installing torch=={TORCH_VERSION} from "
                  "PyPI instead (on Linux that is PyPI's larger CUDA build; it runs on the CPU as well).",
                  flush=True)
            run(pip + [f"torch=={TORCH_VERSION}"])
            return
        print(f"\nCould not install {choice.spec} from {choice.index_url}. If this network cannot reach "
              "download.pytorch.org, set ATELIER_TORCH_INDEX_URL to a mirror of that index and run launch.py "
              "again.", file=sys.stderr, flush=True)
        raise


# --- what the installed torch can use ------------------------------------------------------------------

PROBE = r"""
import json, sys
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
out = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    n = torch.cuda.device_count() if out["cuda_available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
except Exception as exc:
    out["cuda_available"], out["devices"], out["cuda_error"] = False, [], str(exc)
mps = getattr(torch.backends, "mps", None)
try:
    out["mps_available"] = bool(mps is not None and mps.is_available())
except Exception:
    out["mps_available"] = False
print(json.dumps(out))
"""


def probe_torch(py: Path) -> Dict:
    """What the torch in ``py``'s environment is and can use; ``{}`` when torch is missing,
    ``{"error": ...}`` when it is there but does not import."""
    try:
        r = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    lines = r.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if lines else {}
    except ValueError:
        info = {}
    if r.returncode != 0 or not info:
        return {"error": (r.stderr.strip().splitlines() or ["the probe printed nothing"])[-1]}
    return {} if "ModuleNotFoundError: No module named 'torch'" in info.get("error", "") else info


def _short(version: Optional[str]) -> str:
    return ".".join((version or "").split("-")[0].split(".")[:2])


def describe_torch(probe: Mapping) -> str:
    """``torch 2.13.0+cu128 (CUDA 12.8): 1 GPU visible: NVIDIA GeForce RTX 4090``."""
    if not probe:
        return "torch is not installed"
    if "version" not in probe:
        return f"torch does not import: {probe.get('error', '?')}"
    build = (f"ROCm {_short(probe['hip'])}" if probe.get("hip") else f"CUDA {probe['cuda']}" if probe.get("cuda")
             else "with MPS" if probe.get("mps_available") else "CPU build")
    devices = probe.get("devices") or []
    if devices:
        seen = f"{len(devices)} GPU{'s' if len(devices) > 1 else ''} visible: {', '.join(devices)}"
    elif probe.get("mps_available"):
        seen = "the Apple GPU is visible (MPS)"
    else:
        seen = "no GPU visible, training runs on the CPU"
    return f"torch {probe['version']} ({build}): {seen}"


def torch_warning(choice: TorchChoice, probe: Mapping, nvidia: Sequence[Dict], amd: Sequence[Dict]) -> Optional[str]:
    """A warning when a GPU was found but the installed torch cannot use it, else None."""
    found = {"cuda": nvidia, "rocm": amd}.get(choice.expect)
    if choice.expect == "mps":
        found = [{"name": "Apple Silicon GPU"}]
    if not found:
        return None
    fix = (f"Delete {VENV.name} and run launch.py again to reinstall torch, or set ATELIER_TORCH_INDEX_URL "
           "to the wheel index of the torch build you need.")
    if "version" not in probe:
        problem = f"torch does not import ({probe.get('error', 'not installed')})."
    elif choice.expect == "mps":
        if probe.get("mps_available"):
            return None
        problem = ("MPS is not available: it needs macOS 12.3 or newer and an arm64 Python. Update macOS, or "
                   "use the python.org arm64 (universal2) Python.")
        fix = ""
    elif probe.get("cuda_available"):
        if choice.expect == "rocm" and not probe.get("hip"):
            problem = "it is not a ROCm build."
        else:
            return None
    elif choice.expect == "cuda" and probe.get("cuda"):
        driver = min((g.get("driver", "") for g in nvidia), key=driver_major)
        problem = (f"torch {probe['version']} (CUDA {probe['cuda']}) cannot use it with driver {driver}: update "
                   "the NVIDIA driver (https://www.nvidia.com/drivers) and start again; check `nvidia-smi` works.")
    elif choice.expect == "rocm" and probe.get("hip"):
        problem = (f"torch {probe['version']} (ROCm {_short(probe['hip'])}) cannot use it: check that the amdgpu "
                   "driver is loaded and that you are in the 'render' and 'video' groups (`rocminfo` lists the GPU).")
    else:
        problem = f"torch {probe['version']} is not a build for this GPU."
    bar = "!" * 78
    return (f"{bar}\nWARNING: {_gpu_names(found)} found, but torch cannot use it: {problem}\n"
            f"Training would run on the CPU. {fix}\n{bar}").replace(" \n", "\n")


def report_torch(choice: TorchChoice, probe: Mapping, nvidia: Sequence[Dict], amd: Sequence[Dict]) -> None:
    print(describe_torch(probe), flush=True)
    warning = torch_warning(choice, probe, nvidia, amd)
    if warning:
        print(warning, file=sys.stderr, flush=True)


# --- install, doctor, main -----------------------------------------------------------------------------

def machine_choice(tests: bool = False) -> Tuple[TorchChoice, List[Dict], List[Dict]]:
    system, machine = platform.system(), platform.machine()
    nvidia = [] if tests else detect_nvidia() if system in ("Linux", "Windows") else []
    amd = [] if tests or nvidia else detect_amd(system)  # NVIDIA wins; the doctor lists both
    return choose_torch(system, machine, nvidia, amd, os.environ, tests=tests), nvidia, amd


def install(extras: str = "", cpu_torch: bool = False) -> Path:
    """Create the venv and install torch + the project, skipping work already done."""
    choice, nvidia, amd = machine_choice(tests=cpu_torch)
    if not venv_python().exists():
        print(f"Creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = venv_python()
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    probe = probe_torch(py)
    if needs_torch_install(probe.get("version", ""), choice.spec, choice.keep):
        print(choice.reason, flush=True)
        install_torch(pip, choice)
        probe = probe_torch(py)
    # Re-install the project only when pyproject.toml changed (editable install: code changes are live).
    stamp = VENV / f".atelier-installed{extras.replace('[', '-').replace(']', '')}"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        run(pip + ["-e", f"{ROOT}{extras}"])
        stamp.write_text(digest)
    report_torch(choice, probe, nvidia, amd)
    return py


def _mem(mib: Optional[int]) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"


def doctor_lines(system: str, machine: str, nvidia: Sequence[Dict], amd: Sequence[Dict],
                 env: Mapping[str, str]) -> List[str]:
    """What the launcher sees on this machine and the torch build it would install."""
    lines = [f"OS: {platform.platform()} ({system}, {machine})",
             f"Python: {platform.python_version()} ({sys.executable})"]
    if nvidia:
        lines += [f"NVIDIA GPU: {g['name']}, driver {g['driver']}, {_mem(g['total_mib'])} total, "
                  f"{_mem(g['free_mib'])} free" for g in nvidia]
    else:
        lines.append("NVIDIA GPU: none found (no working nvidia-smi)" if system in ("Linux", "Windows")
                     else "NVIDIA GPU: none (not supported on this OS)")
    if amd:
        lines += [f"AMD GPU: {g['name']}" + (f" ({g['arch']})" if g.get("arch") else "") for g in amd]
    elif system in ("Linux", "Windows"):
        lines.append("AMD GPU: none found" + (" (no working rocminfo)" if system == "Linux" else ""))
    if system == "Darwin":
        lines.append(f"Apple Silicon: {'yes (MPS)' if is_apple_silicon(system, machine) else 'no'}")
    try:
        choice = choose_torch(system, machine, nvidia, amd, env)
        lines += [f"torch build for this machine: {choice.build} ({choice.spec} from "
                  f"{choice.index_url or 'the default index (PyPI)'})", f"  {choice.reason}"]
    except SystemExit as exc:
        lines.append(f"torch build for this machine: none. {exc}")
    return lines


def doctor() -> int:
    system, machine = platform.system(), platform.machine()
    nvidia = detect_nvidia() if system in ("Linux", "Windows") else []
    amd = detect_amd(system)
    print("Atelier doctor: what the launcher sees", flush=True)
    for line in doctor_lines(system, machine, nvidia, amd, os.environ):
        print(line, flush=True)
    py = venv_python()
    if not py.exists():
        print(f"\nNo virtual environment in {VENV} yet: `python launch.py` creates it and installs torch.")
        return 0
    print(f"\nWhat torch in {VENV} sees ({py} -m trainer.host.doctor):", flush=True)
    return subprocess.call([str(py), "-m", "trainer.host.doctor"], cwd=str(ROOT))


# --- --help and the browser for the tests (stdlib only, nothing installed) ------------------------------

LAUNCHER_FLAGS: Tuple[Tuple[str, str], ...] = (
    ("-h, --help", "show this help and exit (installs nothing)"),
    ("--tests [PYTEST ARGS]", "install torch, the test extras and (as root, with apt-get) Debian's chromium for\n"
                              "                          the browser tests, then run pytest with the arguments that "
                              "follow"),
    ("--doctor", "say what this machine has and which torch build it gets; installs nothing"),
    ("--demo-cli", "install, then train the offline demo preset in the terminal"),
)
# The web UI's own flags (webui/app.py's parse_args, which imports gradio: not installed before the first start).
# tests/test_launch.py checks this list against that parser.
UI_FLAGS: Tuple[Tuple[str, str], ...] = (
    ("--workspace DIR", "folder for runs, queue and caches (default: $ATELIER_WORKSPACE or ./workspace)"),
    ("--listen", "serve on 0.0.0.0 (all interfaces) instead of 127.0.0.1"),
    ("--port N", "port to serve on (default 7860)"),
    ("--share", "also open a public gradio.live link (needs --auth)"),
    ("--share-without-auth-i-understand-anyone-with-the-link-can-run-code", "allow --share with no password"),
    ("--auth USER:PASS", "require a login (repeat for several users)"),
    ("--auth-file FILE", "a file of USER:PASS lines"),
    ("--root-path PREFIX", "URL prefix when served behind a reverse proxy"),
    ("--inbrowser", "open the page in the default browser"),
    ("--browse-root FOLDER", "another folder the file browser may show (repeatable)"),
)


def help_text() -> str:
    """``launch.py --help``: every flag, without installing or importing anything."""
    def rows(flags: Sequence[Tuple[str, str]]) -> List[str]:
        return [f"  {flag}\n      {text}" if len(flag) > 24 else f"  {flag:<24}{text}" for flag, text in flags]
    return "\n".join([
        "usage: python3 launch.py [--tests [PYTEST ARGS] | --doctor | --demo-cli] [UI FLAGS]", "",
        "Atelier's launcher: makes .venv, installs torch (the build this machine can use) and the project the first",
        "time, then starts the web UI on http://127.0.0.1:7860 (or runs the tests, or the demo in the terminal).", "",
        "launcher flags:", *rows(LAUNCHER_FLAGS), "",
        "UI flags (passed to the web UI; `python -m webui --help` in the venv describes them too):",
        *rows(UI_FLAGS), "",
        "environment: ATELIER_TORCH_INDEX_URL (a torch wheel index), ATELIER_VENV (the venv folder),",
        "ATELIER_CHROMIUM (the Chromium the browser tests drive; default /usr/bin/chromium).",
    ])


CHROMIUM_DEFAULT = "/usr/bin/chromium"  # where Debian's package puts it; tests/test_webui_e2e.py reads the same


_VALUED = ("-m", "-k", "-n", "-p", "-c", "-o", "--dist", "--numprocesses", "--durations", "--maxfail", "--rootdir")


def selects_browser_tests(pytest_args: Sequence[str]) -> bool:
    """Whether a pytest command line may run the browser tests: not when it deselects the slow tier
    (``-m "not slow"``, where they are) or names only test files that are not theirs."""
    paths, marks = [], []
    args = iter(pytest_args)
    for arg in args:
        if arg in _VALUED:
            value = next(args, "")
            marks += [value] if arg == "-m" else []
        elif arg.startswith("-m") and not arg.startswith("--"):
            marks.append(arg[2:])
        elif not arg.startswith("-"):
            paths.append(arg)
    if any(re.search(r"\bnot\s+slow\b", m) for m in marks):
        return False
    return not paths or any(Path(p.split("::")[0]).name in ("", "tests", "test_webui_e2e.py") for p in paths)


def chromium_decision(found: bool, is_root: bool, has_apt: bool) -> str:
    """``"ready"`` (found), ``"install"`` (root with apt-get: install Debian's chromium) or ``"missing"``."""
    if found:
        return "ready"
    return "install" if is_root and has_apt else "missing"


def chromium_missing_line(path: str) -> str:
    return (f"The browser tests need Chromium, and {path} does not exist: install Debian's chromium "
            "(sudo apt-get install chromium) or set ATELIER_CHROMIUM to a Chromium binary, then run "
            "`python3 launch.py --tests` again.")


def ensure_chromium(env: Mapping[str, str], runner=None, exists=os.path.exists, which=shutil.which,
                    euid: Optional[int] = None) -> Optional[str]:
    """Make the tests' Chromium present: None when it is (installed now with apt-get when missing and this
    process is root), else the one line saying what to install. ``runner`` runs a command (``run``)."""
    path = env.get("ATELIER_CHROMIUM") or CHROMIUM_DEFAULT
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
    decision = chromium_decision(exists(path), euid == 0, which("apt-get") is not None)
    if decision == "ready":
        return None
    if decision == "missing" or env.get("ATELIER_CHROMIUM"):  # a binary the user named is theirs to install
        return chromium_missing_line(path)
    runner = runner or (lambda cmd: run(cmd, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive")))
    print(f"Chromium for the browser tests is missing: installing Debian's chromium ({path}).", flush=True)
    try:
        runner(["apt-get", "update", "-qq"])
        runner(["apt-get", "install", "-y", "-qq", "chromium"])
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"Installing chromium with apt-get failed ({exc}). " + chromium_missing_line(path)
    return None if exists(path) else chromium_missing_line(path)


def main(argv: list) -> int:
    if sys.version_info < (3, 10):
        raise SystemExit(f"Atelier needs Python 3.10 or newer; this is {platform.python_version()} "
                         f"({sys.executable}). Install a newer one from https://www.python.org/downloads/")
    os.chdir(ROOT)
    if ("-h" in argv or "--help" in argv) and "--tests" not in argv:  # after --tests: pytest's own help
        print(help_text())
        return 0
    if "--doctor" in argv:
        return doctor()
    if "--tests" in argv:
        rest = [a for a in argv if a != "--tests"]
        if selects_browser_tests(rest):
            problem = ensure_chromium(os.environ)
            if problem:
                print(problem, file=sys.stderr, flush=True)
                return 1
        if not any(a.startswith(("-n", "--numprocesses")) for a in rest):
            # three workers (pytest-xdist) on a 2-core machine: the browser tests and the several-process runs wait
            # more than they compute, and a third worker fills those waits (the whole suite here: 614 s with two,
            # 576 s with three, 562 s with four but one timing-sensitive queue test failed); a worker that runs out
            # of tests takes some of another's (worksteal) instead of idling while it finishes its share
            rest = ["-n", "3", "--dist", "worksteal", *rest]
        py = install("[test]", cpu_torch=True)
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
        # one torch thread per process: the workers (and the trainers they start) share the cores, and torch's own
        # pool on top oversubscribes them (on 2 cores the whole suite took 7–8.5 min with it, 6 min without)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
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
