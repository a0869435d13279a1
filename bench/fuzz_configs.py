"""Fuzzed configs against validate and train: every config of the generated corpus (``tests/config_fuzz.py``) is
validated in-process (a traceback is a bug: every bad input gets a message); with ``--train``, every config validate
passes is also trained (``python -m trainer train``, one process each, ``--timeout`` seconds; a run still going then
counts as started) and one that fails there is a "passes validate, fails in train" bug.

    python bench/fuzz_configs.py --n 200 --train --jobs 2 --out fuzz-out

Prints one line per finding and a summary; the configs and each run's log stay under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from config_fuzz import corpus  # noqa: E402
from trainer.__main__ import main as cli  # noqa: E402


def validate(path: Path) -> tuple:
    """("traceback", text) | ("refused", json) | ("passed", json)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli(["validate", str(path), "--json"])
    except SystemExit as exc:
        return "refused", f"exit {exc.code}"
    except BaseException:  # noqa: B902 - any escape is the finding
        return "traceback", traceback.format_exc()
    text = out.getvalue().strip()
    return ("passed" if rc == 0 else "refused"), text


def train(path: Path, run_dir: Path, timeout: float) -> tuple:
    """("ok"|"started"|"failed", log tail)."""
    cmd = [sys.executable, "-m", "trainer", "train", str(path), "--run-dir", str(run_dir), "--no-progress"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "started", ""
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-6:])
    return ("ok" if r.returncode == 0 else "failed"), tail


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fuzz-out")
    p.add_argument("--train", action="store_true")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(corpus(args.n, args.seed, out / "files")):
        path = out / f"{i:03d}.yaml"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    counts: dict = {}
    passed = []
    for path in paths:
        verdict, text = validate(path)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict == "traceback":
            print(f"TRACEBACK {path.name}: {text.strip().splitlines()[-1]}")
        elif verdict == "passed":
            passed.append(path)
    if args.train:
        def one(path: Path) -> tuple:
            return path, train(path, out / "runs" / path.stem, args.timeout)
        with ThreadPoolExecutor(args.jobs) as pool:
            for path, (verdict, tail) in pool.map(one, passed):
                counts[f"train {verdict}"] = counts.get(f"train {verdict}", 0) + 1
                if verdict == "failed":
                    print(f"TRAIN FAILED {path.name}: {tail}")
    print(json.dumps(counts))
    return 1 if counts.get("traceback") or counts.get("train failed") else 0


if __name__ == "__main__":
    sys.exit(main())
