#!/usr/bin/env python3
"""Measure a training run: time to first step, steps/s (loop only and whole process), peak memory.

    .venv/bin/python bench/bench_train.py                       # the demo preset
    .venv/bin/python bench/bench_train.py --preset sd15-lora --set model.path=/models/sd15.safetensors \
        --set data.concepts.0.path=/data/dog

Runs ``python -m trainer train`` as a child process (so start-up, imports and model loading count, as
they do for a user), reads its events.jsonl, and prints one JSON line plus a table row for
docs/performance.md. Peak RAM is the child's max RSS; peak VRAM comes from the trainer's own
``started``/``finished`` events when it ran on a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(preset: str, overrides: list, workspace: Path, run_name: str) -> dict:
    from trainer.events import read_events
    cmd = [sys.executable, "-m", "trainer", "train", "--preset", preset, "--no-progress",
           "--set", f"general.workspace={workspace}", "--set", f"general.run_name={run_name}",
           *[x for o in overrides for x in ("--set", o)]]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    events = read_events(workspace / "runs" / run_name / "events.jsonl")
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    end = next(e for e in events if e["type"] in ("finished", "stopped", "failed"))
    loop_s = steps[-1]["time"] - steps[0]["time"]
    return {
        "preset": preset,
        "overrides": overrides,
        "steps": len(steps),
        "batch_size": started["batch_size"],
        "device": started.get("device"),
        "time_to_first_step_s": round(steps[0]["time"] - t0, 2),
        "time_to_started_s": round(started["time"] - t0, 2),
        "loop_steps_per_s": round((len(steps) - 1) / loop_s, 2) if loop_s > 0 else None,
        "process_steps_per_s": round(len(steps) / wall, 2),
        "wall_s": round(wall, 2),
        "end_s_after_last_step": round(end["time"] - steps[-1]["time"], 2),
        "peak_ram_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "peak_vram_mib": end.get("peak_vram_mib"),
        "cache": started.get("cache"),
        "caching_images_per_s": _caching_rate(started.get("cache")),
    }


def _caching_rate(cache) -> "float | None":
    """VAE-encoded images per second while filling the latent cache (None when nothing was encoded)."""
    if not cache or not cache.get("latents_encoded") or not cache.get("seconds"):
        return None
    return round(cache["latents_encoded"] / cache["seconds"], 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workspace", help="Workspace to use (default: a temporary folder; the tiny model "
                                        "and latent cache are built in a first, unmeasured warm-up run).")
    ap.add_argument("--no-warmup", action="store_true", help="Measure a cold first run (builds the tiny model, "
                                                         "fills the caches: gives caching images/s).")
    args = ap.parse_args()
    ws = Path(args.workspace) if args.workspace else Path(tempfile.mkdtemp(prefix="atelier-bench-"))
    if not args.no_warmup:
        measure(args.preset, args.overrides + ["sampling.prompts=[]", "training.max_steps=1"], ws, "warmup")
    result = measure(args.preset, args.overrides, ws, f"bench-{int(time.time())}")
    import torch
    result["machine"] = f"{platform.machine()} {platform.processor() or ''} cores={__import__('os').cpu_count()}"
    result["torch"] = torch.__version__
    print(json.dumps(result))
    print(f"| {result['preset']} | {result['device']} | {result['time_to_first_step_s']} s | "
          f"{result['loop_steps_per_s']} | {result['process_steps_per_s']} | {result['peak_ram_mib']} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
