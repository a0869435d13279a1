"""Say what a single file is when no family claims it (a LoRA, an embedding, a VAE …)."""

from __future__ import annotations

from typing import Dict, Tuple

from trainer.families.common.sd_kit import sd_configs


def describe_non_checkpoint(shapes: Dict[str, Tuple[int, ...]], where: str) -> str:
    """One line naming what ``shapes`` (a file's key → shape) looks like instead of a model."""
    text = sd_configs.describe_non_checkpoint(shapes, where)
    return text.replace("not a Stable Diffusion checkpoint: ", "not a model checkpoint Atelier knows: ")
