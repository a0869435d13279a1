"""Registry entry of Stable Diffusion XL (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

WHY = "Atelier's: 20 steps at CFG 7 with DDIM, as SD users compare previews (the pipelines: 50 steps at 5 or 7.5)"

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
    # previews as SDXL users know them (20 steps at CFG 7, DDIM), as Atelier always sampled them
    sample_defaults={"sdxl": SampleDefaults(20, 7.0, "ddim", "StableDiffusionXLPipeline", differs=("steps", "guidance"),
                                            why=WHY),
                     "sdxl-inpaint": SampleDefaults(20, 7.0, "ddim", "StableDiffusionXLInpaintPipeline",
                                                    differs=("steps", "guidance"), why=WHY)},
)
