"""Say what a single file is when no family claims it (a LoRA, an embedding, a VAE …)."""

from __future__ import annotations

from typing import Dict, Tuple


def describe_non_checkpoint(shapes: Dict[str, Tuple[int, ...]], where: str) -> str:
    """One line naming what ``shapes`` (a file's key → shape) looks like instead of a model."""
    from trainer.families.common.sd_kit.sd_configs import describe_non_checkpoint
    text = describe_non_checkpoint(shapes, where)
    return text.replace("not a Stable Diffusion checkpoint: ", "not a model checkpoint Atelier knows: ")
