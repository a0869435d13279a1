#!/usr/bin/env python3
"""How long the page's slow clicks take to answer: load a preset, Check settings, Add to queue, open Runs.

    .venv/bin/python bench/page_clicks.py                 # 3 rounds, 12 finished runs in the workspace
    .venv/bin/python bench/page_clicks.py --rounds 5 --runs 40 --json

Serves the page (``build_app`` + ``serve``, in this process, as the browser tests do) on a fresh workspace that
holds ``--runs`` finished runs of 300 steps each, opens it in headless Chromium (Playwright driving the system's
chromium, 1440x900), then times each click from the browser's click event to the moment its answer is on the page
(timed inside the page: a 20 ms poll stamps the first moment the answer shows), and prints the median of the
rounds. What "the answer" is:

- load a preset: the message line names the preset just picked (the rounds alternate two presets);
- Check settings: the message line says the settings look good (it said "Loaded preset …" before);
- Add to queue: the message line names the job's new place in the queue (each round adds one more job; the queue
  scheduler is not started, so nothing trains while the page is measured);
- open Runs: the history table lists a run that was written after the tab was last opened (Train is shown in
  between), i.e. the tab's refresh of the table has come back.

A click over 1 s must show progress (the issue's rule); the table says which clicks show Gradio's progress on
their message line.

Wall times on a shared machine follow its load; the CPU seconds are steadier: the first page load's (from
``goto`` to the tab bar, then 2 s of its load events), and the whole bench's, of the browser (every Chromium
process) and of this process (the page's server and the driver), read from /proc (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from webui.app import build_app, serve  # noqa: E402  (the checkout this script is in, not an installed copy)

CHROMIUM = os.environ.get("ATELIER_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
PRESETS = ("demo", "demo-sdxl")

# stamps the last click of the user (capture phase: before any handler of the page); the page's own clicks on its
# hidden refresh buttons (webui/changes.py) are not trusted events and are left out
CLICK_STAMP = ("document.addEventListener('click', (e) => { if (e.isTrusted) window.__clicked = performance.now(); },"
               " true);")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_run(ws: Path, name: str, steps: int = 300) -> Path:
    """A finished run folder: config, and a stream of ``steps`` step events with loss and learning rate."""
    run = ws / "runs" / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  path: builtin:tiny-sd\n", encoding="utf-8")
    t = time.time() - steps
    lines = [{"type": "started", "time": t, "total_steps": steps}]
    lines += [{"type": "step", "step": i, "total_steps": steps, "epoch": 0, "loss": 0.4 + 0.1 / i, "time": t + i,
               "lr": {"unet": 1e-4, "text_encoder": 5e-5}} for i in range(1, steps + 1)]
    lines.append({"type": "finished", "time": t + steps + 1, "step": steps})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines), encoding="utf-8")
    return run


def timed(page, click: Callable[[], None], answered_js: str, timeout_s: float = 60.0) -> float:
    """Seconds from the page's click event to the first moment ``answered_js`` (an expression) is true."""
    page.evaluate("window.__clicked = null; window.__answered = null;")
    click()
    page.wait_for_function(f"(() => {{ if (window.__answered === null && ({answered_js}))"
                           " window.__answered = performance.now(); return window.__answered !== null; })()",
                           polling=20, timeout=timeout_s * 1000)
    return (page.evaluate("window.__answered - window.__clicked")) / 1000.0


def messages_js(*needles: str) -> str:
    text = "(document.querySelector('#form-messages') || {innerText: ''}).innerText"
    return " && ".join(f"{text}.includes({json.dumps(n)})" for n in needles)


def cpu_s() -> Dict[str, float]:
    """CPU seconds so far of this process and of the browser (every Chromium process below this one)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, used, name = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        pid = int(entry)
        parent[pid], used[pid], name[pid] = int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, comm
    mine, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid and p not in mine]
        mine.update(kids)
        todo += kids
    own = os.times()
    return {"server": own.user + own.system,
            "browser": sum(used[p] for p in mine if "chrom" in name[p].lower())}


def pick_preset(page, name: str) -> None:
    page.locator("#preset-select input").click()
    page.get_by_role("option", name=name, exact=True).click()


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=12, help="finished runs in the workspace (the Runs table's rows)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from playwright.sync_api import sync_playwright

    cpu: Dict[str, Dict[str, float]] = {}
    times: Dict[str, List[float]] = {"load a preset": [], "Check settings": [], "Add to queue": [], "open Runs": []}
    with tempfile.TemporaryDirectory(prefix="atelier-clicks-") as tmp:
        ws = Path(tmp) / "ws"
        for i in range(a.runs):
            write_run(ws, f"run-{i:03d}")
        demo = build_app(ws, start_scheduler=False)
        _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.add_init_script(CLICK_STAMP)
                before, t = cpu_s(), time.perf_counter()
                page.goto(url)
                page.wait_for_selector("#main-tabs [role=tab]", timeout=120000)
                load_s = time.perf_counter() - t
                time.sleep(2.0)  # the page's load events settle
                after = cpu_s()
                cpu["page load"] = {k: after[k] - before[k] for k in after}
                for r in range(a.rounds):
                    preset = PRESETS[r % 2]
                    times["load a preset"].append(timed(
                        page, lambda: pick_preset(page, preset), messages_js(f"Loaded preset **{preset}**"
                                                                             .replace("**", ""))))
                    times["Check settings"].append(timed(
                        page, lambda: page.locator("#validate-btn").click(), messages_js("Settings look good")))
                    times["Add to queue"].append(timed(
                        page, lambda: page.locator("#enqueue-btn").click(), messages_js(f"position {r + 1}")))
                    write_run(ws, f"new-{r}")
                    times["open Runs"].append(timed(
                        page, lambda: page.get_by_role("tab", name="Runs", exact=True).click(),
                        "(() => { const t = document.querySelector('#runs-table');"
                        f" return !!t && t.offsetParent !== null && t.innerText.includes('new-{r}'); }})()"))
                    page.get_by_role("tab", name="Train", exact=True).click()
                    time.sleep(1.0)
                end = cpu_s()
                cpu["clicks"] = {k: end[k] - after[k] for k in end}
                browser.close()
        finally:
            demo.atelier.manager.shutdown()
            demo.close()
    result = {"median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
              "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
              "page_load_s": round(load_s, 3),
              "cpu_s": {k: {w: round(x, 2) for w, x in v.items()} for k, v in cpu.items()},
              "runs": a.runs, "rounds": a.rounds,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
              "load_average_1min": round(os.getloadavg()[0], 2)}  # other work on the box slows every click
    if a.json:
        print(json.dumps(result))
    else:
        print(f"page clicks ({a.runs} runs in the workspace, median of {a.rounds}; {result['machine']}, "
              f"load average {result['load_average_1min']}):")
        for k, v in result["median_s"].items():
            print(f"  {k:<16} {v:6.2f} s   (each: {', '.join(f'{x:.2f}' for x in result['all_s'][k])})")
        print(f"  first page load  {result['page_load_s']:6.2f} s to the tab bar")
        for k, v in result["cpu_s"].items():
            print(f"  CPU, {k:<11} browser {v['browser']:.2f} s, server (and driver) {v['server']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
