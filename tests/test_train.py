"""End-to-end runs of the spine on the tiny model: LoRA, fine-tune, resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.__main__ import main as cli
from trainer.events import read_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"


def overrides(ws: Path, run: str, *extra: str) -> list:
    return ["--set", f"general.workspace={ws}", "--set", f"general.run_name={run}", "--no-progress",
            *[x for e in extra for x in ("--set", e)]]


def types(run_dir: Path) -> list:
    return [e["type"] for e in read_events(run_dir / "events.jsonl")]


def tiny_pipe(ws: Path, kind: str = "tiny-sd"):
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(ws / "models" / kind, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image(pipe, prompt="a red square on a white background"):
    return pipe(prompt, num_inference_steps=4, height=64, width=64, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images[0]


def test_lora_run_writes_the_whole_run_folder(tiny_workspace, peft_strict):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo", *overrides(ws, "lora1", "training.epochs=2",
                                                      "sampling.every_n_epochs=1", "backup.every_n_epochs=1")])
    assert rc == 0
    run = ws / "runs" / "lora1"
    ev = types(run)
    assert ev[0] == "started" and ev[-1] == "finished"
    assert {"step", "sample", "backup", "saved"} <= set(ev)
    steps = [e for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert steps[-1]["step"] == steps[-1]["total_steps"] == 8
    assert all(isinstance(s["loss"], float) and "unet" in s["lr"] for s in steps)
    assert (run / "config.yaml").read_text().startswith("version: 3")
    assert "step 8/8" in (run / "train.log").read_text()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "samples").glob("*.png"))[:2] == ["step000004-p0.png", "step000004-p1.png"]
    assert len(list((run / "backups").iterdir())) == 2  # keep_last

    # the result: kohya key layout, loads into a diffusers pipeline, changes its output
    from safetensors import safe_open
    lora = run / "lora1.safetensors"
    with safe_open(str(lora), "pt") as fh:
        keys = set(fh.keys())
        meta = fh.metadata()
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha" in keys
    assert all(k.startswith("lora_unet_") for k in keys)
    assert meta["ss_network_dim"] == "4" and "atelier_config" in meta
    shared = json.loads(meta["atelier_config"])  # files are shared publicly: no local paths in them
    assert str(ws) not in meta["atelier_config"] and str(ROOT) not in meta["atelier_config"]
    assert shared["data"]["concepts"][0]["path"] == "…/demo-data" and shared["general"]["workspace"] == "."
    pipe = tiny_pipe(ws)
    before = image(pipe)
    pipe.load_lora_weights(str(lora))
    after = image(pipe)
    assert abs(after - before).max() > 1e-3


def test_finetune_single_file_loads_back_with_the_trained_weights(tiny_workspace):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo-finetune", *overrides(
        ws, "ft1", "training.epochs=1", "sampling.prompts=[]", "backup.every_n_epochs=1")])
    assert rc == 0
    run = ws / "runs" / "ft1"
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file
    loaded = StableDiffusionPipeline.from_single_file(str(run / "ft1.safetensors"),
                                                      config=str(ws / "models" / "tiny-sd"),
                                                      local_files_only=True, safety_checker=None)
    backup = load_file(str(next((run / "backups").iterdir()) / "trainable.safetensors"))
    trained = {k[len("unet."):]: v for k, v in backup.items() if k.startswith("unet.")}
    original = tiny_pipe(ws).unet.state_dict()
    got = loaded.unet.state_dict()
    assert set(got) == set(trained)
    for k, v in trained.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    assert any(not torch.equal(original[k], trained[k]) for k in trained)


def _spawn(args, cwd=ROOT):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for(path: Path, pred, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists() and any(pred(e) for e in read_events(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting in {path}")


def _lora_tensors(path: Path):
    from safetensors.torch import load_file
    return load_file(str(path))


def test_stopped_and_resumed_run_equals_uninterrupted_run(tiny_workspace):
    ws = tiny_workspace
    common = ["training.epochs=4", "sampling.prompts=[]", "backup.every_n_epochs=0", "lora.dropout=0.1",
              "data.random_flip=true", "training.lr_scheduler=cosine", "output.dtype=fp32"]
    assert cli(["train", "--preset", "demo", *overrides(ws, "straight", *common)]) == 0
    run = ws / "runs" / "interrupted"
    proc = _spawn(["train", "--preset", "demo", *overrides(ws, "interrupted", *common)])
    _wait_for(run / "events.jsonl", lambda e: e["type"] == "step" and e["step"] >= 3)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "stopped" and events[-1]["step"] < 16, events[-1]
    assert events[-2]["type"] == "backup"
    assert not (run / "interrupted.safetensors").exists()
    # resumed in this process (another process start, torch and the model, costs seconds): the run seeds its RNGs
    # at set-up either way, so only the RNG states and data position the backup carries can make the weights match
    assert cli(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "last", "--no-progress"]) == 0
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished"
    started = [e for e in events if e["type"] == "started"]
    stopped = [e for e in events if e["type"] == "stopped"]
    assert started[-1]["resumed_from_step"] == stopped[0]["step"]
    a = _lora_tensors(ws / "runs" / "straight" / "straight.safetensors")
    b = _lora_tensors(run / "interrupted.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


# --- bad input ----------------------------------------------------------------------------------

def _fails_with(ws, run, *extra, words=()):
    rc = cli(["train", "--preset", "demo", *overrides(ws, run, *extra)])
    assert rc == 1
    events = read_events(ws / "runs" / run / "events.jsonl")
    assert events[-1]["type"] == "failed"
    msg = events[-1]["message"]
    for w in words:
        assert w in msg, msg
    assert "Traceback" not in msg
    return msg


def test_train_refuses_missing_files_before_the_run_starts(tiny_workspace, tmp_path, capsys):
    """The check validate runs (trainer/config/preflight.py): a config error at the field, no run folder, no model loaded."""
    (tmp_path / "empty").mkdir()
    for run, setting, words in (("bad-model", "model.path=/nonexistent/model.safetensors",
                                 ("model.path", "/nonexistent/model.safetensors", "does not exist")),
                                ("bad-empty", f"data.concepts.0.path={tmp_path / 'empty'}",
                                 ("data.concepts.0.path", str(tmp_path / "empty"), "has no images")),
                                ("bad-missing", f"data.concepts.0.path={tmp_path / 'nope'}",
                                 ("data.concepts.0.path", "nope", "does not exist")),
                                ("bad-optim", "training.optimizer.extra_args={bogus: 1}",  # needs torch: train checks it
                                 ("training.optimizer.extra_args.bogus", "takes no 'bogus'"))):
        assert cli(["train", "--preset", "demo", *overrides(tiny_workspace, run, setting)]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words) and "Traceback" not in err, err
        assert not (tiny_workspace / "runs" / run / "events.jsonl").exists()


def test_broken_image_is_reported_and_skipped(tiny_workspace, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DEMO_DATA, data)
    (data / "99-broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (data / "98-empty.jpg").write_bytes(b"")
    rc = cli(["train", "--preset", "demo", *overrides(tiny_workspace, "skip", f"data.concepts.0.path={data}",
                                                      "training.epochs=1", "sampling.prompts=[]")])
    assert rc == 0
    events = read_events(tiny_workspace / "runs" / "skip" / "events.jsonl")
    warnings = " ".join(e["message"] for e in events if e["type"] == "warning")
    assert "99-broken.png" in warnings and "98-empty.jpg" in warnings
    started = next(e for e in events if e["type"] == "started")
    assert started["dataset"]["total_images"] == 8
    assert events[-1]["type"] == "finished"


def test_nan_loss_stops_with_a_clear_error_and_keeps_backups(tiny_workspace, tmp_path):
    ws = tiny_workspace
    # a run that trains fine and leaves a backup...
    assert cli(["train", "--preset", "demo", *overrides(ws, "nan", "training.epochs=1", "sampling.prompts=[]",
                                                        "backup.every_n_epochs=1")]) == 0
    run = ws / "runs" / "nan"
    backup = next((run / "backups").iterdir())
    before = {p.name: p.read_bytes() for p in backup.iterdir()}
    # ...then is resumed on a poisoned copy of the model whose UNet yields NaN
    poisoned = tmp_path / "poisoned"
    shutil.copytree(ws / "models" / "tiny-sd", poisoned)
    from safetensors.torch import load_file, save_file
    f = next((poisoned / "unet").glob("*.safetensors"))
    sd = load_file(str(f))
    sd["conv_in.bias"] = torch.full_like(sd["conv_in.bias"], float("nan"))
    save_file(sd, str(f))
    rc = cli(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "last", "--no-progress",
              "--set", f"model.path={poisoned}", "--set", "training.epochs=3"])
    assert rc == 1
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "failed" and "loss became nan" in events[-1]["message"].lower()
    assert [p.name for p in (run / "backups").iterdir()] == [backup.name]
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == before


def test_backup_and_sample_on_demand_accumulation_and_diffusers_output(tiny_workspace):
    """control/backup and control/sample act at the next step; accumulation divides the steps;
    a fine-tune can be written as a diffusers folder that diffusers loads."""
    ws = tiny_workspace
    run = ws / "runs" / "ondemand"
    (run / "control").mkdir(parents=True)
    (run / "control" / "backup").touch()
    (run / "control" / "sample").touch()
    (run / "samples").mkdir()
    (run / "samples" / "step000001-p0.png").write_bytes(b"a sample already drawn at step 1")
    rc = cli(["train", "--preset", "demo-finetune", "--run-dir", str(run), *overrides(
        ws, "ondemand", "training.epochs=1", "training.batch_size=1", "training.gradient_accumulation_steps=2",
        "output.format=diffusers", "sampling.at_end=false", "sampling.every_n_epochs=0")])
    assert rc == 0
    events = read_events(run / "events.jsonl")
    steps = [e for e in events if e["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and steps[-1]["total_steps"] == 4
    assert [e["step"] for e in events if e["type"] == "backup"] == [1]
    assert [e["step"] for e in events if e["type"] == "sample"] == [1]
    # a second sample at a step that already has one is added beside it, and the Run tab lists both
    assert (run / "samples" / "step000001-p0.png").read_bytes() == b"a sample already drawn at step 1"
    from webui.monitor import scan_samples
    assert [Path(s.path).name for s in scan_samples(run, {}) if s.prompt_index == 0] == \
        ["step000001-p0-2.png", "step000001-p0.png"]
    assert not list((run / "control").iterdir())
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(run / "ondemand", local_files_only=True)
    assert pipe.unet.dtype == torch.float32


def test_a_used_run_folder_is_not_overwritten(tiny_workspace, capsys):
    ws = tiny_workspace
    run = ws / "runs" / "used"
    run.mkdir(parents=True)
    done = '{"type": "started", "time": 0}\n{"type": "finished", "time": 1, "step": 8}\n'
    (run / "events.jsonl").write_text(done)
    assert cli(["train", "--preset", "demo", *overrides(ws, "used")]) == 2
    assert "--resume last" in capsys.readouterr().err
    assert (run / "events.jsonl").read_text() == done


def test_a_run_that_died_before_its_first_backup_starts_again_in_place(tiny_workspace, capsys):
    ws = tiny_workspace
    run = ws / "runs" / "died"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text('{"type": "started", "time": 0, "total_steps": 8}\n')  # then kill -9
    assert cli(["train", "--preset", "demo", *overrides(ws, "died", "training.max_steps=1", "sampling.prompts=[]")]) == 0
    assert "starts again in place" in capsys.readouterr().err
    assert types(run)[0] == "started" and types(run)[-1] == "finished"


def test_validation_concept_loss_is_logged_and_only_cache_mode(tiny_workspace, tmp_path):
    ws = tiny_workspace
    val = tmp_path / "val"
    val.mkdir()
    for name in ("00-red-square", "03-blue-circle"):
        for ext in (".png", ".txt"):
            shutil.copy(DEMO_DATA / (name + ext), val / (name + ext))
    concepts = (f"data.concepts=[{{path: {DEMO_DATA}}}, {{path: {val}, validation: true}}]")
    assert cli(["train", "--preset", "demo", *overrides(ws, "val", concepts, "training.epochs=2",
                                                        "sampling.prompts=[]")]) == 0
    events = read_events(ws / "runs" / "val" / "events.jsonl")
    vals = [e for e in events if e["type"] == "validation"]
    assert [v["step"] for v in vals] == [4, 8] and all(v["images"] == 2 for v in vals)
    assert all(0 < v["loss"] < 10 for v in vals)
    # the validation images never train: every step's batch comes from the 8 training images
    assert next(e for e in events if e["type"] == "started")["steps_per_epoch"] == 4

    cache_ws = tmp_path / "cachews"
    shutil.copytree(ws / "models", cache_ws / "models")
    assert cli(["cache", "--preset", "demo", "--run-dir", str(tmp_path / "cacherun"), "--no-progress",
                "--set", f"general.workspace={cache_ws}"]) == 0
    events = read_events(tmp_path / "cacherun" / "events.jsonl")
    assert events[-1]["type"] == "finished" and "caches are ready" in events[-1]["message"]
    assert not [e for e in events if e["type"] == "step"]
    assert len(list((cache_ws / "cache" / "latents").rglob("*.safetensors"))) == 8


def test_a_full_disk_during_a_backup_is_one_clear_message_and_leaves_no_temp_folder(tiny_workspace, monkeypatch):
    import shutil as _shutil
    from collections import namedtuple
    ws = tiny_workspace

    def full(*args, **kwargs):  # what torch/safetensors raise when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    usage = namedtuple("usage", "total used free")
    real_save = safetensors.torch.save_file
    monkeypatch.setattr("safetensors.torch.save_file", full)
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: usage(10 * 2**30, 10 * 2**30 - 3 * 2**20, 3 * 2**20))
    msg = _fails_with(ws, "diskfull", "training.max_steps=2", "backup.every_n_steps=1", "sampling.prompts=[]",
                      "data.cache_latents=false", "data.cache_text=false",
                      words=("a backup", "disk is full", "3 MiB free", "no backup was written yet"))
    assert "enforce fail" not in msg and "intact" not in msg  # it said "the last complete backup is intact"
    # the second backup fails: the first is there to continue from, and the message names it
    saves = []

    def full_from_the_second(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs) if len(saves) == 1 else full()
    monkeypatch.setattr("safetensors.torch.save_file", full_from_the_second)
    _fails_with(ws, "diskfull1", "training.max_steps=3", "backup.every_n_steps=1", "sampling.prompts=[]",
                "data.cache_latents=false", "data.cache_text=false",
                words=("disk is full", "--resume last", "backup-step000001) is intact"))
    monkeypatch.setattr("safetensors.torch.save_file", full)
    # the same disk filling while the latent cache is written (another workspace: nothing cached yet)
    other = ws.parent / "diskfull-ws"
    shutil.copytree(ws / "models", other / "models", dirs_exist_ok=True)
    msg = _fails_with(other, "diskfull2", "training.max_steps=2", "sampling.prompts=[]", words=("disk is full",))
    assert "enforce fail" not in msg
    backups = ws / "runs" / "diskfull" / "backups"
    assert not [p for p in backups.iterdir()] if backups.exists() else True  # the half-written backup is gone
    # the disk fills while the event stream is written: the run still ends with its failed event, saying why
    import errno
    import trainer.events as events_mod
    real_write, run3 = os.write, ws / "runs" / "diskfull3"
    state = {"steps": 0}

    def full_after_a_step(fd, data):
        if b'"type": "step"' in data:
            state["steps"] += 1
        if state["steps"] >= 2 and (run3 / ".events.jsonl.reserve").exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(events_mod.os, "write", full_after_a_step)
    msg = _fails_with(ws, "diskfull3", "training.max_steps=4", "sampling.prompts=[]", words=("disk is full",))
    monkeypatch.setattr(events_mod.os, "write", real_write)
    assert [e["type"] for e in read_events(run3 / "events.jsonl")][-2:] == ["error", "failed"]
    assert (run3 / "events.jsonl").read_bytes().endswith(b"\n") and not (run3 / ".events.jsonl.reserve").exists()


def test_a_run_folder_on_a_full_disk_fails_with_its_own_figure_and_an_event(tiny_workspace, monkeypatch, capsys):
    """The run folder on a full small disk beside a large workspace: the first write (config.yaml) fails; the run
    still ends with its failed event (the event stream and its reserve open first), the figure is the run folder's
    disk, and no traceback is printed."""
    import errno
    from collections import namedtuple

    import trainer.train.loop as loop_mod
    ws = tiny_workspace
    run = ws / "runs" / "tmpfs-full"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**40, 2**39, 75 * 2**30) if run not in
                        [Path(p), *Path(p).parents] else usage(2**30, 2**30 - 2**20, 2**20))

    def full(cfg, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(loop_mod, "save_config", full)
    msg = _fails_with(ws, "tmpfs-full", words=("disk is full (1 MiB free)", str(run), "no backup was written yet"))
    assert "75" not in msg.split("free")[0]
    assert "Traceback" not in capsys.readouterr().err


def test_resume_removes_a_killed_saves_leftovers_applies_a_new_learning_rate_and_refuses_a_new_rank(tiny_workspace):
    from webui.runner import list_backups as ui_backups
    ws = tiny_workspace
    common = ("training.max_steps=2", "backup.every_n_steps=1", "sampling.prompts=[]", "training.learning_rate=0.001",
              "training.lr_scheduler=constant", "training.lr_warmup_steps=0")
    # a real kill -9 while the second backup is being put in place (written whole under its hidden name)
    killer = ("import os, signal, sys\nreal = os.replace\n"
              "def replace(src, dst):\n"
              "    if '.backup-step000002.tmp-' in str(src):\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(src, dst)\n"
              "os.replace = replace\n"
              "from trainer.__main__ import main\nsys.exit(main(sys.argv[1:], fresh_process=True))\n")
    proc = subprocess.run([sys.executable, "-c", killer, "train", "--preset", "demo", *overrides(ws, "relr", *common)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run = ws / "runs" / "relr"
    left = [p.name for p in (run / "backups").iterdir() if p.name.startswith(".backup-step000002.tmp-")]
    assert left and (run / "backups" / left[0] / "state.json").exists()  # what the kill left behind
    # what a kill inside atomic_dir's swap or atomic_path leaves: an old copy, a half result
    (run / "backups" / ".backup-step000001.old-deadbeef").mkdir()
    (run / ".relr.safetensors.tmp-12345678.safetensors").write_bytes(b"half")
    assert [p.name for p in ui_backups(run)] == ["backup-step000001"]  # the UI never lists them
    assert cli(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "last", "--no-progress",
                "--set", "training.max_steps=3", "--set", "training.learning_rate=0.01"]) == 0
    assert [p.name for d in (run, run / "backups") for p in d.iterdir() if p.name.startswith(".")] == []
    events = read_events(run / "events.jsonl")
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert any("training.learning_rate was 0.001" in w and "now 0.01" in w for w in warnings), warnings
    last_step = [e for e in events if e["type"] == "step"][-1]
    assert last_step["step"] == 3 and float(last_step["lr"]["unet"]) == pytest.approx(0.01)
    rc = cli(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "last", "--no-progress",
              "--set", "training.max_steps=4", "--set", "lora.rank=8"])
    assert rc == 1
    failed = read_events(run / "events.jsonl")[-1]
    assert failed["type"] == "failed" and "lora.rank: 4 in the backup, 8 now" in failed["message"]
    # another batch size: refused with the backup's value and the one asked for (it was replaced silently, and the
    # warning said "2 per process (was 4)")
    rc = cli(["train", str(run / "config.yaml"), "--run-dir", str(run), "--resume", "last", "--no-progress",
              "--set", "training.max_steps=4", "--set", "training.batch_size=4"])
    failed = read_events(run / "events.jsonl")[-1]
    assert rc == 1 and failed["type"] == "failed", failed
    assert "training.batch_size = 2" in failed["message"] and "asks for training.batch_size = 4" in failed["message"]


def test_portable_config_paths():
    from trainer.train.run_folder import portable_paths
    ws = str(ROOT / "ws")
    out = portable_paths({"a": ws, "b": [str(ROOT / "ws" / "runs" / "r")], "c": "/data/private/dogs", "d": "text",
                          "e": 3, "f": "~/secret/cats"}, ws)
    assert out == {"a": ".", "b": ["runs/r"], "c": "…/dogs", "d": "text", "e": 3, "f": "…/cats"}


def test_compiled_steps_agree_with_eager_steps(tiny_workspace):
    """training.compile compiles the denoiser's transformer blocks (regional); the trained LoRA and the losses
    equal the eager run's (inductor reorders float sums: 1e-5). On the tiny PixArt: its blocks share one shape, so
    inductor builds one forward and one backward graph (the tiny SD UNet's blocks come in four shapes: a cold
    inductor cache took 78 s of CPU for it, 42 s for PixArt)."""
    from safetensors.torch import load_file
    ws = tiny_workspace
    # plain SGD: Adam divides by sqrt(v), so a weight whose gradient is ~0 can move by ~lr on float noise (another
    # CPU's inductor kernels sum in another order); SGD keeps the comparison about the compiled model itself
    # no sample at the end: its no-grad graphs took a third of this test's time (tests/test_compile_graphs.py has a
    # compiled run that samples)
    common = ("training.max_steps=3", "sampling.every_n_steps=0", "sampling.at_end=false", "backup.every_n_epochs=0",
              "output.dtype=fp32", "general.tensorboard=false", "training.optimizer.name=sgd",
              "training.learning_rate=0.5")
    assert cli(["train", "--preset", "demo-pixart", *overrides(ws, "eager", *common)]) == 0
    from torch._dynamo.utils import counters
    counters.clear()
    torch._dynamo.reset()  # nothing compiled in memory by an earlier test: this run compiles (or loads) its blocks
    assert cli(["train", "--preset", "demo-pixart", *overrides(ws, "compiled", *common, "training.compile=true")]) == 0
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really captured the blocks (no silent eager fallback)
    runs = ws / "runs"
    eager, compiled = load_file(runs / "eager" / "eager.safetensors"), load_file(runs / "compiled" / "compiled.safetensors")
    assert set(eager) == set(compiled)
    assert max(float(v.abs().max()) for k, v in eager.items() if "lora_B" in k) > 0  # the LoRA trained (B starts at 0)
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5)
    steps = lambda run: [e for e in read_events(runs / run / "events.jsonl") if e["type"] == "step"]  # noqa: E731
    assert [e["loss"] for e in steps("compiled")] == pytest.approx([e["loss"] for e in steps("eager")], abs=1e-5)
    assert steps("compiled")[0]["first_step_s"] > 0 and "first_step_s" not in steps("eager")[0]
    log = (runs / "compiled" / "train.log").read_text()
    assert "BasicTransformerBlock compiled" in log
    # what it compiled is kept in the workspace's caches, and the next run of the same model loads it from there
    kept = ws / "cache" / "torch-compile"
    assert f"cached in {kept.resolve()}" in log and re.search(r"graphs compiled: [1-9]", log)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(kept.resolve())  # the run's own setting ended with it
    torch._dynamo.reset()  # as a new process starts: nothing compiled in memory
    assert cli(["train", "--preset", "demo-pixart", *overrides(ws, "again", *common, "training.compile=true",
                                                                "training.max_steps=1")]) == 0
    again = (runs / "again" / "train.log").read_text()
    assert re.search(r"graphs compiled: 0, loaded from the kernel cache: [1-9]", again), again[-2000:]


def test_the_kernel_cache_is_the_workspaces_unless_the_user_chose_one(tmp_path, monkeypatch):
    """training.compile's kernel cache: the run's folder while it runs (torch's own default folder in the variable
    does not count as a choice), the previous value after; a TORCHINDUCTOR_CACHE_DIR the user set stays."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from trainer.train.compile import kernel_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    with kernel_cache(tmp_path / "cache" / "torch-compile") as kept:
        assert kept == (tmp_path / "cache" / "torch-compile").resolve() and cache_dir() == str(kept)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    mine = str(tmp_path / "mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", mine)
    with kernel_cache(tmp_path / "other" / "torch-compile") as kept:
        assert kept is None and cache_dir() == mine
    assert not (tmp_path / "other").exists()


def test_a_machine_that_cannot_compile_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """training.compile where inductor cannot make kernels: the run ends in seconds with one message at the
    setting that says what to install, before any model loads (not in the first step's compile)."""
    from torch._inductor import cpp_builder
    from torch.utils import _triton

    from trainer.train.compile import backend_problem

    def no_compiler():
        raise RuntimeError("no C++ compiler found in ('g++',)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    ws = tmp_path
    assert cli(["train", "--preset", "demo-pixart", *overrides(ws, "no-compiler", "training.compile=true",
                                                               "training.max_steps=1")]) == 1
    run = ws / "runs" / "no-compiler"
    error = next(e for e in read_events(run / "events.jsonl") if e["type"] == "error")
    assert error["key"] == "training.compile" and "no C++ compiler was found" in error["message"]
    assert "turn training.compile off" in error["message"]
    assert "loading model" not in (run / "train.log").read_text()
    monkeypatch.setattr(_triton, "has_triton_package", lambda: False)
    assert "pip install triton-windows" in backend_problem("cuda")
    assert backend_problem("mps") is None


def test_regional_compile_finds_each_familys_repeated_blocks():
    from diffusers import FluxTransformer2DModel, PixArtTransformer2DModel

    from trainer.train.compile import compile_blocks, repeated_block_classes
    pixart = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                      num_layers=2, cross_attention_dim=16, caption_channels=16, sample_size=8,
                                      patch_size=2, norm_type="ada_norm_single")
    assert repeated_block_classes(pixart) == ["BasicTransformerBlock"]  # no _repeated_blocks: found in its ModuleList
    flux = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                  axes_dims_rope=(2, 2, 4))
    assert sorted(repeated_block_classes(flux)) == ["FluxSingleTransformerBlock", "FluxTransformerBlock"]
    assert compile_blocks(pixart) == {"BasicTransformerBlock": 2}
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_the_learning_demo_draws_a_red_square_and_a_blue_circle(tiny_workspace):
    """demo-learns, as shipped (about half a minute here): the loss falls, and the last samples are the prompts' shapes
    in their colours on white (the tiny VAE is a near identity, so a sample is what the UNet learned). The first
    samples are noise; thresholds leave room for another CPU's rounding."""
    import numpy as np
    from PIL import Image
    ws = tiny_workspace
    assert cli(["train", "--preset", "demo-learns", *overrides(ws, "learns", "general.tensorboard=false",
                                                                "backup.every_n_epochs=0")]) == 0
    run = ws / "runs" / "learns"
    losses = [e["loss"] for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert len(losses) == 360 and np.mean(losses[-60:]) < 0.5 * np.mean(losses[:60])

    def colours(name: str):
        rgb = np.asarray(Image.open(run / "samples" / name).convert("RGB"), dtype=np.float32) / 255
        corners = np.concatenate([rgb[:8, :8], rgb[:8, -8:], rgb[-8:, :8], rgb[-8:, -8:]]).reshape(-1, 3)
        return rgb[24:40, 24:40].reshape(-1, 3).mean(0), corners.mean(0)

    (r, g, b), corners = colours("step000360-p0.png")  # "a red square on a white background"
    assert r > 0.6 and g < 0.35 and b < 0.35 and corners.min() > 0.6, (r, g, b, corners)
    (r, g, b), corners = colours("step000360-p1.png")  # "a blue circle on a white background"
    assert b > 0.5 and b > r + 0.25 and corners.min() > 0.6, (r, g, b, corners)
    (r, g, b), _ = colours("step000120-p0.png")  # still noise at the first samples: not yet the red square
    assert not (r > 0.6 and g < 0.35 and b < 0.35)


def test_a_steps_graph_is_gone_before_the_next_forward(tiny_workspace, monkeypatch):
    """The loop takes a step's loss (detached) and lets its graph go: at the next forward nothing of the step before
    is held but what backward left (a graph held there keeps whatever its nodes hold, a checkpoint's function
    object among them, until the next forward has run: see tests/test_checkpointing_options.py)."""
    import weakref

    from trainer.train import loop
    losses, alive = [], []
    real = loop.forward_loss

    def forward_loss(*args, **kwargs):  # no garbage collection: freed when the last reference goes
        alive.append([r() is not None for r in losses])
        loss = real(*args, **kwargs)
        losses.append(weakref.ref(loss))
        return loss

    monkeypatch.setattr(loop, "forward_loss", forward_loss)
    assert cli(["train", "--preset", "demo", *overrides(tiny_workspace, "graph-gone", "training.max_steps=3",
                                                         "training.gradient_checkpointing=true",
                                                         "sampling.prompts=[]", "general.tensorboard=false",
                                                         "backup.every_n_epochs=0")]) == 0
    assert len(alive) == 3 and alive == [[], [False], [False, False]], alive
