#!/usr/bin/env python3
"""Relative error of frozen weights stored in fp8 (``‖q − w‖ / ‖w‖``): rounded as they are (``parts.denoiser.fp8``),
with a scale per output row (``fp8_scaled``) and per block of inputs (``fp8_scale_block``), through the trainer's own
storage (trainer/memory/precision.py). Two sweeps on random normal weights: the weights' size (small weights fall
among fp8's subnormals unscaled), and a few outlier inputs N times larger than the rest of their rows (the error of
the whole weight / of the blocks without an outlier). Deterministic: fp8 rounding is exact, the weights seeded.

    OMP_NUM_THREADS=1 .venv/bin/python bench/fp8_weight_error.py [--rows 256] [--inputs 3072] [--block 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("trainer") is None:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.memory.precision import enable_fp8_storage  # noqa: E402


def errors(weight: torch.Tensor, block: int, clean: slice) -> list:
    """The relative errors (whole weight, and the columns ``clean``) of plain, per-row and per-block storage."""
    out = []
    for kwargs in ({}, {"scaled": True}, {"scaled": True, "block": block}):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
        layer.weight.data = weight.clone()
        enable_fp8_storage(torch.nn.Sequential(layer), torch.float32, skip=(), **kwargs)
        diff = layer.dequantize() - weight
        out.append((float(diff.norm() / weight.norm()), float(diff[:, clean].norm() / weight[:, clean].norm())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=3072)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args(argv)
    pct = lambda e: f"{100 * e:.2f} %"  # noqa: E731
    print(f"| weight std | plain | per row | per block of {args.block} |\n|---|---|---|---|")
    for std in (0.05, 0.02, 0.01, 0.005):
        w = torch.randn(args.rows, args.inputs, generator=torch.Generator().manual_seed(0)) * std
        print(f"| {std} | " + " | ".join(pct(whole) for whole, _ in errors(w, args.block, slice(None))) + " |")
    print(f"\n| outliers × (std 0.02) | plain | per row | per block of {args.block} |\n|---|---|---|---|")
    for factor in (1, 30, 300, 3000, 30000):
        w = torch.randn(args.rows, args.inputs, generator=torch.Generator().manual_seed(0)) * 0.02
        w[:, :4] *= factor  # four inputs, all in the first block
        cells = errors(w, args.block, slice(args.block, None))
        print(f"| {factor} | " + " | ".join(f"{pct(a)} / {pct(b)}" for a, b in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
