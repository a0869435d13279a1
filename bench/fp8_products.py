#!/usr/bin/env python3
"""One frozen Linear of Flux.1's sizes, forward and forward+backward (the input's gradient, as a LoRA step needs
it), five ways: the weight in bf16; stored in fp8 and upcast for each product (``parts.denoiser.fp8``), and the same
with a scale per output row (``parts.denoiser.fp8_scaled``: the upcast multiplies by it); stored in fp8 and
multiplied on the fp8 tensor cores (``parts.denoiser.fp8_matmul``, trainer/memory/fp8_matmul.py), unscaled and
scaled (the row scale on the product's columns); eager and, with ``--compiled``, through torch.compile (which fuses
the input's scaling and cast).

    .venv/bin/python bench/fp8_products.py                      # on a GPU: Flux.1's layer sizes, 4608 tokens
    .venv/bin/python bench/fp8_products.py --compiled
    OMP_NUM_THREADS=1 .venv/bin/python bench/fp8_products.py --tiny   # any machine: checks the script

Times are CUDA events around 20 calls after 5 warm-up ones (the median of 5 rounds); TFLOP/s counts the products'
2·tokens·in·out (forward) and twice that (forward and the input's gradient). On the CPU the times mean nothing
(``torch._scaled_mm`` runs there without fp8 arithmetic); ``--tiny`` only checks that every row runs.
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

from trainer.memory.precision import quantise_with_scale, row_scale, store_fp8  # noqa: E402

# Flux.1 [dev]'s Linear sizes (in, out): attention projections, the double blocks' MLP up and down, the single
# blocks' fused input (q, k, v and the MLP's up) and output
FLUX = [(3072, 3072), (3072, 12288), (12288, 3072), (3072, 21504), (15360, 3072)]


def layer(k: int, n: int, way: str, device, dtype=torch.bfloat16) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, device=device, dtype=dtype).requires_grad_(False)
    if way != "bf16":
        scale = row_scale(lin.weight.data) if way.endswith("scaled") else None
        store_fp8(lin, quantise_with_scale(lin.weight.data, scale), scale, dtype, matmul=way.startswith("fp8 products"))
    return lin


def timed(fn, device, calls: int, rounds: int) -> float:
    """Median milliseconds per call."""
    for _ in range(5):
        fn()
    per = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            per.append(start.elapsed_time(end) / calls)
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t) * 1e3 / calls)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4608, help="rows of the input (1024 px Flux.1: 4096 + 512)")
    ap.add_argument("--compiled", action="store_true", help="each way through torch.compile as well")
    ap.add_argument("--tiny", action="store_true", help="64-wide layers and 32 tokens: checks the script anywhere")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [(64, 64), (64, 128)] if args.tiny else FLUX
    tokens = 32 if args.tiny else args.tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}; torch {torch.__version__}; {tokens} tokens, bf16; ms per call, median of {args.rounds} rounds "
          f"of {args.calls}")
    print("| in → out | way | forward ms | forward+backward ms | forward TFLOP/s | vs bf16 (fwd+bwd) |")
    print("|---|---|---|---|---|---|")
    ways = ["bf16", "fp8 storage", "fp8 storage, scaled", "fp8 products", "fp8 products, scaled"]
    for k, n in sizes:
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        xg = x.clone().requires_grad_(True)
        g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
        base = None
        for compiled in ([False, True] if args.compiled else [False]):
            for way in ways:
                lin = layer(k, n, way, device)
                run = torch.compile(lin) if compiled else lin

                def fwd():
                    with torch.no_grad():
                        run(x)

                def both():
                    torch.autograd.grad(run(xg), xg, g)

                f, b = timed(fwd, device, args.calls, args.rounds), timed(both, device, args.calls, args.rounds)
                if way == "bf16" and not compiled:
                    base = b
                label = way + (", compiled" if compiled else "")
                print(f"| {k} → {n} | {label} | {f:.3f} | {b:.3f} | {2 * tokens * k * n / f / 1e9:.0f} | "
                      f"{base / b:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
