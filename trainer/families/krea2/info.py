"""Registry entry of Krea 2 (torch-free): Krea-2-Raw and the few-step distilled Krea-2-Turbo, one architecture."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

VARIANTS = ("krea2", "krea2-turbo")

INFO = FamilyInfo(
    name="krea2",
    label="Krea 2",
    choices=VARIANTS,
    variants=VARIANTS,
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen3-VL")),
    objective="flow",
    family_class="trainer.families.krea2.family:Krea2",
    detect="trainer.families.krea2.detect",
    tiny={"tiny-krea2": "trainer.families.krea2.tiny:ensure_tiny",
          "tiny-krea2-turbo": "trainer.families.krea2.tiny:ensure_tiny"},
    caption_limit=512,  # Krea2Pipeline's max_sequence_length
    refuses=(("parts.text_encoder_1.train", False,
              "Krea 2 LoRA files carry the transformer (diffusers' Krea2Pipeline loads no Qwen3-VL LoRA), and a "
              "fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "Krea 2 LoRA files are in the original layout ComfyUI and diffusers both read, which has no place for "
              "LoHa/LoKr factors, DoRA's magnitudes or OFT's blocks")),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("krea2", "Krea 2 (Krea-2-Raw)", {"lora": "krea2-lora"}),
                 QuickChoice("krea2-turbo-adapter", "Krea 2 Turbo with its training adapter (keeps the distillation)",
                             {"lora": "krea2-turbo-lora"})),
    # Krea2Pipeline's __call__ defaults (28 steps, its guidance 4.5: cond + 4.5·(cond − uncond)); the turbo checkpoint
    # samples with 8 steps and no guidance (the pipeline's docstring and the Krea2Turbo modular blocks' defaults)
    sample_defaults={
        "krea2": SampleDefaults(28, 4.5, "", "Krea2Pipeline"),
        "krea2-turbo": SampleDefaults(8, 0.0, "", "Krea2Pipeline", differs=("steps", "guidance"),
                                      why="Krea2Pipeline's docstring for the distilled checkpoint and the Krea2Turbo "
                                          "modular blocks: 8 steps, guidance 0"),
    },
    dynamic_shift_variants=("krea2",),  # Raw: μ from the image size; Turbo: the fixed μ = 1.15 it was distilled at
)
