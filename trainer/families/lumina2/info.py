"""Registry entry of Lumina 2 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="lumina2",
    label="Lumina 2",
    choices=("lumina2",),
    variants=("lumina2",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Gemma 2")),
    objective="flow",
    family_class="trainer.families.lumina2.family:Lumina2",
    detect="trainer.families.lumina2.detect",
    tiny={"tiny-lumina2": "trainer.families.lumina2.tiny:ensure_tiny"},
    caption_limit=256,  # Lumina2Pipeline's max_sequence_length, which the system prompt's tokens share
    refuses=(("parts.text_encoder_1.train", False,
              "Lumina 2 LoRA files carry the transformer (diffusers' Lumina2Pipeline loads no Gemma LoRA), and a "
              "fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "Lumina 2 LoRA files are in the original layout ComfyUI and diffusers both read, which has no place for "
              "LoHa/LoKr factors, DoRA's magnitudes or OFT's blocks")),
    finetune_slots=("unet",),
    own_fields=("model.system_prompt",),
    quick_start=(QuickChoice("lumina2", "Lumina 2 (Lumina-Image-2.0, Neta-Lumina)", {"lora": "lumina2-lora"}),),
    sample_defaults={"lumina2": SampleDefaults(30, 4.0, "", "Lumina2Pipeline")},
)
