"""Registry entry of Z-Image (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="zimage",
    label="Z-Image",
    choices=("z-image",),
    variants=("z-image",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen3")),
    objective="flow",
    family_class="trainer.families.zimage.family:ZImage",
    detect="trainer.families.zimage.detect",
    tiny={"tiny-zimage": "trainer.families.zimage.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Z-Image LoRA files carry the transformer (diffusers' ZImagePipeline loads no Qwen3 LoRA), and a "
              "fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "Z-Image LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("zimage", "Z-Image (Turbo)", {"lora": "zimage-lora"}),
                 QuickChoice("zimage-turbo-adapter", "Z-Image Turbo with its training adapter (keeps the distillation)",
                             {"lora": "zimage-turbo-lora"})),
    # Z-Image Turbo (the released model, step-distilled): its card's 9 steps (8 transformer calls) without guidance;
    # ZImagePipeline's 50 steps at CFG 5 are the undistilled base model's
    sample_defaults={"z-image": SampleDefaults(9, 0.0, "", "ZImagePipeline", differs=("steps", "guidance"),
                                               why="Z-Image Turbo's model card: 9 steps, guidance 0")},
)
