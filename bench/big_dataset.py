#!/usr/bin/env python3
"""What a big dataset costs around training: the scan before the model loads, ``data-report``, the caption editor.

    .venv/bin/python bench/big_dataset.py                      # 10k and 50k images
    .venv/bin/python bench/big_dataset.py --sizes 2000 --json
    .venv/bin/python bench/big_dataset.py --keep /tmp/big      # keep (and reuse) the made datasets

For each size: makes N distinct small PNGs (48 to 80 px, four shapes, every image's pixels differ) with captions
(a few tags each, drawn from a small vocabulary) in a fresh workspace, once; then times, each in a fresh Python
process so nothing is remembered in memory:

- cold scan: the trainer's data set-up (``DataPipeline``: scan, buckets, duplicates) with no scan index: every
  image decoded and hashed;
- warm relaunch: the same again with the index the cold scan left in ``<workspace>/cache`` (what a relaunch does
  before "loading model"), wall and CPU seconds (the CPU time of all the process's threads: on a shared machine
  the wall time also holds the waits for a core);
- data-report: ``python -m trainer data-report`` (wall time of the command, interpreter start included);
- the caption editor (in one process on the page's own handlers, page built without a server): opening the
  folder, saving one caption, Replace-in-all that changes one caption in two thousand.

Prints one table (seconds; ``*_cpu``: CPU seconds of the process, all threads). Goals (issue 36): relaunch of 50k images under 3 s before the model loads, saving one
caption under 100 ms at 50k images. Linux or macOS; no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(64, 64), (48, 80), (80, 48), (56, 72)]
TAGS = ["cat", "dog", "red", "blue", "garden", "sofa", "window", "night", "portrait", "outdoors", "smile", "hat"]

SCAN = """
import json, sys, time
from trainer.config.checks import load_config
from trainer.data.pipeline import DataPipeline
cfg = load_config(sys.argv[1])
t, cpu = time.perf_counter(), time.process_time()
pipe = DataPipeline(cfg, warn=lambda m: None)
took, cpu = time.perf_counter() - t, time.process_time() - cpu
print(json.dumps({"seconds": took, "cpu": cpu, "images": pipe.report.total_images}))
"""

EDITOR = """
import json, sys, time
from pathlib import Path
import gradio as gr
from webui.app import build_app
ws, folder = Path(sys.argv[1]), sys.argv[2]
ctx = build_app(ws, start_scheduler=False).atelier
out = {}
t, c = time.perf_counter(), time.process_time()
note, _, _, _, tags = ctx.handlers["captions_show"](folder)
out["open"], out["open_cpu"] = time.perf_counter() - t, time.process_time() - c
name = sorted(p.name for p in Path(folder).glob("*.png"))[3]
times = []
gallery = gr.Gallery()
for k in range(5):
    t, c = time.perf_counter(), time.process_time()
    saved = ctx.handlers["captions_store"](folder, name, f"cat, bench {k}")
    gallery.postprocess(saved[1])  # what Gradio does with the grid before sending it (the tiles)
    times.append((time.perf_counter() - t, time.process_time() - c))
    assert saved[0].startswith("Saved"), saved[0]
out["save"], out["save_cpu"] = sorted(times)[len(times) // 2]
t, c = time.perf_counter(), time.process_time()
old, new = ("rare-0", "rare0") if "rare-0" in dict(tags) else ("rare0", "rare-0")  # back and forth per run
msg = ctx.handlers["captions_replace"](folder, old, new, False)[0]
out["replace"], out["replace_cpu"] = time.perf_counter() - t, time.process_time() - c
out["replace_msg"] = msg
print(json.dumps(out))
"""


def make_dataset(folder: Path, n: int) -> None:
    """N distinct PNGs with captions (skipped when the folder already holds them)."""
    from PIL import Image  # the bench's own dependency (the project's venv has Pillow)

    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.png"))) >= n:
        return
    for i in range(n):
        w, h = SHAPES[i % len(SHAPES)]
        shade = (i * 37 % 256, i // 256 % 256, i // 65536 % 256)
        img = Image.new("RGB", (w, h), shade)
        img.putpixel((i % w, (i // w) % h), (255 - shade[0], 255, 0))
        img.save(folder / f"img_{i:06d}.png", compress_level=1)
        tags = [TAGS[(i * k + 3) % len(TAGS)] for k in (1, 5, 7)]
        if i % 1000 == 0:
            tags.append(f"rare{i // 1000 % 2}")
        (folder / f"img_{i:06d}.txt").write_text(", ".join(dict.fromkeys(tags)) + "\n", encoding="utf-8")
    old = time.time() - 3600  # older than the scan index's "modified just now" window
    for p in folder.iterdir():
        os.utime(p, (old, old))


def write_config(ws: Path, folder: Path) -> Path:
    path = ws / "run.yaml"
    path.write_text(json.dumps({"base": "demo", "general": {"workspace": str(ws)},
                                "data": {"concepts": [{"path": str(folder)}], "resolution": "64",
                                         "bucket_step": 8}}), encoding="utf-8")
    return path


def child(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(base: Path, n: int) -> Dict[str, float]:
    ws = base / f"ws-{n}"
    folder = ws / "data"
    t = time.perf_counter()
    make_dataset(folder, n)
    made = time.perf_counter() - t
    cfg = write_config(ws, folder)
    shutil.rmtree(ws / "cache", ignore_errors=True)
    row: Dict[str, float] = {"images": n, "make": made}
    cold, warm = child(SCAN, str(cfg)), child(SCAN, str(cfg))
    row.update(cold_scan=cold["seconds"], warm_scan=warm["seconds"], warm_cpu=warm["cpu"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "trainer", "data-report", str(cfg)], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["data_report"] = time.perf_counter() - t
    row["report_cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    editor = child(EDITOR, str(ws), str(folder))
    row.update(open_folder=editor["open"], open_cpu=editor["open_cpu"], save_caption=editor["save"],
               save_cpu=editor["save_cpu"], replace_all=editor["replace"], replace_cpu=editor["replace_cpu"])
    return row


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000])
    ap.add_argument("--keep", type=Path, default=None, help="make the datasets here and keep them (reused)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = args.keep or Path(tempfile.mkdtemp(prefix="atelier-big-"))
    try:
        rows = [measure(base, n) for n in args.sizes]
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = ["images", "cold_scan", "warm_scan", "warm_cpu", "data_report", "report_cpu", "open_folder", "open_cpu",
            "save_caption", "save_cpu", "replace_all", "replace_cpu"]
    print(f"# {platform.node()} · {os.cpu_count()} CPUs · Python {platform.python_version()} (seconds)")
    print(" | ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>11.3f}" if c != "images" else f"{int(r[c]):>11d}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
