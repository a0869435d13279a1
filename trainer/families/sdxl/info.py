"""Registry entry of Stable Diffusion XL (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice

INFO = FamilyInfo(
    name="sdxl",
    label="SDXL",
    choices=("sdxl",),
    variants=("sdxl", "sdxl-inpaint"),
    parts=(Part("unet", "unet", "denoiser", "UNet"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-L"),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "OpenCLIP-G")),
    objective="ddpm",
    family_class="trainer.families.sdxl.family:StableDiffusionXL",
    detect="trainer.families.sdxl.detect",
    tiny={"tiny-sdxl": "trainer.families.common.sd_kit.tiny:ensure_tiny_model",
          "tiny-sdxl-inpaint": "trainer.families.common.sd_kit.tiny:ensure_tiny_model"},
    embeddings=True,
    clip_skip=True,
    quick_start=(
        QuickChoice("sdxl", "SDXL (and Pony, Illustrious, … based on it)",
                    {"lora": "sdxl-lora", "finetune": "sdxl-finetune", "embedding": "sdxl-embedding"}),
        QuickChoice("sdxl-inpaint", "SDXL inpainting", {"lora": "sdxl-inpaint-lora"}),
    ),
)
