"""Compute copies of plain LoRA weights in the autocast dtype (bf16, or fp16 on a GPU), with the fp32 weights as
masters (``training.adapter_compute_copies``).

Under bf16 (fp16) autocast an fp32 LoRA weight is cast to that dtype at every forward, and its gradient cast back to
fp32 in backward: two copies per weight and step (512 for an SD 1.5 LoRA of 128 layers), each a separate op the
host launches. Here each adapted layer's ``lora_A``/``lora_B`` weights get a copy in the autocast dtype, put in the
layer's place for the training forward and backward only; after each micro-batch's backward its gradients are added
into the fp32 masters' gradients (one foreach op), and after the optimizer step the masters are copied into the
copies (one foreach op). Outside a micro-batch the layers hold their fp32 masters, so whatever reads the
adapter weights between steps (saving, backups, resume, EMA, clipping, the optimizer, sampling, validation)
sees what it always saw.

The values are those of the autocast path: the copy is the master rounded to bf16 as autocast rounds it (round
to nearest even), the matmuls are the same bf16 matmuls, and each micro-batch's bf16 gradient is widened to fp32
exactly before it is summed in fp32, as autocast's cast backward does. fp16 is the same with the loss scaled:
the copies' fp16 gradients are the scaled ones autocast's cast would widen (an overflow to inf included), and the
grad scaler unscales, checks and steps the masters' fp32 gradients as it did.

Only plain peft LoRA layers take part: DoRA (its weight norm reads the weights outside the matmuls), LoHa/LoKr
(their products of factors) and OFT keep autocast's casts.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional, Tuple

import torch
from peft.tuners.lora import LoraLayer

from trainer.methods.lora import autocasts


def plain_lora_weights(modules: Iterable[torch.nn.Module]) -> List[Tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """(owning layer, attribute name, weight) of every trainable fp32 weight of a plain peft LoRA layer's
    ``lora_A``/``lora_B`` (no DoRA or other variant), each once."""
    found, seen = [], set()
    for m in modules:
        for layer in m.modules():
            if not isinstance(layer, LoraLayer) or getattr(layer, "lora_variant", None):
                continue
            for part in (layer.lora_A, layer.lora_B):
                for sub in part.values():
                    for name, p in sub.named_parameters(recurse=False):
                        if p.requires_grad and p.dtype == torch.float32 and id(p) not in seen:
                            seen.add(id(p))
                            found.append((sub, name, p))
    return found


class ComputeCopies:
    """The copies (``dtype``) of the masters ``weights`` (from :func:`plain_lora_weights`) and the swaps between
    them."""

    def __init__(self, weights: List[Tuple[torch.nn.Module, str, torch.nn.Parameter]],
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.owners = [(owner, name) for owner, name, _ in weights]
        self.masters = [p for _, _, p in weights]
        self.copies = [torch.nn.Parameter(p.detach().to(dtype)) for p in self.masters]
        self.grads: Optional[List[torch.Tensor]] = None  # the masters' fp32 gradients, kept between steps
        self.widened: Optional[List[torch.Tensor]] = None  # a micro-batch's gradients widened to fp32

    def __len__(self) -> int:
        return len(self.masters)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the copies (after the optimizer step, after a backup or weights are loaded)."""
        torch._foreach_copy_(self.copies, self.masters)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The copies in the layers for one micro-batch's forward and backward, the masters back after."""
        for (owner, name), c in zip(self.owners, self.copies):
            owner._parameters[name] = c
        try:
            yield
        finally:
            for (owner, name), p in zip(self.owners, self.masters):
                owner._parameters[name] = p

    @torch.no_grad()
    def add_grads(self) -> None:
        """Add the micro-batch's gradients (in the copies' dtype) into the masters' fp32 gradients, then drop them. A
        weight the micro-batch left without a gradient (none in a LoRA forward) counts as zero."""
        grads = [c.grad if c.grad is not None else torch.zeros_like(c) for c in self.copies]
        if self.grads is None:
            self.grads = [torch.empty_like(p) for p in self.masters]
        if all(p.grad is None for p in self.masters):  # the step's first micro-batch
            torch._foreach_copy_(self.grads, grads)
            for p, g in zip(self.masters, self.grads):
                p.grad = g
        else:
            if self.widened is None:
                self.widened = [torch.empty_like(p) for p in self.masters]
            torch._foreach_copy_(self.widened, grads)
            torch._foreach_add_([p.grad for p in self.masters], self.widened)
        for c in self.copies:
            c.grad = None


def make_compute_copies(method, cfg, world: int, device) -> Optional[ComputeCopies]:
    """The copies where they are exact and safe: the forward under autocast (bf16; fp16 where autocast runs it, on a
    GPU), a LoRA method with plain LoRA layers, one process (DDP's and FSDP's hooks hold the weights they were
    given) and no fused backward (it steps each weight inside backward); ``None`` otherwise or when switched off.
    Compiled blocks (``training.compile``) take the copies as their graphs' inputs: the training step's graphs are
    traced with the copies in place (their dtype guarded: no recompile from step to step), so no weight is cast in
    forward and no gradient in backward inside them; sampling between steps, without gradients, runs graphs of its
    own with the masters."""
    t = cfg.training
    if not t.get("adapter_compute_copies", True) or not autocasts(cfg, device) or world > 1:
        return None
    if getattr(method, "name", None) != "lora" or t.fused_backward:
        return None
    weights = plain_lora_weights(method.modules.values())
    dtype = torch.bfloat16 if t.mixed_precision == "bf16" else torch.float16
    return ComputeCopies(weights, dtype) if weights else None
