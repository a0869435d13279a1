"""Windows (and macOS) behaviour of the process layer, simulated on Linux.

Windows has no SIGHUP/SIGKILL, no ``os.killpg``/``os.getpgid``, ignores ``start_new_session`` and turns
``os.kill(pid, 0)`` into a Ctrl+C (signal 0 is CTRL_C_EVENT there). These tests take those away from the
running interpreter (``trainer.host.procs.is_windows`` answers True, the attributes are deleted) and put
fake ``taskkill``/``tasklist`` programs on PATH that do on Linux what the Windows ones do, so the code
paths a Windows user runs are exercised here, down to a real trainer stopped with a backup.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.host import procs
from webui import runner, supervise

_KILL, _SIGKILL = os.kill, signal.SIGKILL  # the real ones, for cleaning up while Windows is simulated

FAKE_TASKKILL = r'''#!{python}
"""taskkill /F /T /PID N: kill N and its descendants (Linux stand-in); logs its arguments."""
import os, signal, sys
from pathlib import Path
args = sys.argv[1:]
Path(os.environ["FAKE_WIN_LOG"]).open("a").write("taskkill " + " ".join(args) + "\n")
pid = int(args[args.index("/PID") + 1])
def children(p):
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == p:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out
todo, tree = [pid], []
while todo:
    p = todo.pop()
    tree.append(p)
    if "/T" in args:
        todo.extend(children(p))
if not Path(f"/proc/{pid}").exists():
    print(f'ERROR: The process "{pid}" not found.')
    sys.exit(128)
for p in tree:
    try:
        os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
        pass
print(f"SUCCESS: The process with PID {pid} has been terminated.")
'''

FAKE_TASKLIST = r'''#!{python}
"""tasklist /FI "PID eq N" /NH /FO CSV (Linux stand-in)."""
import os, sys
from pathlib import Path
args = sys.argv[1:]
pid = int(args[args.index("/FI") + 1].split()[-1])
try:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
except OSError:
    state = ""
if state and state not in ("Z", "X"):
    print(f'"python.exe","{pid}","Console","1","10,000 K"')
else:
    print("INFO: No tasks are running which match the specified criteria.")
'''


@pytest.fixture
def windows(monkeypatch, tmp_path):
    """This interpreter as Windows would have it, for the process layer; returns the fake tools' log."""
    bin_dir = tmp_path / "winbin"
    bin_dir.mkdir()
    for name, text in (("taskkill", FAKE_TASKKILL), ("tasklist", FAKE_TASKLIST)):
        tool = bin_dir / name
        tool.write_text(text.replace("{python}", sys.executable), encoding="utf-8")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "win-tools.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_WIN_LOG", str(log))
    monkeypatch.setattr(procs, "is_windows", lambda: True)
    for name in ("SIGHUP", "SIGKILL"):
        monkeypatch.delattr(signal, name)
    for name in ("killpg", "getpgid"):
        monkeypatch.delattr(os, name)
    return log


def _forbid_os_kill(monkeypatch):
    def no(pid, sig):  # on Windows this would send Ctrl+C (sig 0) or terminate the process
        raise AssertionError(f"os.kill({pid}, {sig}) called on Windows")
    monkeypatch.setattr(os, "kill", no)


def _spawn_tree(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A parent that starts a child and sleeps; returns (parent, child pid)."""
    child_pid = tmp_path / "child.pid"
    code = ("# stands in for webui.supervise and its trainer\nimport subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    end = time.time() + 20
    while time.time() < end and not child_pid.exists():
        time.sleep(0.05)
    for _ in range(100):
        text = child_pid.read_text() if child_pid.exists() else ""
        if text:
            return parent, int(text)
        time.sleep(0.05)
    raise AssertionError("the child did not start")


def _alive_on_linux(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_supervisor_starts_where_the_signal_module_has_no_sighup(windows, tmp_path):
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = supervise.main([str(tmp_path / "exit.json"), "--", sys.executable, "-c", "raise SystemExit(3)"])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert rc == 1
    assert json.loads((tmp_path / "exit.json").read_text())["returncode"] == 3
    assert signal.SIGINT in procs.stop_signals() and not hasattr(signal, "SIGHUP")


def test_launch_on_windows_detaches_into_a_new_process_group_without_a_console(windows, tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, **kwargs):
            seen.update(kwargs, cmd=cmd)

    monkeypatch.setattr(runner.subprocess, "Popen", FakePopen)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "control").mkdir()
    (run_dir / "control" / "stop").write_text("{}")  # left by a trainer that died before reading it
    runner.launch(run_dir)
    assert "start_new_session" not in seen  # ignored on Windows: the run would die with the console
    assert seen["creationflags"] & procs.CREATE_NEW_PROCESS_GROUP
    assert seen["creationflags"] & procs.CREATE_NO_WINDOW
    info = json.loads((run_dir / runner.LAUNCH).read_text())
    assert info["pid"] == 4242 and info["pgid"] is None  # no process group to signal on Windows
    assert not (run_dir / "control" / "stop").exists()
    assert float(seen["env"]["ATELIER_LAUNCHED_AT"]) == pytest.approx(info["started"])


def test_pid_alive_on_windows_asks_the_process_table_never_os_kill(windows, monkeypatch, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _forbid_os_kill(monkeypatch)
        assert runner.pid_alive(proc.pid)
    finally:
        _KILL(proc.pid, _SIGKILL)
        proc.wait()
    assert not runner.pid_alive(proc.pid)
    assert not runner.pid_alive(0)


def test_stop_on_windows_asks_by_file_then_kills_the_whole_tree(windows, monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    parent, child = _spawn_tree(tmp_path)
    try:
        runner.write_json(run_dir / runner.LAUNCH, {"pid": parent.pid, "pgid": None, "started": time.time()})
        _forbid_os_kill(monkeypatch)
        assert "Stopping" in runner.stop(run_dir)
        request = json.loads(procs.stop_file(run_dir).read_text())
        assert request["time"] <= time.time()
        assert not windows.exists()  # the first Stop asks; it kills nothing
        assert "Killed" in runner.stop(run_dir)
        assert f"taskkill /F /T /PID {parent.pid}" in windows.read_text()
        parent.wait(timeout=10)
        end = time.time() + 10
        while time.time() < end and _alive_on_linux(child):
            time.sleep(0.05)
        assert not _alive_on_linux(child), "the trainer under the supervisor must die with it"
        assert not runner.process_alive(run_dir)
        assert runner.stop(run_dir) == "This run is not running."
    finally:
        for pid in (parent.pid, child):
            try:
                _KILL(pid, _SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait()


def test_no_process_groups_means_no_group_id(windows):
    assert procs.process_group_id() is None
    assert procs.detached_popen_kwargs().keys() == {"creationflags"}


def test_on_posix_the_run_gets_its_own_session_and_is_killed_by_group(tmp_path):
    assert procs.detached_popen_kwargs() == {"start_new_session": True}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **procs.detached_popen_kwargs())
    try:
        assert os.getpgid(proc.pid) == proc.pid and procs.pid_alive(proc.pid)
        procs.kill_tree(proc.pid, proc.pid)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(ProcessLookupError):
        procs.kill_tree(proc.pid, proc.pid)


def test_stop_file_watcher_honours_a_new_request_once_and_drops_a_leftover(tmp_path):
    asked = []
    watcher = procs.StopFileWatcher(tmp_path, asked.append, since=time.time())
    path = procs.stop_file(tmp_path)
    path.parent.mkdir()
    path.write_text(json.dumps({"time": watcher.since - 3600, "reason": "an earlier run"}))
    assert not watcher.poll() and not path.exists() and asked == []
    procs.request_stop(tmp_path, reason="Stop pressed")
    assert watcher.poll() and asked == ["Stop pressed"] and not path.exists()
    assert not watcher.poll() and asked == ["Stop pressed"]
    path.write_text("")  # `type nul > control\stop` by hand: no time, still a request
    assert watcher.poll() and len(asked) == 2


def test_a_closed_stop_file_watcher_has_ended_its_thread_and_lets_go_of_the_trainer(tmp_path):
    """A watcher thread still dropping the trainer while Python shuts down aborted finished runs (1 in ~12)."""
    import gc
    import weakref

    class Trainer:
        def request_stop(self, reason):
            pass

    trainer = Trainer()
    gone = weakref.ref(trainer)
    watcher = procs.StopFileWatcher(tmp_path, trainer.request_stop, interval=0.05).start()
    del trainer
    watcher.close()
    assert not watcher._thread.is_alive()
    gc.collect()
    assert gone() is None


@pytest.mark.slow
def test_a_stop_as_on_windows_ends_a_real_trainer_with_a_backup(tmp_path, monkeypatch):
    """The real CLI under the supervisor; Stop pressed through the Windows code path (the stop file)."""
    from trainer.config.checks import cross_field_warnings, load_config
    from trainer.config.load import save_config, to_yaml
    from trainer.errors import ConfigError
    from webui.monitor import RunMonitor
    ws = tmp_path / "ws"
    cfg = load_config(preset="demo", overrides=[f"general.workspace={ws}", "training.max_steps=100000",
                                                     "sampling.every_n_steps=0", "backup.every_n_steps=0"])
    run_dir = runner.make_run_dir(ws, "win-stop")
    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    proc = runner.launch(run_dir)
    monitor = RunMonitor()
    try:
        end = time.time() + 240
        while time.time() < end and monitor.view(run_dir).step < 1 and proc.poll() is None:
            time.sleep(0.2)
        assert monitor.view(run_dir).step >= 1, (run_dir / runner.PROCESS_LOG).read_text()[-3000:]
        with monkeypatch.context() as win:
            win.setattr(procs, "is_windows", lambda: True)
            win.setattr(procs, "_windows_pid_alive", lambda pid: _alive_on_linux(pid))
            win.delattr(os, "killpg")
            win.delattr(signal, "SIGKILL")
            assert "Stopping" in runner.stop(run_dir)
        assert proc.wait(timeout=120) == 0
        view = monitor.view(run_dir)
        assert view.state == "stopped", (view.message, (run_dir / runner.PROCESS_LOG).read_text()[-3000:])
        assert view.backups and (Path(view.backups[-1]) / "state.json").exists()
        assert 1 <= view.step < 100000
        assert "stop requested (stop requested from the web UI)" in (run_dir / "train.log").read_text()
    finally:
        if proc.poll() is None:
            procs.kill_tree(proc.pid, proc.pid)
            proc.wait()


# --------------------------------------------------------------------------------------------
# paths written on Windows
# --------------------------------------------------------------------------------------------

WINDOWS_PATHS = [r"C:\Users\alice\datasets\cats", "D:/models/juggernaut_xl.safetensors",
                 r"\\nas\share\models\flux1-dev.safetensors", r"\\?\C:\very\long\path\lora.safetensors"]


@pytest.mark.parametrize("text", WINDOWS_PATHS)
def test_windows_paths_never_leave_the_machine_in_a_files_metadata(text, tmp_path):
    from trainer.train.run_folder import portable_paths
    from trainer.host.paths import path_name
    shared = portable_paths({"data": {"concepts": [{"path": text}]}, "model": {"path": text}}, str(tmp_path))
    name = text.replace("\\", "/").rsplit("/", 1)[-1]
    assert shared == {"data": {"concepts": [{"path": f"…/{name}"}]}, "model": {"path": f"…/{name}"}}
    assert "alice" not in json.dumps(shared) and path_name(text) == name


def test_run_names_come_from_the_model_file_whatever_the_separator(tmp_path):
    from omegaconf import OmegaConf

    from webui.context import AppContext
    ctx = AppContext(workspace=tmp_path, manager=None, roots=None)  # run_name reads only the config
    for path, stem in [(r"C:\models\juggernaut_xl.safetensors", "juggernaut_xl"), ("stabilityai/sdxl-base", "sdxl-base"),
                       (r"\\nas\share\flux1-dev\\", "flux1-dev"), ("builtin:tiny-sd", "tiny-sd"), ("/m/sd15.ckpt", "sd15")]:
        cfg = OmegaConf.create({"general": {"run_name": ""}, "model": {"path": path}, "training": {"method": "lora"}})
        assert ctx.run_name(cfg).startswith(f"{stem}-lora-"), (path, ctx.run_name(cfg))


def test_windows_paths_survive_a_config_round_trip_and_double_quotes_are_explained(tmp_path):
    from trainer.config.checks import cross_field_warnings, load_config
    from trainer.config.load import save_config, to_yaml
    from trainer.errors import ConfigError
    cfg = load_config(preset="demo", overrides=[f"model.path={WINDOWS_PATHS[1]}"])
    cfg.data.concepts[0].path = WINDOWS_PATHS[0]
    cfg.general.workspace = WINDOWS_PATHS[2]
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    again = load_config(saved)
    assert again.model.path == WINDOWS_PATHS[1]
    assert again.data.concepts[0].path == WINDOWS_PATHS[0]
    assert again.general.workspace == WINDOWS_PATHS[2]
    bad = tmp_path / "hand-written.yaml"
    bad.write_text('data:\n  concepts:\n    - path: "C:\\Users\\me\\cats"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "hand-written.yaml" in str(err.value) and "single quotes" in str(err.value)


def test_windows_paths_are_not_taken_for_hub_ids():
    from trainer.config.preflight import looks_like_hub_id
    assert looks_like_hub_id("black-forest-labs/FLUX.1-dev")
    assert not any(looks_like_hub_id(p) for p in WINDOWS_PATHS + ["C:/sd15", r"models\sd15"])


def test_a_path_past_windows_limit_is_named_with_what_to_do(tmp_path):
    from trainer.io import looks_like_write_failure, write_failure
    long_name = "C:\\" + "\\".join(["a-rather-long-folder-name"] * 12) + "\\model.safetensors"
    exc = FileNotFoundError(2, "The system cannot find the path specified", long_name)
    exc.winerror = 3  # what Windows sets for a path past MAX_PATH with long paths off
    assert looks_like_write_failure(exc)
    message = write_failure(exc, tmp_path, "the LoRA")
    assert "too long" in message and "LongPathsEnabled" in message and str(len(long_name)) in message


# --------------------------------------------------------------------------------------------
# Apple's MPS
# --------------------------------------------------------------------------------------------

def test_auto_picks_cuda_then_mps_then_cpu_and_a_missing_device_is_named():
    from trainer.host.devices import resolve_device
    assert resolve_device("auto", cuda=True, mps=True) == "cuda"
    assert resolve_device("auto", cuda=False, mps=True) == "mps"
    assert resolve_device("auto", cuda=False, mps=False) == "cpu"
    with pytest.raises(ValueError, match="use general.device = mps"):
        resolve_device("cuda", cuda=False, mps=True)
    with pytest.raises(ValueError, match="Apple Silicon"):
        resolve_device("mps", cuda=True, mps=False)


def test_validate_refuses_what_mps_cannot_run_naming_each_field(monkeypatch):
    from trainer.config.checks import cross_field_warnings, load_config
    from trainer.config.load import save_config, to_yaml
    from trainer.errors import ConfigError
    cfg = load_config(preset="demo", overrides=[
        "general.device=mps", "training.optimizer.name=adamw8bit", "model.attention=xformers",
        "parts.denoiser.fp8=true", "general.num_processes=2"])
    issues = cross_field_warnings(cfg)
    errors = {i.key: i.message for i in issues if i.level == "error"}
    assert "MPS" in errors["parts.denoiser.fp8"] and "float8" in errors["parts.denoiser.fp8"]
    assert "adamw (the same optimizer with 32-bit state)" in errors["training.optimizer.name"]
    assert "sdpa" in errors["model.attention"]
    assert "one MPS device" in errors["general.num_processes"]
    assert any(i.key == "general.device" and "run on the CPU" in i.message for i in issues if i.level == "warning")
    fine = load_config(preset="demo", overrides=["general.device=mps"])
    assert not [i for i in cross_field_warnings(fine) if i.level == "error" and "MPS" in i.message]
    # a Mac on `auto` gets the same checks; elsewhere `auto` is not MPS
    monkeypatch.setattr("trainer.host.devices.is_apple_silicon", lambda: True)
    mac_auto = load_config(preset="demo", overrides=["training.optimizer.name=adamw8bit"])
    assert any(i.key == "training.optimizer.name" and "MPS" in i.message for i in cross_field_warnings(mac_auto))


def test_the_mps_fallback_is_switched_on_only_on_apple_silicon(monkeypatch):
    from trainer.host import devices
    monkeypatch.delenv(devices.MPS_FALLBACK_ENV, raising=False)
    monkeypatch.setattr(devices, "is_apple_silicon", lambda: False)
    devices.enable_mps_fallback()
    assert devices.MPS_FALLBACK_ENV not in os.environ
    monkeypatch.setattr(devices, "is_apple_silicon", lambda: True)
    devices.enable_mps_fallback()
    assert os.environ[devices.MPS_FALLBACK_ENV] == "1"


def test_several_processes_without_nccl_talk_through_gloo_and_say_so(monkeypatch):
    """Windows' and macOS' PyTorch builds have no NCCL: multi-GPU runs fall back to gloo with a note."""
    import torch.distributed as dist

    from trainer.parallel.distributed import choose_backend
    notes = []
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert choose_backend(cpu=False, warn=notes.append) == "gloo"
    assert notes and "NCCL is not available" in notes[0] and "gloo" in notes[0]
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert choose_backend(cpu=False, warn=notes.append) == "nccl" and len(notes) == 1


def test_the_run_folder_lock_on_windows_leaves_the_holders_record_readable(monkeypatch, tmp_path):
    """Windows' byte-range locks are mandatory: locking byte 0 would make trainer.lock unreadable to the
    second trainer, which then could not say who holds the folder."""
    import types

    from trainer.train import runlock
    locked = {}

    def locking(fd, mode, nbytes):
        at = os.lseek(fd, 0, os.SEEK_CUR)
        if locked.get(at):
            raise PermissionError(13, "Permission denied")  # what msvcrt raises for a held lock
        locked[at] = True

    monkeypatch.setitem(sys.modules, "msvcrt", types.SimpleNamespace(LK_NBLCK=2, locking=locking))
    monkeypatch.setattr(runlock, "is_windows", lambda: True)
    runlock.acquire(tmp_path)
    try:
        assert list(locked) == [runlock.WINDOWS_LOCK_OFFSET]
        assert runlock.holder(tmp_path)["pid"] == os.getpid()  # the record at the start stays readable
        fd = os.open(tmp_path / runlock.LOCK_NAME, os.O_RDWR)
        try:
            assert not runlock._try_lock(fd)  # a second trainer is refused
        finally:
            os.close(fd)
    finally:
        runlock.release(tmp_path)


@pytest.mark.parametrize("value, expected", [(1, True), (0, False), (None, False)])
def test_the_doctor_reads_windows_long_path_setting(monkeypatch, value, expected):
    import types

    from trainer.host import doctor

    class Key:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def query(key, name):
        assert name == "LongPathsEnabled"
        if value is None:
            raise FileNotFoundError(2, "the value is not set")
        return value, 4

    fake = types.SimpleNamespace(HKEY_LOCAL_MACHINE=object(), OpenKey=lambda root, path: Key(), QueryValueEx=query)
    monkeypatch.setitem(sys.modules, "winreg", fake)
    monkeypatch.setattr(doctor, "os", types.SimpleNamespace(name="nt"))
    assert doctor.windows_long_paths() is expected
    monkeypatch.setattr(doctor, "os", os)
    assert doctor.windows_long_paths() is None  # not Windows: not asked
