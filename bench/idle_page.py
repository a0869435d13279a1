#!/usr/bin/env python3
"""What an open page costs while nothing trains: CPU of the UI server and of the browser, in % of one core.

    .venv/bin/python bench/idle_page.py                  # 30 s measured after 10 s to settle
    .venv/bin/python bench/idle_page.py --seconds 60 --json
    .venv/bin/python bench/idle_page.py --tab Run         # with the Run tab shown
    .venv/bin/python bench/idle_page.py --live            # while the demo trains, shown live on the Runs tab

Starts the web UI (``python -m webui``) on a fresh workspace in a child process, opens the page in headless
Chromium (Playwright driving the system's chromium, as the browser tests do), lets it settle, then reads
the CPU time (user + system, from /proc, Linux only) the server and all browser processes used over the
window. The page polls the run folder (Run tab, once a second) and the queue (every 2 s); this is what
that costs. Goal (the newcomer-page issue): under 2 % of a core each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, List

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("ATELIER_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> List[int]:
    children: dict = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def total(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo(page) -> None:
    """Pick the demo preset, make it long, Start it, and wait until the live status shows it training."""
    page.locator("#preset-select input").click()
    page.get_by_role("option", name="demo", exact=True).click()
    page.wait_for_function("document.querySelector('#form-messages').innerText.includes('demo')", timeout=30000)
    page.get_by_role("tab", name="Training", exact=True).click()
    box = page.locator("#cfg-training-max-steps input[type=number]")
    box.fill("100000")
    box.press("Tab")
    page.locator("#start-btn").click()
    page.wait_for_function("(() => { const s = document.querySelector('#run-status .atl-status');"
                           " return s && s.dataset.state === 'running' && Number(s.dataset.step) >= 2; })()",
                           timeout=180000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after the page loaded, not measured")
    ap.add_argument("--tab", default="", help="click this tab (e.g. Run) before settling; default: the landing tab")
    ap.add_argument("--live", action="store_true",
                    help="start the demo preset (100000 steps) from the page first and measure while it trains and "
                         "the page shows it live (the trainer's own CPU is not counted)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="atelier-idle-") as ws:
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONPATH=str(ROOT))
        server = subprocess.Popen([sys.executable, "-m", "webui", "--port", str(port), "--workspace", ws],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                end = time.time() + 120
                while True:
                    try:
                        page.goto(f"http://127.0.0.1:{port}/")
                        page.wait_for_selector("#start-btn", timeout=60000)
                        break
                    except Exception:
                        if time.time() > end:
                            raise
                        time.sleep(1)
                if a.live:
                    start_demo(page)
                if a.tab:
                    page.get_by_role("tab", name=a.tab, exact=True).click()
                time.sleep(a.settle)
                browser_pids = [q for q in descendants(os.getpid()) if q not in descendants(server.pid)
                                and q != os.getpid()]
                s0, b0, t0 = cpu_seconds(server.pid), total(browser_pids), time.time()
                time.sleep(a.seconds)
                s1, b1, t1 = cpu_seconds(server.pid), total(browser_pids), time.time()
                browser.close()
        finally:
            for q in descendants(server.pid)[1:]:  # the demo run the page started
                with contextlib.suppress(OSError):
                    os.kill(q, signal.SIGKILL)
            server.terminate()
            server.wait(timeout=30)
    wall = t1 - t0
    result = {"tab": ("live run, " if a.live else "") + (a.tab or "landing"), "server_pct_of_a_core": round(100 * (s1 - s0) / wall, 2),
              "browser_pct_of_a_core": round(100 * (b1 - b0) / wall, 2), "window_s": round(wall, 1),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"idle page ({result['tab']} tab): server {result['server_pct_of_a_core']} % of a core, browser "
              f"{result['browser_pct_of_a_core']} % of a core ({result['window_s']} s window)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
