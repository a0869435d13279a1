#!/usr/bin/env python3
"""Measure a training run: time to first step, steps/s (loop only and whole process), peak memory.

    .venv/bin/python bench/bench_train.py                       # the demo preset
    .venv/bin/python bench/bench_train.py --set training.compile=true   # regional torch.compile: its first
                                                                 # step (compiles included) is compile_first_step_s
    .venv/bin/python bench/bench_train.py --preset sd15-lora --set model.path=/models/sd15.safetensors \
        --set data.concepts.0.path=/data/dog
    # the same run, side by side with diffusers' own example script (needs torchvision + datasets):
    PY/bin/python bench/bench_train.py --diffusers-script ~/diffusers/examples/text_to_image/train_text_to_image_lora.py

Runs ``python -m trainer train`` as a child process (so start-up, imports and model loading count, as
they do for a user), reads its events.jsonl, and prints one JSON line plus a table row for
docs/performance.md. Peak RAM is the child's own max RSS; peak VRAM comes from the trainer's own
``started``/``finished`` events when it ran on a GPU.

With ``--diffusers-script`` the bench also prepares the same model (a diffusers folder), images and
captions (an imagefolder with metadata.jsonl) and settings for diffusers'
``train_text_to_image_lora.py``, runs it as a child too, reads its step times from its progress bar,
and prints both rows. Sampling and backups are off in both runs (the script's validation is not the
same thing), and each trainer gets one unmeasured warm-up run (model build, latent cache, datasets
cache, disk cache) before the measured ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from childproc import run_child, steady_rate  # noqa: E402

# what the comparison run turns off in Atelier (the script does no sampling and no mid-run checkpoint)
COMPARE_OVERRIDES = ["sampling.prompts=[]", "backup.every_n_epochs=0", "backup.every_n_steps=0",
                     "output.save_every_n_epochs=0"]
FIGURES = ("time_to_first_step_s", "time_to_started_s", "loop_steps_per_s", "steady_steps_per_s",
           "process_steps_per_s", "wall_s", "exit_s_after_last_step",
           "end_s_after_last_step", "peak_ram_mib", "peak_vram_mib", "peak_vram_reserved_mib", "caching_images_per_s")


def thread_env(threads: Optional[int]) -> Optional[dict]:
    """The children's environment: torch's thread pool capped at ``threads`` (None = torch's default)."""
    if not threads:
        return None
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def warmup_env(env: Optional[dict]) -> dict:
    """The warm-up run's environment: as the measured runs', but allowed to write ``.pyc`` files (some
    shells and containers set PYTHONDONTWRITEBYTECODE, which would make every measured run compile
    Atelier's own modules again, ≈ 0.15 s; a user's first run writes them)."""
    warm = dict(env if env is not None else os.environ)
    warm.pop("PYTHONDONTWRITEBYTECODE", None)
    return warm


def measure(preset: str, overrides: list, workspace: Path, run_name: str, python: str = sys.executable,
            env: Optional[dict] = None, random_weights: bool = False) -> dict:
    from trainer.events import read_events
    entry = [str(ROOT / "bench" / "random_weights.py")] if random_weights else ["-m", "trainer"]
    cmd = [python, *entry, "train", "--preset", preset, "--no-progress",
           "--set", f"general.workspace={workspace}", "--set", f"general.run_name={run_name}",
           *[x for o in overrides for x in ("--set", o)]]
    res = run_child(cmd, cwd=ROOT, env=env, log_path=workspace / f"{run_name}.log")
    if res.returncode != 0:
        raise SystemExit(f"training failed ({res.returncode}):\n" + "\n".join(res.tail[-30:]))
    events = read_events(workspace / "runs" / run_name / "events.jsonl")
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    end = next(e for e in events if e["type"] in ("finished", "stopped", "failed"))
    loop_s = steps[-1]["time"] - steps[0]["time"]
    return {
        "trainer": "atelier",
        "preset": preset,
        "overrides": overrides,
        "steps": len(steps),
        "batch_size": started["batch_size"],
        "device": started.get("device"),
        "time_to_first_step_s": round(steps[0]["time"] - res.t0, 2),
        "time_to_started_s": round(started["time"] - res.t0, 2),
        # training.compile: the first step's time, compiles included (the rest of the figures are after it)
        "compile_first_step_s": steps[0].get("first_step_s"),
        "loop_steps_per_s": round((len(steps) - 1) / loop_s, 2) if loop_s > 0 else None,
        "steady_steps_per_s": steady_rate([(e["step"], e["time"]) for e in steps]),
        "process_steps_per_s": round(len(steps) / res.wall_s, 2),
        "wall_s": round(res.wall_s, 2),
        "end_s_after_last_step": round(end["time"] - steps[-1]["time"], 2),  # to the `finished` event
        "exit_s_after_last_step": round(res.t0 + res.wall_s - steps[-1]["time"], 2),  # to the process's exit
        "peak_ram_mib": res.max_rss_mib,
        "peak_vram_mib": end.get("peak_vram_mib"),
        "peak_vram_reserved_mib": end.get("peak_vram_reserved_mib"),
        "cache": started.get("cache"),
        "caching_images_per_s": _caching_rate(started.get("cache")),
        "startup": startup_phases(workspace / "runs" / run_name / "train.log", res.t0),
    }


# where the time to the first step goes: the first train.log line of each phase, as seconds from the process's start
PHASES = (("loading_model", "loading model "), ("caching_latents", "caching latents "),
          ("latents_cached", "latent cache: "), ("caching_text", "caching text "), ("text_cached", "text cache: "),
          ("training", re.compile(r"training \d+ steps ")))


def startup_phases(log: Path, t0: float) -> Dict[str, float]:
    """Seconds from the process's start to the first train.log line of each of :data:`PHASES` (the log's own
    timestamps, local time with milliseconds); before ``loading_model``: imports and checks; from it to the caches:
    building or reading the model; from the caches to ``training``: moving it to the device, adapters, optimizer."""
    import datetime
    marks: Dict[str, float] = {}
    if not log.is_file():
        return marks
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4 or parts[2] != "INFO":
            continue
        for key, prefix in PHASES:
            if key not in marks and (parts[3].startswith(prefix) if isinstance(prefix, str)
                                     else prefix.match(parts[3])):
                try:
                    when = datetime.datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    break
                marks[key] = round(when - t0, 2)
                break
    return marks


def _caching_rate(cache) -> "float | None":
    """VAE-encoded images per second while filling the latent cache (None when nothing was encoded)."""
    if not cache or not cache.get("latents_encoded") or not cache.get("seconds"):
        return None
    return round(cache["latents_encoded"] / cache["seconds"], 2)


def median_of(runs: List[dict]) -> dict:
    """The first run's fields, with each figure replaced by the median over ``runs``."""
    out = dict(runs[0])
    for key in FIGURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    if len(runs) > 1:
        out["runs"] = len(runs)
        out["all"] = {k: [r.get(k) for r in runs] for k in ("time_to_first_step_s", "loop_steps_per_s",
                                                            "steady_steps_per_s", "process_steps_per_s",
                                                            "peak_ram_mib")}
    return out


def _row(r: dict, label: str) -> str:
    ram = f"{r['peak_ram_mib']} MiB" if r.get("peak_ram_mib") is not None else "–"
    cache = r.get("caching_images_per_s")
    return (f"| {label} | {r.get('device')} | {r['steps']} | {r['time_to_first_step_s']} s | "
            f"{r['loop_steps_per_s']} | {r.get('steady_steps_per_s')} | {r['process_steps_per_s']} | {ram} | "
            f"{cache if cache is not None else '–'} |")


def _machine() -> Dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"machine": f"{platform.machine()} {platform.processor() or ''} cores={os.cpu_count()}".replace("  ", " "),
            "load_before": [round(x, 2) for x in load] if load else None}


def _torch_probe(python: str, env: Optional[dict] = None) -> Dict[str, Any]:
    """torch's version and how long ``import torch`` takes in a fresh ``python``: a yardstick for the
    machine's speed at the time (on a shared VM it drifts by 1.5x over an hour), printed beside the figures."""
    import subprocess
    code = "import time; t = time.perf_counter(); import torch; print(torch.__version__, time.perf_counter() - t)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env).stdout.split()
    return {"torch": out[0], "import_torch_s": round(float(out[1]), 2)} if len(out) == 2 else {"torch": "?"}


def compare(args, ws: Path) -> int:
    """Atelier and diffusers' train_text_to_image_lora.py on the same model, data and settings."""
    import diffusers_compare as dc
    from trainer.config.checks import load_config

    script, script_info = dc.check_script(args.diffusers_script)
    dpython = args.diffusers_python or sys.executable
    interp = dc.check_interpreter(dpython, script=script)
    overrides = args.overrides + COMPARE_OVERRIDES
    machine = _machine()
    env = thread_env(args.threads)

    # Atelier warm-up: builds a built-in model, fills the latent/text caches (as in the plain bench)
    if not args.no_warmup:
        measure(args.preset, overrides + ["training.max_steps=1"], ws, f"warmup-{int(time.time())}",
                env=warmup_env(env))
    cfg = load_config(None, overrides + [f"general.workspace={ws}"], preset=args.preset)
    inputs = dc.prepare_inputs(cfg, ws / "diffusers", base_dir=ROOT)

    atelier_runs, diffusers_runs, notes = [], [], []
    for i in range(args.repeat):
        atelier_runs.append(measure(args.preset, overrides, ws, f"bench-{int(time.time())}-{i}", env=env))
        steps = atelier_runs[0]["steps"]
        if i == 0:
            sargs, notes = dc.script_args(cfg, inputs, steps, ws / "diffusers" / "output",
                                          ws / "diffusers" / "hf-cache", script_info)
            sargs += args.diffusers_arg
            if not args.no_warmup:  # datasets' imagefolder cache, page cache, .pyc files
                warm = list(sargs)
                warm[warm.index("--max_train_steps") + 1] = "1"
                dc.measure_diffusers(interp["executable"], script, warm, ws / "diffusers", "warmup",
                                     threads=args.threads)
        diffusers_runs.append(dc.measure_diffusers(interp["executable"], script, sargs, ws / "diffusers",
                                                   f"bench-{i}", threads=args.threads))
    a, d = median_of(atelier_runs), median_of(diffusers_runs)
    a.update(_torch_probe(sys.executable, env))
    d["torch"] = interp["versions"].get("torch")
    d["script"] = script_info
    d["args"] = sargs
    result = {"compare": True, "preset": args.preset, "overrides": overrides, "threads": args.threads,
              **machine,
              "load_after": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
              "inputs": inputs, "not_equivalent": notes, "atelier": a, "diffusers": d,
              "versions": {"atelier_python": sys.executable, "diffusers_python": interp["executable"],
                           **{k: v for k, v in interp["versions"].items()}}}
    print(json.dumps(result))
    print("| trainer | device | steps | first step | loop steps/s | median-step steps/s | process steps/s | "
          "peak RAM | caching img/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    label = ", ".join([args.preset, *args.overrides])
    print(_row(a, f"Atelier ({label})"))
    print(_row(d, "diffusers train_text_to_image_lora.py"))
    for n in notes:
        print(f"- not the same: {n}", file=sys.stderr)
    return 0


def model_flops(preset: str, overrides: list, result: Dict[str, Any], peak_tflops: float) -> Dict[str, Any]:
    """The step's FLOPs (real-size model of the preset's family) and MFU at the measured steady speed."""
    import flops
    from trainer.config.checks import load_config
    cfg = load_config(preset=preset, overrides=overrides)
    family = str(cfg.model.family)
    if family == "auto":  # detected from the weights at load time; the preset's name says it for the bench
        family = next((f for f in ("sdxl", "sd2", "sd15") if preset.startswith(f)), "")
    family = family if family in ("sd15", "sd2", "sdxl") else ""
    if not family:
        return {"mfu_note": f"FLOPs are counted for SD 1.x/2.x/SDXL; model.family = {cfg.model.family}"}
    side = int(str(cfg.data.resolution).split(",")[0].split("x")[0])
    count = flops.step_flops(family, side, int(cfg.training.batch_size), str(cfg.training.method))
    speed = result.get("steady_steps_per_s") or result.get("loop_steps_per_s")
    out: Dict[str, Any] = {"step_tflops": round(count["step_tflops"], 4), "peak_tflops": peak_tflops}
    if speed:
        out["mfu"] = round(flops.mfu(count["step_tflops"], float(speed), peak_tflops), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workspace", help="Workspace to use (default: a temporary folder; the tiny model "
                                        "and latent cache are built in a first, unmeasured warm-up run).")
    ap.add_argument("--no-warmup", action="store_true", help="Measure a cold first run (builds the tiny model, "
                                                         "fills the caches: gives caching images/s).")
    ap.add_argument("--diffusers-script", metavar="PATH",
                    help="Also run diffusers' examples/text_to_image/train_text_to_image_lora.py (this file, or "
                         "a diffusers checkout) on the same model, images and settings, and print both rows.")
    ap.add_argument("--diffusers-python", metavar="PATH",
                    help="Interpreter for the diffusers script (default: this one); it needs torch, "
                         "torchvision, datasets, diffusers, transformers, accelerate and peft.")
    ap.add_argument("--diffusers-arg", action="append", default=[], metavar="ARG",
                    help="Extra argument for the diffusers script (repeatable), e.g. "
                         "--diffusers-arg=--dataloader_num_workers=2.")
    ap.add_argument("--random-weights", action="store_true",
                    help="Build every model from its configs with random weights (bench/random_weights.py): "
                         "real-size speed and memory with nothing downloaded; point model.path at a diffusers "
                         "folder of configs, or keep the preset's hub id (the family's shipped full-size configs).")
    ap.add_argument("--threads", type=int, default=None,
                    help="Cap torch's CPU threads in every measured child (OMP_NUM_THREADS); default: torch's "
                         "own choice. On a shared, busy CPU 1 thread gives steadier figures.")
    ap.add_argument("--repeat", type=int, default=1, help="Measured runs per trainer (alternating); "
                                                          "figures are medians.")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="The device's dense peak in the training precision: adds the step's FLOPs (counted from "
                         "the real-size model, bench/flops.py) and MFU for SD 1.x/2.x/SDXL presets.")
    args = ap.parse_args()
    ws = Path(args.workspace) if args.workspace else Path(tempfile.mkdtemp(prefix="atelier-bench-"))
    ws.mkdir(parents=True, exist_ok=True)
    if args.diffusers_script or args.diffusers_python:
        if args.random_weights:
            raise SystemExit("bench: --random-weights runs Atelier alone (the diffusers script loads real weights).")
        if not args.diffusers_script:
            raise SystemExit("bench: --diffusers-python needs --diffusers-script PATH.")
        return compare(args, ws)
    machine = _machine()
    env = thread_env(args.threads)
    if not args.no_warmup:
        measure(args.preset, args.overrides + ["sampling.prompts=[]", "training.max_steps=1"], ws,
                f"warmup-{int(time.time())}", env=warmup_env(env), random_weights=args.random_weights)
    runs = [measure(args.preset, args.overrides, ws, f"bench-{int(time.time())}-{i}", env=env,
                    random_weights=args.random_weights) for i in range(args.repeat)]
    result = median_of(runs)
    result.update(machine, threads=args.threads)
    result.update(_torch_probe(sys.executable, env))
    if args.peak_tflops:
        result.update(model_flops(args.preset, args.overrides, result, args.peak_tflops))
    print(json.dumps(result))
    print(f"| {result['preset']} | {result['device']} | {result['time_to_first_step_s']} s | "
          f"{result['loop_steps_per_s']} | {result['process_steps_per_s']} | {result['peak_ram_mib']} MiB |")
    if "import_torch_s" in result:
        print(f"(machine speed at the time: `import torch` took {result['import_torch_s']} s in a fresh process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
