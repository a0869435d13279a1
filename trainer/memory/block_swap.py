"""Block swapping (``parts.denoiser.blocks_to_swap``): the frozen weights of the denoiser's first N transformer
blocks live in (pinned) CPU RAM and visit the GPU one block at a time.

What kohya's/musubi-tuner's ``blocks_to_swap`` and OneTrainer's layer offloading do for the largest models
(Qwen-Image's 20B transformer, Flux.1 on small cards). Here: a forward pre-hook on each swapped block copies its
frozen tensors in (host to device, from a pinned copy kept for the whole run) and first sends the swapped block
that was there before back out. Sending out costs nothing: the frozen weights never change, so the parameter is
pointed back at its CPU copy and the device copy is freed.

Why this is safe in training: block swapping needs gradient checkpointing (``trainer.config`` refuses it
otherwise). Each block then runs inside a non-reentrant checkpoint that keeps none of its tensors for backward,
so once a block's forward is done its weights are not needed until backward recomputes that forward, which
fires the pre-hook again and brings the block back in before its backward runs. Blocks run in order, so in
backward block i's gradients are complete before block i-1 is recomputed: one swapped block on the device at a
time. The adapters (trainable) and everything outside the swapped blocks stay on the device. No prefetch yet:
each copy waits on the previous kernels (PCIe time per swapped block per pass).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from trainer.errors import ConfigError

log = logging.getLogger("atelier")


def swappable_blocks(model: Any) -> List[Any]:
    """The denoiser's transformer blocks in the order they run (the family's ``swap_blocks`` lists)."""
    den = model.denoiser
    out: List[Any] = []
    for name in getattr(model, "swap_blocks", ()) or ():
        out.extend(getattr(den, name, None) or [])
    return out


class BlockSwap:
    """Keeps the frozen tensors of ``blocks`` in CPU RAM; each block's forward brings them to ``device``.

    ``park``: what an evicted tensor points at, given its CPU copy (the copy itself; tests pass a function that
    returns a meta tensor, so computing with an evicted block fails loudly instead of silently reading RAM)."""

    def __init__(self, blocks: Sequence[Any], device: Any, resident: int = 1,
                 park: Optional[Callable[[Any], Any]] = None):
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.limit = max(1, int(resident))
        self.park = park
        self.pin = self.device.type == "cuda"
        self.resident: List[int] = []  # blocks on the device now, oldest first
        self.copies: Dict[int, List[Tuple[Any, str, Any]]] = {}  # block -> (owner module, name, CPU copy)
        self.loads = 0  # how many times a block was brought in (tests, the log)
        self.members = {id(m) for b in self.blocks for m in b.modules()}
        self._hooks = [b.register_forward_pre_hook(self._pre_hook(i)) for i, b in enumerate(self.blocks)]

    # --- which tensors ------------------------------------------------------------------------
    def frozen_tensors(self, block: Any) -> List[Tuple[Any, str, Any]]:
        """(owner module, name, tensor) of every frozen parameter and buffer of ``block``."""
        out = []
        for module in block.modules():
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    out.append((module, name, p))
            for name, b in module.named_buffers(recurse=False):
                if b is not None:
                    out.append((module, name, b))
        return out

    def bytes_swapped(self) -> int:
        """Bytes of the swapped blocks' frozen tensors, less the largest block's (it can be on the device)."""
        sizes = [sum(t.numel() * t.element_size() for _, _, t in self.frozen_tensors(b)) for b in self.blocks]
        return sum(sizes) - max(sizes, default=0)

    # --- moving --------------------------------------------------------------------------------
    def capture(self) -> None:
        """Take (pinned) CPU copies of the swapped blocks' frozen tensors as they are now (after fp8/NF4 storage) and
        send every swapped block out. Run once the denoiser's storage is final."""
        self.resident = []
        for i, block in enumerate(self.blocks):
            copies = []
            for module, name, t in self.frozen_tensors(block):
                cpu = t.detach().to("cpu", copy=t.device.type != "cpu")
                if self.pin:
                    cpu = cpu.pin_memory()
                copies.append((module, name, cpu))
            self.copies[i] = copies
            self._point(i, None)
        if self.pin:
            torch.cuda.empty_cache()

    def _point(self, i: int, device: Any) -> None:
        """Point block ``i``'s frozen tensors at ``device`` copies of their CPU copy (None: at the parked copy)."""
        for module, name, cpu in self.copies.get(i, ()):
            if device is None:
                data = self.park(cpu) if self.park is not None else cpu
            else:  # on a CPU run the copy is the tensor itself
                data = cpu if self.device.type == "cpu" else cpu.to(device, non_blocking=self.pin)
            if name in module._parameters:
                module._parameters[name].data = data
            else:
                module._buffers[name] = data

    def bring_in(self, i: int) -> None:
        if i in self.resident:
            return
        while len(self.resident) >= self.limit:
            self._point(self.resident.pop(0), None)
        self._point(i, self.device)
        self.resident.append(i)
        self.loads += 1

    def send_all_out(self) -> None:
        for i in self.resident:
            self._point(i, None)
        self.resident = []

    def _pre_hook(self, i: int):
        def hook(_module, _args):
            if self.copies:
                self.bring_in(i)
        return hook

    def place(self, module: Any, device: Any) -> None:
        """``module.to(device)``, except the swapped blocks' frozen tensors: they stay in their CPU copies (the text
        encoders' offload moves the denoiser in and out with this)."""
        device = torch.device(device)
        if device.type == "cpu":
            self.send_all_out()
        for sub in module.modules():
            swapped = id(sub) in self.members  # their frozen tensors stay where they are (RAM, or parked)
            for name, p in sub.named_parameters(recurse=False):
                if swapped and not p.requires_grad:
                    continue
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
            for name, b in list(sub.named_buffers(recurse=False)):
                if b is not None and not swapped:
                    sub._buffers[name] = b.to(device)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def plan_block_swap(model: Any, cfg: Any, device: Any, warn: Optional[Callable[[str], None]] = None) -> Optional[BlockSwap]:
    """The run's :class:`BlockSwap` for ``parts.denoiser.blocks_to_swap`` (None when 0), set as ``model.block_swap``
    before :func:`trainer.memory.precision.apply_storage` places the denoiser. ConfigError naming the field when the family
    has no block lists or fewer blocks."""
    n = int(cfg.parts.denoiser.get("blocks_to_swap", 0) or 0)
    if n <= 0:
        return None
    blocks = swappable_blocks(model)
    if not blocks:
        raise ConfigError(f"parts.denoiser.blocks_to_swap = {n}: block swapping is for the transformer families (Flux, "
                          f"SD 3, Qwen-Image, Z-Image, Chroma, Flux.2, PixArt); this {model.family or model.name} model's "
                          "denoiser has no transformer blocks to swap. Set it to 0.", key="parts.denoiser.blocks_to_swap",
                          value=n)
    if n >= len(blocks):
        raise ConfigError(f"parts.denoiser.blocks_to_swap = {n}, but this denoiser has {len(blocks)} blocks; at least one "
                          f"must stay on the device. Use at most {len(blocks) - 1}.",
                          key="parts.denoiser.blocks_to_swap", value=n)
    swap = BlockSwap(blocks[:n], device)
    model.block_swap = swap
    log.info("block swap: %d of %d denoiser blocks in CPU RAM, brought to %s one at a time", n, len(blocks), device)
    return swap


__all__ = ["BlockSwap", "plan_block_swap", "swappable_blocks"]
