#!/usr/bin/env python3
"""Compiled Flux.1 blocks with gradient checkpointing under a torch.compile mode, against eager: does the step run,
do the losses agree, how fast is it, how much memory. For the GPU question ``training.compile_mode`` leaves open:
``reduce-overhead`` (CUDA graphs) is refused with gradient checkpointing, because a compiled block *inside* an
activation checkpoint fails under CUDA graph trees (PyTorch issue 154306); the trainer now runs the checkpoint
inside the compiled region (``trainer.memory.checkpointing.compile_checkpointed``), which may lift that.

    .venv/bin/python bench/cudagraph_checkpoint.py --mode reduce-overhead           # on a GPU: real-width blocks
    OMP_NUM_THREADS=1 .venv/bin/python bench/cudagraph_checkpoint.py --tiny         # CPU dry run (mode default)

It uses the trainer's own pieces on a stack of Flux.1 double and single blocks with random weights (bf16, frozen,
peft LoRA rank 16 on the attention projections, AdamW): ``compile_blocks`` (in-place regional compile plus the
compiled checkpoint) and ``checkpointed`` (what diffusers calls for each block when checkpointing is on). Prints one
JSON line per run: eager, then compiled; the compiled run's losses against eager's (compiled kernels round
differently: close, not equal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def build(width: int, heads: int, doubles: int, singles: int, device: str):
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
    from peft import LoraConfig, inject_adapter_in_model
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.doubles = torch.nn.ModuleList([FluxTransformerBlock(width, heads, width // heads) for _ in range(doubles)])
    model.singles = torch.nn.ModuleList([FluxSingleTransformerBlock(width, heads, width // heads)
                                         for _ in range(singles)])
    model.requires_grad_(False)
    for p in model.parameters():  # small weights: a stack of random blocks stays finite
        p.data.mul_(0.2)
    model.to(device, torch.bfloat16)
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                       "add_k_proj", "add_v_proj", "to_add_out"]), model)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    return model


def run(args, compiled: bool, outside: bool = False) -> dict:
    from trainer.memory import checkpointing
    from trainer.memory.checkpointing import checkpointed
    from trainer.train.compile import compile_blocks
    device = args.device
    width, heads = (64, 2) if args.tiny else (3072, 24)
    tokens, text = (48, 8) if args.tiny else (args.tokens, 512)
    model = build(width, heads, args.doubles, args.singles, device)
    if compiled:
        torch._dynamo.reset()
        compile_blocks(model, args.mode if device == "cuda" else "default")
        if outside:  # the arrangement before: each block's compiled call inside an eager checkpoint
            checkpointing._COMPILED.clear()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    gen = torch.Generator(device).manual_seed(1)
    head_dim = width // heads
    rope = (torch.ones(tokens + text, head_dim, device=device), torch.zeros(tokens + text, head_dim, device=device))
    losses, times = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        start = time.perf_counter()
        x = torch.randn(1, tokens, width, device=device, generator=gen)
        ctx = torch.randn(1, text, width, device=device, generator=gen)
        temb = torch.randn(1, width, device=device, generator=gen)
        with torch.autocast(device, torch.bfloat16):
            for block in model.doubles:
                ctx, x = checkpointed(block, x, ctx, temb, image_rotary_emb=rope)
            for block in model.singles:
                ctx, x = checkpointed(block, x, ctx, temb, image_rotary_emb=rope)
            loss = x.float().square().mean() + ctx.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a sync: the step's time is the step's
        times.append(time.perf_counter() - start)
    steady = times[args.warmup:]
    return {"compiled": compiled, "mode": (args.mode if device == "cuda" else "default") if compiled else "eager",
            "checkpoint": ("around the compiled block" if outside else "inside the compiled region") if compiled
            else "eager",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "blocks": [args.doubles, args.singles], "width": width, "tokens": tokens + text,
            "first_step_s": round(times[0], 2),
            "steady_step_ms": round(1e3 * sum(steady) / max(len(steady), 1), 2),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if device == "cuda" else None,
            "losses": [round(v, 6) for v in losses]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="reduce-overhead",
                    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="64-wide blocks (a CPU dry run)")
    ap.add_argument("--doubles", type=int, default=4)
    ap.add_argument("--singles", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="image tokens (4096: 1024 px)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--outside", action="store_true",
                    help="also run the arrangement before (the checkpoint around each compiled block; in the default "
                         "mode only, CUDA graphs fail there)")
    args = ap.parse_args()
    if args.device == "cuda":  # as the trainer does on CUDA (trainer/train/setup.py): cuDNN's SDPA fails in this
        torch.backends.cuda.enable_cudnn_sdp(False)  # backward at 1024 px on Hopper (an illegal memory access)
    eager = run(args, compiled=False)
    print(json.dumps(eager), flush=True)
    failed = 0
    for outside in ([False, True] if args.outside else [False]):
        if outside and args.device == "cuda" and args.mode in ("reduce-overhead", "max-autotune"):
            continue
        try:
            compiled = run(args, compiled=True, outside=outside)
        except Exception as exc:  # the answer to the question: print it, do not hide it
            print(json.dumps({"compiled": True, "mode": args.mode, "outside": outside,
                              "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
            failed = 1
            continue
        compiled["max_loss_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                                            for a, b in zip(compiled["losses"], eager["losses"]))
        compiled["speed_vs_eager"] = round(eager["steady_step_ms"] / compiled["steady_step_ms"], 3)
        print(json.dumps(compiled), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
