#!/usr/bin/env python3
"""Which graphs a compiled UNet's blocks run, by ``training.compile_dynamic``: the real-size UNet (the shipped
full-size configs, random weights, fp32, LoRA on the attention projections) compiled as ``training.compile`` compiles
it (``trainer.train.compile.compile_blocks``), one forward and backward at one image size, with a backend that notes
each graph's symbolic sizes and counts the block calls it serves. Tracing only (no kernels are generated), so it runs
on a CPU at 512 px (SD 1.5: ~30 s on 2 cores).

    OMP_NUM_THREADS=2 .venv/bin/python bench/compile_shapes.py --model sd15 --side 512 --dynamic auto
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def has_symbolic_sizes(gm) -> bool:
    """Whether a graph dynamo hands its backend has symbolic sizes: placeholders whose value is a ``torch.SymInt``."""
    return any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")


def block_graphs(unet, dynamic: str, side: int, added: Optional[dict] = None) -> Dict[str, Any]:
    """Compile ``unet``'s blocks as training.compile does with ``dynamic`` (a training.compile_dynamic value), run
    one forward and backward of a ``side`` px image, and say which graphs the blocks ran: each graph's symbolic sizes
    (its placeholders with a ``torch.SymInt`` value) and how many block calls it served."""
    from trainer.train.compile import compile_blocks
    symbolic: List[bool] = []
    calls: collections.Counter = collections.Counter()

    def backend(gm, example_inputs):  # the eager backend, noting symbolic sizes and counting calls
        index = len(symbolic)
        symbolic.append(has_symbolic_sizes(gm))

        def run(*inputs):
            calls[index] += 1
            return gm.forward(*inputs)
        return run
    torch._dynamo.reset()
    compile_blocks(unet, "default", dynamic, backend=backend)
    latent = side // 8
    config = unet.config
    unet(torch.randn(1, config.in_channels, latent, latent), torch.tensor([500]),
         torch.randn(1, 77, config.cross_attention_dim), **(added or {})).sample.float().mean().backward()
    return {"dynamic": dynamic, "side": side, "graphs": len(symbolic), "symbolic": symbolic,
            "block_calls": [calls[i] for i in range(len(symbolic))],
            "block_calls_on_symbolic_graphs": sum(calls[i] for i, s in enumerate(symbolic) if s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sd15", choices=["sd15", "sdxl"])
    ap.add_argument("--side", type=int, default=512, help="image side in pixels (latents: side / 8)")
    ap.add_argument("--dynamic", default="auto", choices=["auto", "static", "dynamic"])
    ap.add_argument("--workspace", default="workspace", help="where the shipped configs are unpacked (cache/)")
    args = ap.parse_args()
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from trainer.families.common import full_size
    src = full_size.config_folder(args.model, Path(args.workspace) / "cache")
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(src / "unet")))
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    added = None
    if args.model == "sdxl":
        added = {"added_cond_kwargs": {"text_embeds": torch.randn(1, 1280), "time_ids": torch.randn(1, 6)}}
    print(json.dumps({"model": args.model, **block_graphs(unet, args.dynamic, args.side, added)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
