#!/usr/bin/env python3
"""Run ``python -m trainer …`` on real-size models with random weights: nothing is downloaded or read.

    .venv/bin/python bench/random_weights.py train --preset flux-lora-24gb --set data.concepts.0.path=imgs
    .venv/bin/python bench/bench_train.py --random-weights --preset qwen-image-lora-24gb …   # the same, measured

Every model is built from its configs (the VRAM estimator's config-only loader, ``trainer.memory.estimate_session``,
on real tensors): a diffusers folder's own configs, or for a hub id or single file the family's shipped full-size
configs (``trainer/families/<family>/full_size.py``; the SD lineage's shipped configs). Everything after loading —
storage dtypes, fp8/NF4, offloading, caching, the step, sampling, saving — is the trainer's own code, so speed and
peak VRAM are what the real weights would give (the loss is meaningless). Needs the RAM of the
model in its storage dtype, as a real run does.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.memory import estimate_session  # noqa: E402


def main(argv: list) -> int:
    # random init on the GPU when there is one (torch's CPU RNG runs on one core); the weights then wait in CPU
    # RAM as a loaded file's would. ATELIER_INIT_DEVICE=cpu keeps it on the CPU.
    init_device = os.environ.get("ATELIER_INIT_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
    estimate_session.INIT_DEVICE = init_device
    sys.argv = ["python -m trainer", *argv]
    with estimate_session.session(fake=False):
        try:
            runpy.run_module("trainer", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
