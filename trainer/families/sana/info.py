"""Registry entry of Sana / Sana 1.5 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="sana",
    label="Sana / Sana 1.5",
    choices=("sana",),
    variants=("sana",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Gemma 2")),
    objective="flow",
    family_class="trainer.families.sana.family:Sana",
    detect="trainer.families.sana.detect",
    tiny={"tiny-sana": "trainer.families.sana.tiny:ensure_tiny"},
    caption_limit=300,  # SanaPipeline's max_sequence_length (the instruction prefix's tokens come on top)
    pixel_multiple=32,  # DC-AE compresses 32x: a side that is not a multiple has no latent of its own
    refuses=(("parts.text_encoder_1.train", False,
              "Sana LoRA files carry the transformer (diffusers' SanaPipeline loads no Gemma LoRA), and a fine-tune "
              "is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "Sana LoRA files are in the diffusers/peft layout SanaPipeline.load_lora_weights reads, which has no "
              "place for LoHa/LoKr factors or DoRA's magnitudes")),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("sana", "Sana / Sana 1.5 (600M, 1.6B, 4.8B)", {"lora": "sana-lora"}),),
    # SanaPipeline.__call__: 20 steps of its flow DPM-Solver at CFG 4.5, negative prompt ""
    sample_defaults={"sana": SampleDefaults(20, 4.5, "", "SanaPipeline")},
)
