"""launch.py: GPU detection, the torch build it picks per platform, the install decision, the post-install
check, ``--doctor`` and launch.bat. CPU-only and offline: GPUs are faked with scripts on PATH or plain dicts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_launch():
    spec = importlib.util.spec_from_file_location("atelier_launch", ROOT / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


launch = _load_launch()
V = launch.TORCH_VERSION
IDX = "https://download.pytorch.org/whl/"


def nv(driver: str, name: str = "NVIDIA GeForce RTX 4090") -> list:
    return [{"name": name, "driver": driver, "total_mib": 24564, "free_mib": 23000}]


AMD = [{"name": "AMD Radeon RX 7900 XTX", "arch": "gfx1100"}]


# --- choose_torch: every platform x GPU -------------------------------------------------------------------

@pytest.mark.parametrize("system", ["Linux", "Windows"])
@pytest.mark.parametrize("driver,build,cuda", [("590.44.01", "cu130", "13.0"), ("575.57", "cu128", "12.8"),
                                               ("560.35.03", "cu126", "12.6"), ("470.256.02", "cu126", "12.6")])
def test_choose_nvidia(system, driver, build, cuda):
    c = launch.choose_torch(system, "x86_64" if system == "Linux" else "AMD64", nv(driver), [], {})
    assert (c.build, c.index_url, c.spec, c.expect) == (build, IDX + build, f"torch=={V}+{build}", "cuda")
    assert c.reason.startswith(f"NVIDIA GeForce RTX 4090, driver {driver}: ")
    assert f"with CUDA {cuda} from {IDX}{build}" in c.reason
    assert ("too old" in c.reason and "update" in c.reason) == driver.startswith("470")


def test_choose_nvidia_wins_over_amd_and_uses_the_oldest_driver():
    gpus = nv("580.65") + nv("570.10", name="NVIDIA RTX A6000")
    c = launch.choose_torch("Linux", "x86_64", gpus, AMD, {})
    assert c.build == "cu128" and c.expect == "cuda"
    assert c.reason.startswith("2 GPUs (NVIDIA GeForce RTX 4090, NVIDIA RTX A6000), driver 570.10")


def test_choose_amd_linux_windows():
    c = launch.choose_torch("Linux", "x86_64", [], AMD, {})
    assert (c.build, c.index_url, c.spec, c.expect) == ("rocm7.2", IDX + "rocm7.2", f"torch=={V}+rocm7.2", "rocm")
    assert "AMD Radeon RX 7900 XTX" in c.reason and "ROCm 7.2" in c.reason
    c = launch.choose_torch("Windows", "AMD64", [], [{"name": "AMD Radeon RX 7900 XTX"}], {})
    assert (c.build, c.index_url, c.spec, c.expect) == ("cpu", None, f"torch=={V}", "cpu")
    assert "no ROCm build for Windows" in c.reason and "WSL2" in c.reason and "ATELIER_TORCH_INDEX_URL" in c.reason


def test_choose_macos():
    c = launch.choose_torch("Darwin", "arm64", [], [], {})
    assert (c.build, c.index_url, c.spec, c.expect) == ("mps", None, f"torch=={V}", "mps")
    with pytest.raises(SystemExit, match="no wheels for Intel Macs"):
        launch.choose_torch("Darwin", "x86_64", [], [], {})


def test_choose_no_gpu():
    c = launch.choose_torch("Linux", "x86_64", [], [], {})
    assert (c.build, c.index_url, c.spec, c.expect) == ("cpu", IDX + "cpu", f"torch=={V}+cpu", "cpu")
    c = launch.choose_torch("Windows", "AMD64", [], [], {})
    assert (c.build, c.index_url, c.spec, c.expect) == ("cpu", None, f"torch=={V}", "cpu")


def test_choose_env_override_and_tests():
    env = {"ATELIER_TORCH_INDEX_URL": "https://mirror.example/whl/cu128"}
    c = launch.choose_torch("Linux", "x86_64", nv("575.57"), [], env)
    assert (c.build, c.index_url, c.spec, c.expect) == ("custom", env["ATELIER_TORCH_INDEX_URL"], f"torch=={V}", "cuda")
    c = launch.choose_torch("Windows", "AMD64", [], [], env)
    assert (c.build, c.spec, c.expect) == ("custom", f"torch=={V}", "cpu")
    # --tests: today's behaviour, the configured index and a plain requirement, whatever the GPUs
    c = launch.choose_torch("Linux", "x86_64", nv("575.57"), [], {}, tests=True)
    assert (c.build, c.index_url, c.spec, c.expect) == ("cpu", None, f"torch=={V}", "cpu")
    c = launch.choose_torch("Linux", "x86_64", [], [], env, tests=True)
    assert (c.index_url, c.spec) == (env["ATELIER_TORCH_INDEX_URL"], f"torch=={V}")


def test_machine_choice_for_tests_probes_no_gpu(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("probed for GPUs")
    monkeypatch.setattr(launch, "detect_nvidia", boom)
    monkeypatch.setattr(launch, "detect_amd", boom)
    monkeypatch.delenv("ATELIER_TORCH_INDEX_URL", raising=False)
    choice, nvidia, amd = launch.machine_choice(tests=True)
    assert (choice.index_url, choice.spec, nvidia, amd) == (None, f"torch=={V}", [], [])


# --- detection with fake executables -----------------------------------------------------------------------

def _fake_tool(bindir: Path, name: str, stdout: str, rc: int = 0) -> None:
    bindir.mkdir(exist_ok=True)
    data = bindir / f"{name}.out"
    data.write_text(stdout)
    if os.name == "nt":
        (bindir / f"{name}.bat").write_text(f"@type \"{data}\"\r\n@exit /b {rc}\r\n")
    else:
        script = bindir / name
        script.write_text(f"#!/bin/sh\ncat '{data}'\nexit {rc}\n")
        script.chmod(0o755)


@pytest.fixture()
def fake_path(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    return bindir


SMI = "NVIDIA GeForce RTX 4090, 570.86.15, 24564, 23012\nNVIDIA RTX A6000, 570.86.15, 49140, [N/A]\n"
ROCMINFO = """ROCk module is loaded
=====================
HSA Agents
==========
*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Marketing Name:          AMD Ryzen 9 7950X 16-Core Processor
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1100
  Uuid:                    GPU-8e3d8f1b2c3d4e5f
  Marketing Name:          AMD Radeon RX 7900 XTX
  Device Type:             GPU
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--gfx1100
*** Done ***
"""


def test_detect_nvidia_fake_smi(fake_path):
    _fake_tool(fake_path, "nvidia-smi", SMI)
    assert launch.detect_nvidia() == [
        {"name": "NVIDIA GeForce RTX 4090", "driver": "570.86.15", "total_mib": 24564, "free_mib": 23012},
        {"name": "NVIDIA RTX A6000", "driver": "570.86.15", "total_mib": 49140, "free_mib": None}]
    c = launch.choose_torch("Linux", "x86_64", launch.detect_nvidia(), [], {})
    assert c.build == "cu128"


def test_detect_nvidia_failing_or_missing(fake_path, monkeypatch):
    _fake_tool(fake_path, "nvidia-smi", "NVIDIA-SMI has failed because it couldn't communicate with the driver\n", 9)
    assert launch.detect_nvidia() == []
    monkeypatch.setenv("PATH", str(fake_path / "nothing"))
    assert launch.detect_nvidia() == []


def test_detect_nvidia_timeout(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: "/fake/" + name)

    def slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
    monkeypatch.setattr(launch.subprocess, "run", slow)
    assert launch.detect_nvidia() == []


def test_detect_amd_fake_rocminfo(fake_path):
    _fake_tool(fake_path, "rocminfo", ROCMINFO)
    assert launch.detect_amd("Linux") == [{"name": "AMD Radeon RX 7900 XTX", "arch": "gfx1100"}]
    _fake_tool(fake_path, "rocminfo", ROCMINFO, rc=1)
    assert launch.detect_amd("Linux") == []
    assert launch.detect_amd("Darwin") == []


def test_detect_amd_windows(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: "C:/Windows/" + name if name == "powershell" else None)
    out = "AMD Radeon RX 7900 XTX\r\nMicrosoft Basic Display Adapter\r\n"
    monkeypatch.setattr(launch.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, out, ""))
    assert launch.detect_amd("Windows") == [{"name": "AMD Radeon RX 7900 XTX"}]


# --- install decision --------------------------------------------------------------------------------------

def test_needs_torch_install():
    cu128 = launch.choose_torch("Linux", "x86_64", nv("575.57"), [], {})
    cu130 = launch.choose_torch("Linux", "x86_64", nv("590.44"), [], {})
    cpu = launch.choose_torch("Linux", "x86_64", [], [], {})
    tests = launch.choose_torch("Linux", "x86_64", [], [], {}, tests=True)
    need = launch.needs_torch_install
    assert need("", cu128.spec, cu128.keep)
    assert need("2.12.0+cu128", cu128.spec, cu128.keep)
    assert need(f"{V}+cpu", cu128.spec, cu128.keep)  # a CPU build where the CUDA one is wanted
    assert need(f"{V}+cu130", cu128.spec, cu128.keep)  # too new for a 575 driver
    assert not need(f"{V}+cu128", cu128.spec, cu128.keep)
    assert not need(f"{V}+cu128", cu130.spec, cu130.keep)  # a driver update does not re-download torch
    assert not need(f"{V}+cpu", tests.spec, tests.keep)
    assert not need(f"{V}+cu128", tests.spec, tests.keep)
    assert need("2.12.0", tests.spec, tests.keep)
    assert need("", tests.spec, tests.keep)
    assert not need(f"{V}+cpu", cpu.spec, cpu.keep)
    assert not need(f"{V}+cu128", cpu.spec, cpu.keep)  # every build runs on the CPU: keep the GPU one
    assert need("2.12.0+cpu", cpu.spec, cpu.keep)


def test_install_torch_falls_back_to_pypi_for_cpu(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(list(cmd))
        if "--index-url" in cmd:
            raise subprocess.CalledProcessError(1, cmd)
    monkeypatch.setattr(launch, "run", fake_run)
    cpu = launch.choose_torch("Linux", "x86_64", [], [], {})
    launch.install_torch(["pip", "install"], cpu)
    assert calls == [["pip", "install", f"torch=={V}+cpu", "--index-url", IDX + "cpu", "--retries", "1",
                      "--timeout", "20"], ["pip", "install", f"torch=={V}"]]
    assert "from PyPI instead" in capsys.readouterr().out
    calls.clear()
    with pytest.raises(subprocess.CalledProcessError):  # no silent CPU fallback for a GPU build
        launch.install_torch(["pip", "install"], launch.choose_torch("Linux", "x86_64", nv("575.57"), [], {}))
    assert len(calls) == 1 and calls[0][2] == f"torch=={V}+cu128"
    calls.clear()
    launch.install_torch(["pip", "install"], launch.choose_torch("Linux", "x86_64", [], [], {}, tests=True))
    assert calls == [["pip", "install", f"torch=={V}"]]


# --- post-install check ------------------------------------------------------------------------------------

def test_check_mismatch_and_match():
    gpus = nv("575.57")
    choice = launch.choose_torch("Linux", "x86_64", gpus, [], {})
    bad = {"version": f"{V}+cu128", "cuda": "12.8", "hip": None, "cuda_available": False, "devices": [],
           "mps_available": False}
    warning = launch.torch_warning(choice, bad, gpus, [])
    assert warning and "WARNING" in warning and "NVIDIA GeForce RTX 4090" in warning
    assert "update the NVIDIA driver" in warning
    cpu_build = dict(bad, version=f"{V}+cpu", cuda=None)
    warning = launch.torch_warning(choice, cpu_build, gpus, [])
    assert "WARNING" in warning and "Delete .venv" in warning and "ATELIER_TORCH_INDEX_URL" in warning
    assert launch.describe_torch(cpu_build) == f"torch {V}+cpu (CPU build): no GPU visible, training runs on the CPU"
    good = dict(bad, cuda_available=True, devices=["NVIDIA GeForce RTX 4090"])
    assert launch.torch_warning(choice, good, gpus, []) is None
    assert launch.describe_torch(good) == f"torch {V}+cu128 (CUDA 12.8): 1 GPU visible: NVIDIA GeForce RTX 4090"
    # no GPU found: a CPU build is what was asked for
    cpu = launch.choose_torch("Linux", "x86_64", [], [], {})
    assert launch.torch_warning(cpu, cpu_build, [], []) is None
    # ROCm: torch says cuda, and torch.version.hip is set
    rocm = launch.choose_torch("Linux", "x86_64", [], AMD, {})
    hip = dict(good, version=f"{V}+rocm7.2", cuda=None, hip="7.2.41134-abc", devices=["AMD Radeon RX 7900 XTX"])
    assert launch.torch_warning(rocm, hip, [], AMD) is None
    assert launch.describe_torch(hip).startswith(f"torch {V}+rocm7.2 (ROCm 7.2): 1 GPU visible")
    assert "WARNING" in launch.torch_warning(rocm, dict(hip, cuda_available=False, devices=[]), [], AMD)
    mps = launch.choose_torch("Darwin", "arm64", [], [], {})
    assert "MPS" in launch.torch_warning(mps, dict(cpu_build, version=V), [], [])
    assert launch.torch_warning(mps, dict(cpu_build, version=V, mps_available=True), [], []) is None


def test_probe_this_venv():
    info = launch.probe_torch(Path(sys.executable))
    import torch
    assert info["version"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert launch.describe_torch(info).startswith(f"torch {torch.__version__} (")


# --- doctor ------------------------------------------------------------------------------------------------

def test_trainer_doctor_report():
    import torch
    from trainer.host.doctor import report
    text = "\n".join(report())
    assert f"torch: {torch.__version__}" in text
    if not torch.cuda.is_available():
        assert "CUDA: not available" in text
    assert "bitsandbytes:" in text and "What does not fit here:" in text
    assert "gloo" in text
    if not torch.cuda.is_available():  # the CPU's compiler, as training.compile's check finds it
        from trainer.train.compile import backend_problem
        ok = backend_problem("cpu") is None
        assert f"training.compile (C++ kernels): {'can' if ok else 'cannot'} compile here" in text


def test_the_doctor_names_a_machine_that_cannot_compile(monkeypatch):
    """No C++ compiler (the CPU) and no Triton (an NVIDIA GPU): the doctor says training.compile cannot compile here
    and what to install, whichever device this machine trains on."""
    from torch._inductor import cpp_builder
    from torch.utils import _triton

    from trainer.host.doctor import report

    def no_compiler():
        raise RuntimeError("Failed to find a working C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setattr(_triton, "has_triton_package", lambda: False)
    text = "\n".join(report())
    assert "kernels): cannot compile here" in text
    assert "  - training.compile " in text and "or turn training.compile off." in text


def test_doctor_lines_fake_gpu():
    lines = launch.doctor_lines("Linux", "x86_64", nv("575.57"), AMD, {})
    text = "\n".join(lines)
    assert "NVIDIA GPU: NVIDIA GeForce RTX 4090, driver 575.57, 24.0 GiB total, 22.5 GiB free" in text
    assert "AMD GPU: AMD Radeon RX 7900 XTX (gfx1100)" in text
    assert f"torch build for this machine: cu128 (torch=={V}+cu128 from {IDX}cu128)" in text
    text = "\n".join(launch.doctor_lines("Darwin", "x86_64", [], [], {}))
    assert "torch build for this machine: none" in text and "Intel Macs" in text


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_launch_doctor_subprocess(tmp_path):
    env = dict(os.environ, ATELIER_VENV=sys.prefix, PATH=str(tmp_path))  # no nvidia-smi / rocminfo
    env.pop("ATELIER_TORCH_INDEX_URL", None)
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--doctor"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import torch
    assert f"Python: {sys.version.split()[0]}" in r.stdout
    assert "NVIDIA GPU: none found" in r.stdout
    assert f"torch: {torch.__version__}" in r.stdout  # from trainer.host.doctor in the venv
    assert "torch build for this machine:" in r.stdout


# --- launch.bat --------------------------------------------------------------------------------------------

def test_launch_bat():
    data = (ROOT / "launch.bat").read_bytes()
    assert data.count(b"\r\n") == data.count(b"\n") > 5  # CRLF, every line
    text = data.decode("ascii")
    assert 'cd /d "%~dp0"' in text
    assert "py -3 launch.py %*" in text and "python launch.py %*" in text
    assert "pause" in text and "python.org" in text


# --- --help and the tests' browser -------------------------------------------------------------------------

def _ui_flags_of_the_web_ui() -> set:
    """The flags webui/app.py's parse_args declares, read from its source (importing it needs gradio)."""
    import ast
    tree = ast.parse((ROOT / "webui" / "app.py").read_text(encoding="utf-8"))
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) for t in node.targets if isinstance(t, ast.Name)}
    [parse] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args"]
    flags = set()
    for call in ast.walk(parse):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
            first = call.args[0]
            flags.add(first.value if isinstance(first, ast.Constant) else consts[first.id])
    return flags


def test_help_lists_every_flag_and_installs_nothing(tmp_path):
    ui = _ui_flags_of_the_web_ui()
    assert {flag.split()[0] for flag, _ in launch.UI_FLAGS} == ui and "--port" in ui
    venv_dir = tmp_path / "venv"
    env = dict(os.environ, ATELIER_VENV=str(venv_dir), PATH=str(tmp_path))  # no pip, no nvidia-smi to reach
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--help"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ["--tests", "--doctor", "--demo-cli", "--help", *ui]:
        assert flag in r.stdout, flag
    assert "python -m webui --help" in r.stdout and not venv_dir.exists()


def test_browser_tests_are_selected_unless_deselected():
    sel = launch.selects_browser_tests
    assert sel([]) and sel(["-x"]) and sel(["tests"]) and sel(["tests/test_webui_e2e.py::test_x"])
    assert sel(["-m", "slow"]) and sel(["-k", "not_slow_thing"]) and sel(["-n", "2", "tests/"])
    assert not sel(["-m", "not slow"]) and not sel(["-mnot slow"]) and not sel(["tests/test_config.py"])
    assert not sel(["-m", "not slow and not gpu", "tests"])


def test_chromium_is_installed_with_apt_as_root_and_named_otherwise():
    assert launch.chromium_decision(True, False, False) == "ready"
    assert launch.chromium_decision(False, True, True) == "install"
    assert launch.chromium_decision(False, False, True) == launch.chromium_decision(False, True, False) == "missing"
    installed, calls = set(), []

    def apt(cmd):
        calls.append(cmd)
        if "install" in cmd:
            installed.add(launch.CHROMIUM_DEFAULT)
    apt_get = lambda name: "/usr/bin/apt-get" if name == "apt-get" else None  # noqa: E731
    got = launch.ensure_chromium({}, runner=apt, exists=installed.__contains__, which=apt_get, euid=0)
    assert got is None and calls[0][:2] == ["apt-get", "update"] and calls[1][:2] == ["apt-get", "install"]
    assert "chromium" in calls[1]
    calls.clear()
    assert launch.ensure_chromium({}, runner=apt, exists=installed.__contains__, which=apt_get, euid=0) is None
    assert not calls  # present: nothing to do
    for kwargs in ({"euid": 1000, "which": apt_get}, {"euid": 0, "which": lambda name: None}):
        line = launch.ensure_chromium({}, runner=apt, exists=lambda p: False, **kwargs)
        assert "apt-get install chromium" in line and "ATELIER_CHROMIUM" in line and "\n" not in line
    assert not calls
    line = launch.ensure_chromium({"ATELIER_CHROMIUM": "/opt/chrome"}, runner=apt, exists=lambda p: False,
                                  which=apt_get, euid=0)
    assert "/opt/chrome does not exist" in line and not calls  # a binary the user named is not apt's

    def failing(cmd):
        raise subprocess.CalledProcessError(100, cmd)
    line = launch.ensure_chromium({}, runner=failing, exists=lambda p: False, which=apt_get, euid=0)
    assert line.startswith("Installing chromium with apt-get failed") and "\n" not in line


def test_tests_without_chromium_stop_before_installing_anything(monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("installed")
    monkeypatch.chdir(ROOT)  # main changes to the project folder; put it back afterwards
    monkeypatch.setattr(launch, "install", boom)
    monkeypatch.setattr(launch, "ensure_chromium", lambda env: "install chromium")
    assert launch.main(["--tests"]) == 1 and "install chromium" in capsys.readouterr().err
    assert launch.main(["--help"]) == 0 and "--demo-cli" in capsys.readouterr().out


# --- the README -------------------------------------------------------------------------------------------

def test_readme_names_the_two_commands_and_its_model_table_is_the_registrys():
    """The README's set-up and test commands are the launcher's, and its table of models, methods and memory tiers
    is what tools/family_table.py makes from the registry and the presets (run it with --write after adding one)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "```\npython3 launch.py\n```" in readme and "```\npython3 launch.py --tests\n```" in readme
    spec = importlib.util.spec_from_file_location("family_table", ROOT / "tools" / "family_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.with_table(readme) == readme, "README.md's model table is stale: python3 tools/family_table.py --write"
    assert "| SDXL (and Pony" in readme and "8 GB, 12 GB, 16 GB" in readme
