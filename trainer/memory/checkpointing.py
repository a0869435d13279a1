"""Gradient checkpointing of the denoiser's blocks, optionally keeping each block's attention output, optionally of
every N-th block only (``training.gradient_checkpointing_interval``, :class:`Checkpointing`).

Plain checkpointing (``training.gradient_checkpointing``) keeps none of a block's tensors for backward and runs the
whole block again there: its matmuls, norms and attention. With ``training.checkpoint_keep_attention`` the block's
self- and joint-attention kernels (torch's scaled-dot-product attention, whichever backend it picks) are saved in the
forward and taken from there when backward recomputes the block; everything else is recomputed as before, the
cross-attention to a caption included (few keys: cheap to recompute, and its output as big to keep). This is torch's
selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with a policy
that saves attention alone. What it costs: the attention output of every checkpointed block
(batch × tokens × the attention's width, in the compute dtype) and its softmax statistics stay alive until backward;
what it saves: one attention forward per block and step, which grows with the square of the sequence length (a
1024 px DiT, video clips). The values are the same: the kept output is the one the recomputation would have made
again (``tests/test_checkpointing_options.py``).

Compiled blocks (``training.compile``) keep it too: the checkpoint sits around the compiled block (diffusers calls
its checkpointing function with the block), and the compiled code calls the attention kernel as an aten op, which the
checkpoint's dispatch mode sees (checked with inductor on the CPU and with AOTAutograd in the test). What it adds is
host work: the dispatch mode runs Python for every op of a checkpointed block's forward and recomputation (about
+4 ms per Flux double block and +2 ms per single one on a slow 2-core CPU, ``bench/checkpoint_attention.py``), which
is why it is a switch.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Dict

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# every aten entry point of scaled-dot-product attention (CUDA flash / memory-efficient / cuDNN, the CPU's flash), with
# the dimension of its inputs that runs along the sequence: (batch, heads, sequence, width) for the SDPA ops,
# (batch, sequence, heads, width) for the kernels' own forwards
_ATTENTION_SEQ_DIM = {"_scaled_dot_product_flash_attention": -2, "_scaled_dot_product_efficient_attention": -2,
                      "_scaled_dot_product_cudnn_attention": -2, "_scaled_dot_product_flash_attention_for_cpu": -2,
                      "_scaled_dot_product_fused_attention_overrideable": -2, "_cudnn_attention_forward": -2,
                      "_flash_attention_forward": 1, "_efficient_attention_forward": 1}
_SEQ_DIM = {getattr(torch.ops.aten, n).default: d for n, d in _ATTENTION_SEQ_DIM.items() if hasattr(torch.ops.aten, n)}
ATTENTION_OPS = frozenset(_SEQ_DIM)


def _worth_keeping(op: Any, query: Any, key: Any) -> bool:
    """Self- and joint attention (the keys about as many as the queries: recomputing costs the square of the
    sequence), not cross-attention to a caption (a few hundred keys for thousands of queries: cheap to recompute,
    and its output as big as self-attention's). Packed variable-length inputs (3-D) are kept."""
    if getattr(query, "dim", lambda: 0)() != 4 or getattr(key, "dim", lambda: 0)() != 4:
        return True
    dim = _SEQ_DIM[op]
    return 4 * key.shape[dim] >= query.shape[dim]


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in ATTENTION_OPS and _worth_keeping(op, args[0] if args else kwargs.get("query"),
                                              args[1] if len(args) > 1 else kwargs.get("key")):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_attention)


def checkpointed(module: Any, *args: Any, keep_attention: bool = False, **kwargs: Any) -> Any:
    """A non-reentrant checkpoint of ``module(*args, **kwargs)`` (diffusers' ``_gradient_checkpointing_func``; keyword
    arguments pass on, which diffusers 0.42.1's default function refuses: HunyuanImage's blocks take them)."""
    if keep_attention:
        return checkpoint(module.__call__, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
    return checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


class Checkpointing:
    """diffusers' ``_gradient_checkpointing_func`` (``enable_gradient_checkpointing(gradient_checkpointing_func=…)``):
    the blocks a model hands it, checkpointed as :func:`checkpointed` does, every ``interval``-th of them only
    (``training.gradient_checkpointing_interval``; the others run plainly and keep their activations for backward:
    less recomputation, more memory). Blocks are counted in the order they are first handed over (a model's forward
    calls them in its own order, the same every step), so with 2 the first, third, fifth … block is checkpointed."""

    def __init__(self, keep_attention: bool = False, interval: int = 1):
        self.keep_attention, self.interval = bool(keep_attention), max(int(interval), 1)
        self._order: Dict[int, int] = {}

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        index = self._order.setdefault(id(module), len(self._order))
        if index % self.interval:
            return module(*args, **kwargs)
        return checkpointed(module, *args, keep_attention=self.keep_attention, **kwargs)


def checkpoint_function(keep_attention: bool, interval: int = 1) -> Callable[..., Any]:
    if interval > 1:
        return Checkpointing(keep_attention, interval)
    return partial(checkpointed, keep_attention=True) if keep_attention else checkpointed


def enable_checkpointing(module: Any, keep_attention: bool = False, interval: int = 1) -> None:
    """Turn on ``module``'s gradient checkpointing: a transformers model (text encoders) its own way; a diffusers model
    (and the trainer's wrappers of one) with :func:`checkpoint_function`."""
    if hasattr(module, "gradient_checkpointing_enable"):
        module.gradient_checkpointing_enable()
        return
    enable = module.enable_gradient_checkpointing
    if "gradient_checkpointing_func" in inspect.signature(enable).parameters:
        enable(gradient_checkpointing_func=checkpoint_function(keep_attention, interval))
    else:
        enable()


__all__ = ["ATTENTION_OPS", "Checkpointing", "checkpoint_function", "checkpointed", "enable_checkpointing"]
