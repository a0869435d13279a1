#!/usr/bin/env python3
"""Host work of one forward and backward of a Linear whose frozen weight is stored in fp8 (``parts.denoiser.fp8``)
or NF4: the trainer's way (trainer/memory/precision.py ``_StoredLinear``: the upcast made in forward and again in
backward, nothing else kept) against the way before it (a non-reentrant checkpoint around the upcast and the op) and
a plain bf16 Linear.

    OMP_NUM_THREADS=1 .venv/bin/python bench/stored_linear.py                # 8×8 weights: host time alone
    OMP_NUM_THREADS=1 .venv/bin/python bench/stored_linear.py --side 3072 --tokens 64

At 8×8 the kernels cost next to nothing, so the time per call is the host's: what each way adds to every stored
layer of a step (a Flux.1 transformer has ~500, run twice per step with gradient checkpointing). Python calls
(``sys.setprofile``'s 'call' events) and aten ops are counted per call; they do not depend on the machine.
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
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from trainer.memory.precision import fp8_weight, store_fp8  # noqa: E402


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def layers(side: int, dtype):
    """(name, forward) of the three ways, each a Linear(side, side) with a frozen weight and bias."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(side, side).to(dtype).requires_grad_(False)
    stored = torch.nn.Linear(side, side).to(dtype).requires_grad_(False)
    scale = stored.weight.float().abs().amax(dim=1) / 448.0
    store_fp8(stored, (stored.weight.float() / scale[:, None]).to(torch.float8_e4m3fn), scale, dtype)

    def before(x):  # the checkpoint the trainer used until _StoredLinear
        def run(x):
            return F.linear(x, fp8_weight(stored, dtype), stored.bias.to(dtype))
        return checkpoint(run, x, use_reentrant=False, preserve_rng_state=False)

    return [("bf16 Linear", plain), ("fp8, checkpoint (before)", before), ("fp8, _StoredLinear (now)", stored)]


def python_calls(fn) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", type=int, default=8, help="the Linear's in and out features")
    ap.add_argument("--tokens", type=int, default=2, help="rows of the input")
    ap.add_argument("--calls", type=int, default=2000, help="timed forward+backward calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    x = torch.randn(args.tokens, args.side, dtype=dtype, requires_grad=True)
    print(f"torch {torch.__version__}; Linear({args.side}, {args.side}), {args.tokens} rows, bf16; "
          f"median of {args.rounds} rounds of {args.calls} calls")
    print("| way | µs per forward+backward | Python calls | aten ops |")
    print("|---|---|---|---|")
    for name, layer in layers(args.side, dtype):
        def once():
            layer(x).sum().backward()
        for _ in range(20):
            once()
        per = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(args.calls):
                once()
            per.append((time.perf_counter() - t) / args.calls * 1e6)
        calls = python_calls(once)
        with _Ops() as ops:
            once()
        print(f"| {name} | {statistics.median(per):.1f} | {calls} | {ops.n} |")


if __name__ == "__main__":
    main()
