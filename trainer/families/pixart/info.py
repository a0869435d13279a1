"""Registry entry of PixArt-α/Σ (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="pixart",
    label="PixArt-α/Σ",
    choices=("pixart-alpha", "pixart-sigma"),
    variants=("pixart-alpha", "pixart-sigma"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "T5-XXL")),
    objective="ddpm",
    family_class="trainer.families.pixart.family:PixArt",
    detect="trainer.families.pixart.detect",
    tiny={"tiny-pixart": "trainer.families.pixart.tiny:ensure_tiny",
          "tiny-pixart-alpha": "trainer.families.pixart.tiny:ensure_tiny"},
    caption_limit=300,
    finetune_slots=("unet",),
    # ComfyUI maps PixArt LoRA keys only as transformer.<diffusers module> (comfy/lora.py model_lora_keys_unet,
    # PixArt branch) or lora_unet_<original key>; the LyCORIS writer names modules lycoris_<…> (mapped for Flux,
    # not PixArt) and the peft-layout writer has no DoRA yet.
    refuses=(("lora.type", "lora", "a PixArt LoRA file is written in the diffusers/peft layout that ComfyUI and "
              "peft load, which holds plain LoRA only (DoRA, LoHa and LoKr files would not load in ComfyUI)"),),
    quick_start=(QuickChoice("pixart", "PixArt-Σ / PixArt-α",
                             {"lora": "pixart-sigma-lora", "finetune": "pixart-sigma-finetune"}),),
    # the pipelines' own: 20 steps of the model's DPM-Solver at CFG 4.5 (the model cards' settings too)
    sample_defaults={"pixart-alpha": SampleDefaults(20, 4.5, "", "PixArtAlphaPipeline"),
                     "pixart-sigma": SampleDefaults(20, 4.5, "", "PixArtSigmaPipeline")},
)
