"""Time an optimizer's step alone: prodigyopt's Prodigy against Atelier's (trainer/optim/prodigy.py), transformers'
Adafactor (adaptive mode) against Atelier's (trainer/optim/adafactor.py), and torch's fused AdamW, on the weights of
an SD 1.5-sized LoRA (256 tensors of rank 16), each with a gradient.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_step.py [--device cuda] [--steps 20]

On a GPU the time includes waiting for the step's kernels (synchronize after the steps); prodigyopt's two
``.item()`` per weight and transformers' Adafactor's one read per weight wait inside the step. Numbers go to
docs/performance.md with the machine's name.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prodigyopt import Prodigy as ProdigyOpt  # noqa: E402
from transformers.optimization import Adafactor as TransformersAdafactor  # noqa: E402

from trainer.optim.adafactor import Adafactor  # noqa: E402
from trainer.optim.prodigy import Prodigy  # noqa: E402


def lora_weights(device: str):
    """A and B of 128 SD 1.5 attention layers at rank 16 (320-1280 wide; 320 for all here)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 320), (320, 16)] * 128
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.01).to(device)) for s in shapes]


def time_steps(make, device: str, steps: int) -> float:
    params = lora_weights(device)
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(3):  # state made, warm
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    fused = args.device == "cuda"
    cases = {"prodigyopt Prodigy": lambda ps: ProdigyOpt(ps, lr=1.0),
             "Atelier Prodigy (trainer/optim/prodigy.py)": lambda ps: Prodigy(ps, lr=1.0),
             "transformers Adafactor (adaptive)": lambda ps: TransformersAdafactor(ps, lr=None),
             "Atelier Adafactor (trainer/optim/adafactor.py)": lambda ps: Adafactor(ps, lr=None),
             f"torch AdamW ({'fused' if fused else 'foreach'})": lambda ps: torch.optim.AdamW(
                 ps, lr=1e-4, fused=fused or None)}
    print(f"| optimizer step, 256 LoRA weights, {args.device} | ms a step |")
    print("|---|---|")
    for name, make in cases.items():
        print(f"| {name} | {time_steps(make, args.device, args.steps):.2f} |")


if __name__ == "__main__":
    main()
