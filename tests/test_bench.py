"""bench/: the diffusers comparison's checks, input preparation, argument mapping and step timing.

None of this runs diffusers' script (it is not in the repo, and needs torchvision + datasets): the
checks are driven with fake scripts and modules, the timing with a small child that draws a tqdm-like bar.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.__main__ import main as cli
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import diffusers_compare as dc  # noqa: E402
from childproc import loop_rate, run_child, steady_rate  # noqa: E402

FAKE_SCRIPT = """
parser.add_argument("--train_data_dir")
parser.add_argument("--rank")
from peft import LoraConfig
check_min_version("0.37.0.dev0")
"""


def test_missing_script_names_the_path(tmp_path):
    with pytest.raises(SystemExit, match=r"no-such\.py: no such file"):
        dc.check_script(tmp_path / "no-such.py")


def test_script_checks(tmp_path):
    old = tmp_path / "old.py"
    old.write_text('parser.add_argument("--train_data_dir")\nparser.add_argument("--rank")\n'
                   "from diffusers.models.attention_processor import LoRAAttnProcessor\n")
    with pytest.raises(SystemExit, match="old version"):
        dc.check_script(old)
    other = tmp_path / "other.py"
    other.write_text("print('hello')\n")
    with pytest.raises(SystemExit, match="does not look like"):
        dc.check_script(other)
    checkout = tmp_path / "diffusers"
    script = checkout / dc.SCRIPT_RELPATH
    script.parent.mkdir(parents=True)
    script.write_text(FAKE_SCRIPT)
    path, info = dc.check_script(checkout)  # a checkout's top folder is accepted
    assert path == script.resolve() and info["min_version"] == "0.37.0.dev0"


def test_interpreter_without_modules_is_refused():
    with pytest.raises(SystemExit) as exc:
        dc.check_interpreter(sys.executable, modules=("json", "no_such_module_for_bench"))
    msg = str(exc.value)
    assert sys.executable in msg and "no_such_module_for_bench" in msg and "json" not in msg.split("needs")[0]
    with pytest.raises(SystemExit, match="no such interpreter"):
        dc.check_interpreter("/no/such/python")
    info = dc.check_interpreter(sys.executable, modules=("json",))
    assert "json" in info["versions"]


def _demo_cfg(ws: Path):
    from trainer.config.checks import load_config
    return load_config(None, [f"general.workspace={ws}", "sampling.prompts=[]"], preset="demo")


def test_dataset_is_an_imagefolder_with_the_same_captions(tmp_path):
    cfg = _demo_cfg(tmp_path)
    out = dc.prepare_dataset(cfg, tmp_path / "data", base_dir=ROOT)
    rows = [json.loads(line) for line in (tmp_path / "data" / "metadata.jsonl").read_text().splitlines()]
    assert out["images"] == len(rows) == len(list((ROOT / "presets" / "demo-data").glob("*.png")))
    for row in rows:
        image = tmp_path / "data" / row["file_name"]
        original = image.resolve()
        assert original.read_bytes() == image.read_bytes()
        assert row["text"] == original.with_suffix(".txt").read_text().strip()


def test_script_args_match_the_demo_settings(tmp_path):
    cfg = _demo_cfg(tmp_path)
    inputs = {"model": "/m", "train_data_dir": "/d"}
    args, notes = dc.script_args(cfg, inputs, 32, tmp_path / "out", tmp_path / "cache")

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--resolution") == "64" and value("--train_batch_size") == "2"
    assert value("--max_train_steps") == "32" and value("--rank") == "4"
    assert float(value("--learning_rate")) == 0.001 and value("--lr_scheduler") == "constant"
    assert value("--lr_warmup_steps") == "0" and value("--seed") == str(cfg.general.seed)
    assert value("--mixed_precision") == "no" and "--center_crop" in args
    assert int(value("--checkpointing_steps")) > 32  # no mid-run checkpoint, like Atelier's comparison run
    assert any("caches" in n for n in notes)


def test_bar_watcher_and_child_timing(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import sys, time
        print("Device: cpu", flush=True)
        print("***** Running training *****", flush=True)
        for n in range(0, 6):
            sys.stderr.write(f"\\rSteps: {n*20}%|##| {n}/5 [00:00<00:00, 1.0it/s]")
            sys.stderr.flush()
            if n != 3:  # a skipped redraw: the rate must still be right
                time.sleep(0.05)
        sys.stderr.write("\\n")
    """))
    watcher = dc.BarWatcher()
    res = run_child([sys.executable, str(child)], watch=watcher, log_path=tmp_path / "child.log")
    assert res.returncode == 0 and res.wall_s > 0
    assert [n for n, _ in watcher.marks] == [1, 2, 3, 4, 5] and watcher.total == 5
    assert watcher.device == "cpu" and watcher.started is not None
    assert res.max_rss_mib is None or res.max_rss_mib > 1
    rate = loop_rate(watcher.marks)
    assert rate is not None and rate > 0
    assert loop_rate([(1, 0.0), (5, 2.0)]) == 2.0 and loop_rate([(1, 0.0)]) is None
    # one stall after the first step moves the first-to-last rate, not the median step
    marks = [(1, 0.0), (2, 1.0), (3, 1.1), (4, 1.2), (5, 1.3)]
    assert loop_rate(marks) == 3.08 and steady_rate(marks) == 10.0 and steady_rate([(1, 0.0)]) is None


def test_flops_of_a_step_are_counted_from_the_real_size_model_on_the_meta_device():
    import flops
    one = flops.step_flops("sd15", 256, 1, "lora")
    two = flops.step_flops("sd15", 256, 2, "lora")
    assert two["forward_tflops"] == pytest.approx(2 * one["forward_tflops"], rel=1e-6)  # linear in the batch
    big = flops.step_flops("sd15", 512, 1, "finetune")
    assert big["forward_tflops"] > 4 * one["forward_tflops"]  # 4× the pixels, and attention grows faster
    assert big["step_tflops"] == pytest.approx(3 * big["forward_tflops"])
    assert one["step_tflops"] == pytest.approx(2 * one["forward_tflops"])  # frozen weights: no weight gradients
    assert flops.mfu(2.0, 10.0, 100.0) == pytest.approx(0.2)


def test_bench_train_reports_the_presets_step_flops_and_mfu():
    import bench_train
    import flops
    out = bench_train.model_flops("sd15-lora", [], {"steady_steps_per_s": 0.5}, 100.0)
    expected = flops.step_flops("sd15", 512, 2, "lora")["step_tflops"]  # the preset's size and batch
    assert out["step_tflops"] == pytest.approx(expected, abs=1e-4)
    assert out["mfu"] == pytest.approx(expected * 0.5 / 100.0, abs=1e-4)
    assert "mfu_note" in bench_train.model_flops("demo-flux", [], {}, 100.0)  # no real-size count for it


def test_bench_train_reads_where_the_time_to_the_first_step_went(tmp_path):
    """bench_train's start-up phases come from the trainer's own train.log: a real run's lines give every phase,
    in order, after the process's start and before its first step."""
    import time

    import bench_train
    t0 = time.time()
    assert cli(["train", "--preset", "demo", "--no-progress", "--set", f"general.workspace={tmp_path}",
                "--set", "general.run_name=r", "--set", "training.max_steps=1", "--set", "sampling.prompts=[]",
                "--set", "backup.every_n_epochs=0"]) == 0
    marks = bench_train.startup_phases(tmp_path / "runs" / "r" / "train.log", t0)
    assert list(marks) == [key for key, _ in bench_train.PHASES], marks
    first_step = next(e for e in read_events(tmp_path / "runs" / "r" / "events.jsonl") if e["type"] == "step")
    assert 0 <= marks["loading_model"] <= marks["caching_latents"] <= marks["text_cached"] <= marks["training"]
    assert marks["training"] <= first_step["time"] - t0 + 0.01  # the log's milliseconds against the event's time
    assert bench_train.startup_phases(tmp_path / "missing.log", t0) == {}


@pytest.mark.slow
def test_random_weights_trains_from_a_folder_of_configs_alone(tmp_path):
    """bench/random_weights.py (real-size GPU benches with nothing downloaded): a diffusers folder with configs and
    tokenizers but no weight file trains and saves a LoRA; the plain trainer refuses the same folder."""
    import shutil
    import subprocess

    from trainer.families.flux.tiny import ensure_tiny
    tiny = Path(ensure_tiny("tiny-flux", tmp_path / "models")["diffusers"])
    configs = tmp_path / "configs"
    shutil.copytree(tiny, configs, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    assert not list(configs.rglob("*.safetensors"))
    args = ["train", "--preset", "demo-flux", "--no-progress", "--set", f"model.path={configs}",
            "--set", f"general.workspace={tmp_path / 'ws'}", "--set", "training.max_steps=2",
            "--set", "sampling.prompts=[]"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    assert cli([*args, "--set", "general.run_name=plain"]) != 0  # in this process: the refusal needs no fresh one
    failed = read_events(tmp_path / "ws" / "runs" / "plain" / "events.jsonl")[-1]
    assert failed["type"] == "failed" and "Could not load" in failed["message"], failed
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "random_weights.py"), *args,
                          "--set", "general.run_name=rw"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "ws" / "runs" / "rw" / "rw.safetensors").stat().st_size > 0


@pytest.mark.slow
def test_flux_example_adapts_the_layers_atelier_adapts():
    """The side-by-side gives diffusers' Flux script ``--lora_layers`` = Atelier's Flux LoRA preset: under peft's
    matching both adapt the same modules (the script's default adds the double blocks' feed-forwards), and the bare
    example step (bench/step_counts.py's reference) trains with them."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    import bare_flux_step
    from trainer.families.flux.family import Flux

    narrow = {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2,
              "axes_dims_rope": [2, 2, 4], "joint_attention_dim": 16, "pooled_projection_dim": 16}
    config = {**bare_flux_step.FULL_SIZE["flux-dev"]["configs"]["transformer"], **narrow}

    def adapted(targets):
        model = FluxTransformer2DModel.from_config(config)
        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets))
        return {name for name, m in model.named_modules() if hasattr(m, "lora_A")}

    atelier = adapted(Flux.lora_targets(None, "unet", "attn"))
    assert len(atelier) == 2 * 8 + 2 * 3  # per double block 8 attention projections, per single block q, k, v
    assert adapted(list(bare_flux_step.ATELIER_TARGETS)) == atelier
    extra = adapted(list(bare_flux_step.EXAMPLE_TARGETS)) - atelier
    assert extra and all(".ff" in name for name in extra)

    step, resident = bare_flux_step.build(narrow, side=32, text_tokens=8)
    losses = [step() for _ in range(2)]
    assert all(isinstance(x, float) and x == x for x in losses)
    assert any(t.requires_grad for t in resident())
