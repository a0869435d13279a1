"""Registry entry of Ideogram 4 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="ideogram4",
    label="Ideogram 4",
    choices=("ideogram4",),
    variants=("ideogram4",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen3-VL")),
    objective="flow",
    family_class="trainer.families.ideogram4.family:Ideogram4",
    detect="trainer.families.ideogram4.detect",
    tiny={"tiny-ideogram4": "trainer.families.ideogram4.tiny:ensure_tiny"},
    caption_limit=512,  # Atelier's text length (the pipeline pads to 2048; padding changes no image token)
    refuses=(("parts.text_encoder_1.train", False,
              "Ideogram 4 LoRA files carry the conditional transformer (diffusers' Ideogram4Pipeline loads no "
              "Qwen3-VL LoRA), and a fine-tune is saved as that transformer alone"),
             ("lora.type", ("lora",),
              "Ideogram 4 LoRA files are in the original layout ComfyUI and diffusers both read (a fused qkv), which "
              "has no place for LoHa/LoKr factors or DoRA's magnitudes")),
    finetune_slots=("unet",),
    dynamic_shift_variants=("ideogram4",),
    quick_start=(QuickChoice("ideogram4", "Ideogram 4", {"lora": "ideogram4-lora"}),),
    # Ideogram4Pipeline's guidance default is a schedule (guidance_scale is None): 7.0 for 45 of its 48 steps, then
    # 3.0; a sample at 48 steps and cfg 7 gets exactly that schedule, any other a constant guidance
    sample_defaults={"ideogram4": SampleDefaults(48, 7.0, "", "Ideogram4Pipeline", differs=("guidance",),
                                                 why="Ideogram4Pipeline's default guidance_schedule: 7.0 (then 3.0 for "
                                                     "the last 3 steps)")},
)
