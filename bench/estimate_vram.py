#!/usr/bin/env python3
"""Estimate the peak GPU memory of a preset's training without a GPU and without weights: the same command as
``python -m trainer estimate-vram`` (the estimator is ``trainer/memory/estimate.py``; its docstring says how).

    .venv/bin/python bench/estimate_vram.py --preset sdxl-lora-8gb
    .venv/bin/python bench/estimate_vram.py --preset sdxl-lora-12gb --set training.batch_size=2
    .venv/bin/python bench/estimate_vram.py --all-memory-presets            # every *-8gb/-12gb/-16gb preset
    .venv/bin/python bench/estimate_vram.py --all-memory-presets --json     # one JSON object per preset

Exit status: 0 when every estimate fits its card (or names none), 1 otherwise, 2 for a config error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.memory.estimate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
