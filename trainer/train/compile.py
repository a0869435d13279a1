"""``training.compile``: torch.compile of the denoiser's repeated blocks (regional compilation).

Compiling the whole UNet or transformer takes minutes and recompiles whenever a shape changes; its
repeated blocks (a UNet's ``BasicTransformerBlock``s, Flux's double and single blocks) share one
class, so compiling each of them in place (``nn.Module.compile``) costs one compile per block class and
input shape, and gives most of the speed-up (PyTorch's regional-compilation recipe; diffusers'
``ModelMixin.compile_repeated_blocks`` does the same from the model's ``_repeated_blocks``). LoRA layers,
fp8 storage hooks and gradient checkpointing are inside or around the blocks and are traced with them.

The block classes come from the model's own ``_repeated_blocks`` when diffusers defines it, else from
the model itself: the classes of modules that repeat in a ``ModuleList`` (PixArt's transformer blocks).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch.nn as nn


def repeated_block_classes(model: Any) -> List[str]:
    """Class names of the model's repeated blocks."""
    declared = list(getattr(model, "_repeated_blocks", None) or [])
    if declared:
        return declared
    found = set()
    for module in model.modules():  # a list of >= 2 blocks of one class, each made of layers of its own
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and any(True for _ in module[0].children()):
                found.add(type(module[0]).__name__)
    return sorted(found)


def compile_blocks(model: Any, **options: Any) -> Dict[str, int]:
    """Compile every repeated block of ``model`` in place; {class name: blocks compiled}."""
    names = set(repeated_block_classes(model))
    done: Dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name in names:
            module.compile(**options)
            done[name] = done.get(name, 0) + 1
    if not done:
        raise ValueError(f"training.compile: {type(model).__name__} has no repeated blocks to compile")
    return done


def describe(done: Dict[str, int]) -> str:
    return ", ".join(f"{n} × {name}" for name, n in sorted(done.items()))


__all__ = ["compile_blocks", "describe", "repeated_block_classes"]
