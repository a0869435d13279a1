"""Registry entry of Chroma (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="chroma",
    label="Chroma",
    choices=("chroma",),
    variants=("chroma",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "T5-XXL")),
    objective="flow",
    family_class="trainer.families.chroma.family:Chroma",
    detect="trainer.families.chroma.detect",
    tiny={"tiny-chroma": "trainer.families.chroma.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Chroma LoRA files carry the transformer (ComfyUI and diffusers load no T5 LoRA for it), and a fine-tune "
              "is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "Chroma LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("chroma", "Chroma", {"lora": "chroma-lora"}),),
    # ChromaPipeline's own: 35 steps at CFG 5
    sample_defaults={"chroma": SampleDefaults(35, 5.0, "", "ChromaPipeline")},
    dynamic_shift_variants=("chroma",),  # the scheduler shifts by the image size (use_dynamic_shifting)
)
