#!/usr/bin/env python3
"""One checkpointed Flux.1 block, forward and backward, with plain gradient checkpointing and with
``training.checkpoint_keep_attention`` (trainer/memory/checkpointing.py): time per call, Python calls and attention
forwards.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_attention.py                     # 64 wide, 16 tokens: host time
    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_attention.py --dim 256 --tokens 4096

At the default tiny size the kernels cost next to nothing, so the time is the host's: what keeping the attention adds
to each checkpointed block (a dispatch mode that runs Python for every op of the block's forward and recomputation).
At a long sequence the attention forward that backward no longer recomputes is the saving (on a GPU it grows with
the square of the tokens: a 1024 px Flux step has 4608 per block, a Wan clip tens of thousands). Python calls
(``sys.setprofile``'s 'call' events) and attention forwards are counted per call; they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("trainer") is None:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from diffusers.models.transformers.transformer_flux import (  # noqa: E402
    FluxSingleTransformerBlock, FluxTransformerBlock)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trainer.memory.checkpointing import ATTENTION_OPS, checkpointed  # noqa: E402


class AttentionCalls(TorchDispatchMode):
    """Counts the attention forwards (the ops a kept-attention checkpoint saves) run while it is active."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forwards += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def blocks(dim: int, heads: int, tokens: int, text: int, dtype: torch.dtype):
    """(name, step(keep)) for a double and a single Flux block, each with a trainable q projection (a LoRA's place)."""
    torch.manual_seed(0)
    double = FluxTransformerBlock(dim, heads, dim // heads).to(dtype).requires_grad_(False)
    single = FluxSingleTransformerBlock(dim, heads, dim // heads).to(dtype).requires_grad_(False)
    for b in (double, single):
        b.attn.to_q.weight.requires_grad_(True)
    x = torch.randn(1, tokens, dim, dtype=dtype, requires_grad=True)
    ctx = torch.randn(1, text, dim, dtype=dtype)
    temb = torch.randn(1, dim, dtype=dtype)

    def run_double(keep):
        ctx_out, out = checkpointed(double, x, ctx, temb, keep_attention=keep)
        (out.float().sum() + ctx_out.float().sum()).backward()

    def run_single(keep):
        ctx_out, out = checkpointed(single, x, ctx, temb, keep_attention=keep)
        (out.float().sum() + ctx_out.float().sum()).backward()

    return [("FluxTransformerBlock", run_double), ("FluxSingleTransformerBlock", run_single)]


def measure(step, keep: bool, repeats: int) -> dict:
    for _ in range(3):
        step(keep)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step(keep)
        times.append(time.perf_counter() - t)
    calls = [0]

    def prof(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(prof)
    try:
        step(keep)
    finally:
        sys.setprofile(None)
    mode = AttentionCalls()
    with mode:
        step(keep)
    return {"us": statistics.median(times) * 1e6, "python_calls": calls[0], "attention_forwards": mode.forwards}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="image tokens (text: 8 more)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), bf16, dim {args.dim}, "
          f"{args.heads} heads, {args.tokens} + 8 tokens; forward + backward of one checkpointed block\n")
    print("| block | checkpointing | µs per call | Python calls | attention forwards |")
    print("|---|---|---|---|---|")
    for name, step in blocks(args.dim, args.heads, args.tokens, 8, torch.bfloat16):
        for keep in (False, True):
            r = measure(step, keep, args.repeats)
            print(f"| {name} | {'keep attention' if keep else 'plain'} | {r['us']:.0f} | {r['python_calls']} | "
                  f"{r['attention_forwards']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
