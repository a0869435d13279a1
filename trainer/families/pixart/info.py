"""Registry entry of PixArt-α/Σ (torch-free)."""

from trainer.families import FamilyInfo, Part

INFO = FamilyInfo(
    name="pixart",
    label="PixArt-α/Σ",
    choices=("pixart-alpha", "pixart-sigma"),
    variants=("pixart-alpha", "pixart-sigma"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "T5-XXL")),
    objective="ddpm",
    family_class="trainer.families.pixart.family:PixArt",
    detect="trainer.families.pixart.detect",
    tiny={"tiny-pixart": "trainer.families.pixart.tiny:ensure_tiny"},
    caption_limit=300,
    finetune_slots=("unet",),
)
