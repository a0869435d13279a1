"""Detection shared by the SD 1.x/2.x and SDXL families (one UNet lineage, one classifier)."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.common.sd_kit import sd_configs


def classify(ev: Evidence) -> Optional[str]:
    """sd15 / sd2 / sdxl (``-inpaint``) for SD-lineage weights, None for anything else; raises
    ValueError for SD-lineage weights no family trains (refiner, depth, pix2pix, unCLIP …)."""
    if ev.kind == "single_file":
        if not ev.has_prefix("model.diffusion_model.input_blocks.", "model.diffusion_model.out."):
            return None
        return sd_configs.classify_state_dict(ev.shapes, ev.where)
    unet = ev.json("unet/config.json")
    index = ev.json("model_index.json") or {}
    if unet is not None:
        if unet.get("_class_name", "UNet2DConditionModel") != "UNet2DConditionModel":
            return None
        return sd_configs.detect_from_configs(unet, index, ev.where)
    name = str(index.get("_class_name", "") or "")
    if name.startswith("StableDiffusionXL"):
        return "sdxl-inpaint" if "Inpaint" in name else "sdxl"
    if name in ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline"):
        return "sd15-inpaint" if "Inpaint" in name else "sd15"  # sd15 vs sd2: the loader reads the UNet
    return None
