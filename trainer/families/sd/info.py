"""Registry entry of Stable Diffusion 1.x / 2.x (torch-free)."""

from trainer.families import FamilyInfo, Part

INFO = FamilyInfo(
    name="sd",
    label="Stable Diffusion 1.x/2.x",
    choices=("sd15", "sd2"),
    variants=("sd15", "sd2", "sd15-inpaint", "sd2-inpaint"),
    parts=(Part("unet", "unet", "denoiser", "UNet"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP text encoder")),
    objective="ddpm",
    family_class="trainer.families.sd.family:StableDiffusion",
    detect="trainer.families.sd.detect",
    tiny={"tiny-sd": "trainer.families.common.sd_kit.tiny:ensure_tiny_model", "tiny-sd2": "trainer.families.common.sd_kit.tiny:ensure_tiny_model",
          "tiny-sd-inpaint": "trainer.families.common.sd_kit.tiny:ensure_tiny_model"},
    embeddings=True,
)
