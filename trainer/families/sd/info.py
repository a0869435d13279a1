"""Registry entry of Stable Diffusion 1.x / 2.x (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

WHY = "Atelier's: A1111's 20 steps at CFG 7 with DDIM, the previews SD users compare with"

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
    tiny={"tiny-sd": "trainer.families.common.sd_kit.tiny:ensure_tiny_model",
          "tiny-sd2": "trainer.families.common.sd_kit.tiny:ensure_tiny_model",
          "tiny-sd-inpaint": "trainer.families.common.sd_kit.tiny:ensure_tiny_model"},
    embeddings=True,
    clip_skip=True,
    quick_start=(
        # the demo trains this family's tiny models (demo: a LoRA on tiny-sd; demo-learns: a fine-tune of tiny-sd2)
        QuickChoice("demo", "Demo: the built-in tiny model (offline, under a minute on a CPU)",
                    {"lora": "demo", "finetune": "demo-learns"}, builtin=True),
        QuickChoice("sd15", "Stable Diffusion 1.5 (and models based on it)",
                    {"lora": "sd15-lora", "finetune": "sd15-finetune"}),
        QuickChoice("sd2", "Stable Diffusion 2.x (768 px, v-prediction)", {"lora": "sd2-lora"}),
        QuickChoice("sd15-inpaint", "SD 1.5 inpainting",
                    {"lora": "sd15-inpaint-lora", "finetune": "sd15-inpaint-finetune"}),
    ),
    # previews as SD users know them (A1111's 20 steps at CFG 7, DDIM), not the pipelines' 50 steps at 7.5
    sample_defaults={v: SampleDefaults(20, 7.0, "ddim", p, differs=("steps", "guidance"), why=WHY)
                     for v, p in (("sd15", "StableDiffusionPipeline"), ("sd2", "StableDiffusionPipeline"),
                                  ("sd15-inpaint", "StableDiffusionInpaintPipeline"),
                                  ("sd2-inpaint", "StableDiffusionInpaintPipeline"))},
)
