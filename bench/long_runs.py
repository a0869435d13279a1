#!/usr/bin/env python3
"""What a long run costs the page: the Run tab's change request and refresh, memory per run, building the page.

    .venv/bin/python bench/long_runs.py                        # 10k and 100k events
    .venv/bin/python bench/long_runs.py --events 10000 100000 500000 --json
    .venv/bin/python bench/long_runs.py --source workspace/runs/my-run   # another run's step lines
    .venv/bin/python bench/long_runs.py --no-summary           # runs without the trainer's summary (older runs)

Makes one synthetic run folder per size in a fresh workspace: the step lines of a real run (by default a short
demo run, trained here first, about half a minute on CPU) replicated and renumbered up to N step events, a sample
pair every 1,000 steps, a backup, and an "alive" trainer (a sleeping child whose command line names it), so the
page treats the run as active. Unless ``--no-summary``, the trainer's summary (``events.summary.json``) is left
beside the stream as the trainer leaves it. Then, in this process, as the served page does:

- page build: ``build_app`` on the workspace holding all the runs, and the Runs table a page load fills;
- first view: the first change request for a run (the UI just started, or the run was not looked at lately);
- change + refresh: one step line appended, then one change request (``watch_run``) and one refresh (``poll``),
  the median of ``--rounds``; with one open page on an active run the server pays this once a second, so the
  figure in ms is also about the % of one core each open page costs;
- memory per run: what the monitor keeps of the run after viewing it (tracemalloc, a fresh monitor).

Runs the code it is started from: ``PYTHONPATH=<another checkout>`` measures that one (the page's handlers are
the same) for a before/after table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
if "PYTHONPATH" not in os.environ:  # this checkout's code, unless PYTHONPATH names the code to measure
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from webui import runner  # noqa: E402
from webui.app import build_app  # noqa: E402
from webui.monitor import RunMonitor  # noqa: E402

ORDER = "newest first"


def demo_step_lines(workdir: Path) -> List[dict]:
    """The step events of a short real demo run (trained here, CPU, offline)."""
    ws = workdir / "demo-ws"
    run = ws / "runs" / "demo"
    cmd = [sys.executable, "-m", "trainer", "train", "--preset", "demo", "--set", f"general.workspace={ws}",
           "--set", "training.max_steps=20", "--run-dir", str(run), "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
    return step_lines(run)


def step_lines(run: Path) -> List[dict]:
    steps = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
             if line.strip() and json.loads(line).get("type") == "step"]
    if not steps:
        raise SystemExit(f"{run}: no step events to replicate")
    return steps


def make_run(ws: Path, name: str, n: int, template: List[dict], summary: bool) -> tuple[Path, bool]:
    """A run folder of ``n`` step events made of ``template``'s lines, renumbered; and whether the trainer's
    summary was left beside them."""
    run = ws / "runs" / name
    (run / "samples").mkdir(parents=True)
    (run / "backups" / f"step{n:06d}").mkdir(parents=True)
    t0 = time.time() - n * 0.05
    with open(run / "events.jsonl", "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "started", "time": t0, "total_steps": n * 2, "epochs": 1}) + "\n")
        for i in range(1, n + 1):
            ev = dict(template[(i - 1) % len(template)])
            ev.update(step=i, total_steps=n * 2, time=t0 + i * 0.05, eta_s=round(n * 0.05, 1))
            fh.write(json.dumps(ev) + "\n")
            if i % 1000 == 0:
                fh.write(json.dumps({"type": "sample", "step": i, "time": t0 + i * 0.05,
                                     "prompts": ["a red square", "a blue circle"],
                                     "paths": [str(run / "samples" / f"step{i:06d}-p{p}.png") for p in (0, 1)]})
                         + "\n")
                for p in (0, 1):
                    (run / "samples" / f"step{i:06d}-p{p}.png").write_bytes(b"png")
        fh.write(json.dumps({"type": "backup", "step": n, "path": str(run / "backups" / f"step{n:06d}"),
                             "time": t0 + n * 0.05}) + "\n")
    (run / "config.yaml").write_text("general:\n  run_name: " + name + "\n")
    (run / "train.log").write_text("step lines\n" * 200)
    if summary:
        try:
            from trainer.run_summary import SUMMARY, RunTail  # the trainer leaves one; an older checkout has none
        except ImportError:
            return run, False
        tail = RunTail(run / "events.jsonl")
        tail.catch_up()
        (run / SUMMARY).write_text(json.dumps(tail.summary()))
        return run, True
    return run, False


def make_alive(run: Path, started: float) -> subprocess.Popen:
    """A sleeping child the runner takes for the run's trainer (its command line names one)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "trainer-standin"])
    runner.write_json(run / runner.LAUNCH, {"pid": child.pid, "pgid": child.pid, "started": started, "cmd": []})
    return child


def append_step(run: Path, template: List[dict], step: int) -> None:
    ev = dict(template[step % len(template)])
    ev.update(step=step, time=time.time())
    with open(run / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(ev) + "\n")


def measure(ctx, run: Path, n: int, template: List[dict], rounds: int) -> Dict[str, float]:
    watch, poll = ctx.handlers["watch_run"], ctx.handlers["poll"]
    params = {"view": "run", "run": run.name, "order": ORDER}
    t = time.perf_counter()
    watch(params)
    first = time.perf_counter() - t
    seen = poll(run.name, ORDER, {})[-2]
    costs, changes = [], []
    for k in range(rounds):
        append_step(run, template, n + 1 + k)
        t = time.perf_counter()
        watch(params)
        changes.append(time.perf_counter() - t)
        seen = poll(run.name, ORDER, seen)[-2]
        costs.append(time.perf_counter() - t)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    monitor = RunMonitor()
    monitor.view(run)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del monitor
    return {"events": n, "file_mb": (run / "events.jsonl").stat().st_size / 2**20, "first_view_ms": first * 1e3,
            "change_ms": statistics.median(changes) * 1e3, "change_refresh_ms": statistics.median(costs) * 1e3,
            "memory_kb": kept / 1024}


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, nargs="+", default=[10_000, 100_000], help="step events per run")
    p.add_argument("--rounds", type=int, default=30, help="change + refresh rounds per run (the median is shown)")
    p.add_argument("--source", help="a run folder whose step lines to replicate (default: train a short demo)")
    p.add_argument("--no-summary", action="store_true", help="leave no trainer summary beside the streams")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    children = []
    with tempfile.TemporaryDirectory(prefix="atelier-long-runs-") as tmp:
        work = Path(tmp)
        template = step_lines(Path(args.source)) if args.source else demo_step_lines(work)
        ws = work / "ws"
        runs, summaries = [], []
        for n in args.events:
            run, written = make_run(ws, f"long-{n}", n, template, not args.no_summary)
            summaries.append(written)
            children.append(make_alive(run, time.time() - n * 0.05 - 1))
            runs.append((run, n))
        try:
            t = time.perf_counter()
            demo = build_app(ws, start_scheduler=False)
            build_s = time.perf_counter() - t
            ctx = demo.atelier
            refresh_runs = ctx.components["runs_refresh"][0]
            t = time.perf_counter()
            refresh_runs()
            table_s = time.perf_counter() - t
            t = time.perf_counter()
            refresh_runs()
            table_again_s = time.perf_counter() - t
            ctx.monitor = RunMonitor()  # the measures below start cold, as after a restart
            rows = [measure(ctx, run, n, template, args.rounds) for run, n in runs]
        finally:
            for child in children:
                child.kill()
                child.wait()
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "summary": all(summaries), "page_build_s": build_s, "runs_table_first_s": table_s,
              "runs_table_again_s": table_again_s, "runs": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['machine']}; trainer summary beside the streams: {'yes' if result['summary'] else 'no'}")
    print(f"page build with all runs: {build_s:.2f} s; Runs table on page load: {table_s * 1e3:.0f} ms first, "
          f"{table_again_s * 1e3:.0f} ms again")
    print(f"{'events':>8} {'file MB':>8} {'first view ms':>14} {'change ms':>10} {'change+refresh ms':>18} "
          f"{'memory/run KB':>14}")
    for r in rows:
        print(f"{r['events']:>8} {r['file_mb']:>8.1f} {r['first_view_ms']:>14.1f} {r['change_ms']:>10.2f} "
              f"{r['change_refresh_ms']:>18.2f} {r['memory_kb']:>14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
