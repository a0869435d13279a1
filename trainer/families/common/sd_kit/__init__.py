"""The kit the SD 1.x/2.x and SDXL families share: single-file detection and shipped configs (sd_configs,
configs/), the original-layout key maps, single-file writer and LoRA namer (keys), the default LoRA targets and
LoRA header (lora), tiny offline models (tiny), inpainting input (inpaint) and their base class (family_base)."""
