#!/usr/bin/env python3
"""Ops of one transformer block's forward and backward as CUDA would launch them, with the denoiser's RMSNorms as
the run had them before and as ``training.norms_in_compute_dtype`` runs them.

    OMP_NUM_THREADS=1 .venv/bin/python bench/norm_counts.py

The blocks are diffusers' own (Flux.1's double and single blocks, with torch's ``nn.RMSNorm``; Qwen-Image's and
Z-Image's, with diffusers' ``RMSNorm``), narrow (128 channels, 2 heads, 64 image and 16 text tokens: the op count
does not depend on the widths), in bf16 under bf16 autocast with CUDA's autocast policy
(``trainer.memory.estimate_session.cuda_autocast_fp32``, the VRAM estimate's: group_norm, layer_norm, rms_norm and
softmax in fp32). On a CPU build ``F.rms_norm`` runs op by op; CUDA runs it as one fused kernel forward and one
backward, so each call counts as two ops here and the ops inside it are not counted. Views are not counted;
``_to_copy`` ops (dtype casts) are shown apart. What the count cannot show is bytes: the casts moved (see
docs/performance.md, "The denoiser's RMSNorms in the compute dtype")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.memory import estimate_session  # noqa: E402
from trainer.train.norms import norms_in_compute_dtype  # noqa: E402

DIM, HEADS, IMAGE, TEXT = 128, 2, 64, 16


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.casts = self.norms = 0
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:
            self.ops += 1
            self.casts += func.overloadpacket.__name__ == "_to_copy"
        return func(*args, **(kwargs or {}))


def _blocks() -> Dict[str, Tuple[Callable[[], Any], Callable[[], Dict[str, Any]]]]:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock
    bf16, head = torch.bfloat16, DIM // HEADS

    def streams(**extra):
        return dict(hidden_states=torch.randn(1, IMAGE, DIM, dtype=bf16, requires_grad=True),
                    encoder_hidden_states=torch.randn(1, TEXT, DIM, dtype=bf16),
                    temb=torch.randn(1, DIM, dtype=bf16), **extra)

    flux_rope = (torch.randn(IMAGE + TEXT, head), torch.randn(IMAGE + TEXT, head))
    cplx = torch.complex64
    qwen_rope = (torch.randn(IMAGE, head // 2, dtype=cplx), torch.randn(TEXT, head // 2, dtype=cplx))
    return {
        "flux-double": (lambda: FluxTransformerBlock(DIM, HEADS, head), lambda: streams(image_rotary_emb=flux_rope)),
        "flux-single": (lambda: FluxSingleTransformerBlock(DIM, HEADS, head),
                        lambda: streams(image_rotary_emb=flux_rope)),
        "qwen-image": (lambda: QwenImageTransformerBlock(DIM, HEADS, head),
                       lambda: streams(encoder_hidden_states_mask=None, image_rotary_emb=qwen_rope)),
        "z-image": (lambda: ZImageTransformerBlock(0, DIM, HEADS, HEADS, 1e-5, True),
                    lambda: dict(x=torch.randn(1, IMAGE + TEXT, DIM, dtype=bf16, requires_grad=True), attn_mask=None,
                                 freqs_cis=torch.randn(1, IMAGE + TEXT, head // 2, dtype=torch.complex64),
                                 adaln_input=torch.randn(1, min(DIM, 256), dtype=bf16))),
    }


def count(make: Callable[[], Any], inputs: Callable[[], Dict[str, Any]], swapped: bool) -> Dict[str, int]:
    torch.manual_seed(0)
    block = make().to(torch.bfloat16)
    if swapped:
        norms_in_compute_dtype(block)
    args = inputs()
    counter = _Count()
    plain = estimate_session.rms_norm_as_cuda

    def one_kernel(*a, **k):  # CUDA's fused norm: one kernel forward, one backward
        counter.norms += 1
        counter.inside += 1
        try:
            return plain(*a, **k)
        finally:
            counter.inside -= 1

    estimate_session.rms_norm_as_cuda = one_kernel
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), estimate_session.cuda_autocast_fp32(), counter:
            out = block(**args)
            out = out[-1] if isinstance(out, tuple) else out
            out.float().square().mean().backward()
    finally:
        estimate_session.rms_norm_as_cuda = plain
    return {"ops": counter.ops + 2 * counter.norms, "casts": counter.casts, "fused_norm_calls": counter.norms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = {name: {"before": count(m, i, False), "now": count(m, i, True)} for name, (m, i) in _blocks().items()}
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| block (forward and backward) | ops before (casts) | ops now (casts) | now / before |\n|---|---|---|---|")
    for name, r in rows.items():
        b, n = r["before"], r["now"]
        print(f"| {name} | {b['ops']} ({b['casts']}) | {n['ops']} ({n['casts']}) | {n['ops'] / b['ops']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
