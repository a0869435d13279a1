"""HiDream's routed experts in training, with one device read per feed-forward instead of two per expert.

diffusers' ``MOEFeedForwardSwiGLU`` (0.42.1) runs the differentiable path in training mode: each token's row
repeated for its two experts, then for each of the four experts ``y[idx == i] = expert(x[idx == i])``. A boolean
index asks the device how many rows it selects (``nonzero``), so every expert costs two host waits (the index and
the assignment): 8 per feed-forward, 384 a forward of the released model's 48 blocks, as many again when gradient
checkpointing runs the blocks again. Each drains the GPU's queue while the host is ahead.

Here the rows are sorted by expert (a stable sort: each expert's rows keep their order, so each expert sees the
rows, in the order, that the boolean index gives it) and the experts' row counts are read once; each expert runs on
its slice and the outputs go back to their rows by index. The same products in the same order: the result equals
diffusers' (tested bit for bit). The inference path (``moe_infer``, sampling), fake tensors (the VRAM estimate
cannot read counts) and a compiling trace keep diffusers' forward."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from torch._subclasses.fake_tensor import is_fake


class SortedMoE(MOEFeedForwardSwiGLU):
    """``MOEFeedForwardSwiGLU`` whose training path reads the experts' row counts once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self._force_inference_output or is_fake(x) or torch.compiler.is_compiling():
            return super().forward(x)
        wtype, identity, orig_shape = x.dtype, x, x.shape
        topk_idx, topk_weight, _ = self.gate(x)
        rows = x.view(-1, x.shape[-1]).repeat_interleave(self.num_activated_experts, dim=0)
        expert_of = topk_idx.view(-1)
        order = expert_of.argsort(stable=True)
        experts = torch.arange(len(self.experts), device=expert_of.device)
        counts = (expert_of.unsqueeze(1) == experts).sum(0).tolist()  # the one device read
        outs = [expert(part).to(dtype=wtype) for expert, part in zip(self.experts, rows[order].split(counts))]
        y = torch.empty_like(rows, dtype=wtype)
        y[order] = torch.cat(outs)
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        return y.view(*orig_shape).to(dtype=wtype) + self.shared_experts(identity)


def sort_experts_rows(transformer: torch.nn.Module) -> int:
    """Give every routed feed-forward of ``transformer`` the sorted training path; returns how many."""
    n = 0
    for module in transformer.modules():
        if type(module) is MOEFeedForwardSwiGLU:
            module.__class__ = SortedMoE
            n += 1
    return n
