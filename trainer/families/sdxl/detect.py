"""Claim SDXL weights (the classification is shared with SD 1.x/2.x: one UNet lineage)."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.common.unet_lineage import classify


def claim(ev: Evidence) -> Optional[str]:
    found = classify(ev)
    return found if found and found.startswith("sdxl") else None
