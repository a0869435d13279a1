"""The VRAM estimate shown before Start: the trainer's own estimator (``python -m trainer estimate-vram``) run on
the form's config in a subprocess, so the UI process never imports torch.

The estimator builds the real, full-size model from its config under fake tensors (no weights, no GPU) and
runs the trainer's code on it; an SDXL config takes from under a minute to a few on a CPU, by its speed. It says
how much the run needs at its peak and whether that fits the card asked about (the first GPU nvidia-smi lists, or
a size the user types), and what to change when it does not. The peak does not depend on the card: the page keeps
the last estimates by config, so trying another card size answers at once.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections import OrderedDict
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

from webui import runner

TIMEOUT_S = 600
KEEP = 8  # estimates kept (by config text)
_kept: "OrderedDict[str, dict]" = OrderedDict()
_kept_lock = threading.Lock()

SAVINGS = ("turn on training.gradient_checkpointing (every block: training.gradient_checkpointing_interval 1, "
           "training.checkpoint_keep_attention off)", "store the frozen denoiser in fp8 (parts.denoiser.fp8, LoRA)",
           "lower training.batch_size or data.resolution", "use bf16 weights (parts.<part>.dtype) and bf16 mixed "
           "precision", "an 8-bit optimizer (adamw8bit) or Adafactor", "cache the text encoders' outputs "
           "(data.cache_text) so they leave the GPU")


def estimate(config_yaml: str, card_gib: Optional[float], timeout: float = TIMEOUT_S,
             python: str = sys.executable) -> dict:
    """The estimator's JSON for this config (``total_gib``/``phases``…) with ``fits``/``margin_gib`` for
    ``card_gib``, or ``{"error": message}``. A config estimated before is answered from memory."""
    with _kept_lock:
        result = _kept.get(config_yaml)
        if result is not None:
            _kept.move_to_end(config_yaml)
    if result is None:
        result = run_estimator(config_yaml, timeout, python)
        if "error" not in result:
            with _kept_lock:
                _kept[config_yaml] = result
                while len(_kept) > KEEP:
                    _kept.popitem(last=False)
    return for_card(result, card_gib)


def for_card(result: dict, card_gib: Optional[float]) -> dict:
    """``result`` judged against a card of ``card_gib`` GiB (as the estimator's ``--card-gib`` does)."""
    if "error" in result or "total_gib" not in result:
        return result
    margin = None if not card_gib else round(float(card_gib) - float(result["total_gib"]), 3)
    return {**result, "card_gib": card_gib or None, "margin_gib": margin, "fits": None if margin is None else margin >= 0}


def run_estimator(config_yaml: str, timeout: float = TIMEOUT_S, python: str = sys.executable) -> Dict:
    """``python -m trainer estimate-vram CONFIG --json`` in a subprocess: its JSON, or ``{"error": message}``."""
    with tempfile.TemporaryDirectory(prefix="atelier-vram-") as tmp:
        cfg_path = Path(tmp) / "config.yaml"
        cfg_path.write_text(config_yaml, encoding="utf-8")
        cmd = [python, "-m", "trainer", "estimate-vram", str(cfg_path), "--json", "--workspace", tmp]
        env = runner.child_env(HF_HUB_OFFLINE="1")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=runner.REPO_ROOT, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"the estimate took longer than {timeout:.0f} s"}
        except OSError as exc:
            return {"error": f"could not start the estimator: {exc}"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    lines = [ln for ln in (out.stderr or out.stdout).strip().splitlines() if ln.strip()]
    return {"error": lines[-1] if lines else f"the estimator exited with code {out.returncode}"}


def describe(result: dict, card_gib: Optional[float]) -> str:
    """Markdown for the page: the peak, its parts, fits or not, and what to change."""
    if "error" in result:
        return (f"Warning: No estimate for this config: {result['error']}\n\nThe estimator builds the model from its "
                "shipped configuration; families it cannot build yet get no estimate (the run itself is not affected).")
    peak = result.get("phases", {}).get(result.get("peak_phase", ""), {})
    parts = ", ".join(f"{k} {v:.2f}" for k, v in peak.items() if k != "total" and v >= 0.005)
    text = (f"**Estimated peak: {result['total_gib']:.2f} GiB** during *{result.get('peak_phase', '?')}* "
            f"(tensors {result.get('tracked_peak_gib', 0):.2f} GiB: {parts or '—'}; plus "
            f"{result.get('context_gib', 0):.2f} GiB CUDA context and {100 * result.get('fragmentation', 0):.0f} % "
            "for the allocator).")
    if not card_gib:
        return text + "\n\nGive a card size to check whether it fits."
    if result.get("fits"):
        return f"OK: {text}\n\nFits a {card_gib:g} GiB card with {result.get('margin_gib', 0):.2f} GiB to spare."
    short = -result.get('margin_gib', 0)
    return (f"Error: {text}\n\nDoes **not** fit a {card_gib:g} GiB card (short by {short:.2f} GiB). "
            "To need less: " + "; ".join(SAVINGS) + ".")


__all__ = ["describe", "estimate", "for_card", "run_estimator"]
