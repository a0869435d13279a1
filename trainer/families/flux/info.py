"""Registry entry of Flux.1 (torch-free): dev, schnell and FLUX.1 Kontext [dev], the edit model that trains on
pairs (one control image per target, the instruction as caption)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="flux",
    label="Flux.1",
    choices=("flux-dev", "flux-schnell", "flux-kontext"),
    variants=("flux-dev", "flux-schnell", "flux-kontext"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-L"),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "T5-XXL", optional=True)),
    objective="flow",
    family_class="trainer.families.flux.family:Flux",
    detect="trainer.families.flux.detect",
    tiny={"tiny-flux": "trainer.families.flux.tiny:ensure_tiny",
          "tiny-flux-schnell": "trainer.families.flux.tiny:ensure_tiny",
          "tiny-flux-kontext": "trainer.families.flux.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_2.train", False,
              "Flux LoRA files carry the transformer and CLIP-L (diffusers loads no T5 LoRA for Flux), and a "
              "fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "Flux.1 LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    # dev and Kontext are guidance-distilled (guidance_embeds); schnell has no guidance embedding
    guidance_variants=("flux-dev", "flux-kontext"),
    dynamic_shift_variants=("flux-dev", "flux-kontext"),  # schnell's scheduler: a fixed shift of 1
    own_fields=("model.guidance_scale",),
    # Kontext edits one image: each target pairs with one control image (the source it was edited from)
    controls={"flux-kontext": (1, 1)},
    quick_start=(QuickChoice("flux", "Flux.1 dev / schnell", {"lora": "flux-lora-24gb", "finetune": "flux-finetune"}),
                 QuickChoice("flux-kontext", "FLUX.1 Kontext [dev] (image edits, trained on pairs)",
                             {"lora": "kontext-lora-24gb"})),
    # [dev]: FluxPipeline's 28 steps at embedded guidance 3.5; [schnell] is step- and guidance-distilled (its card: 4
    # steps, guidance 0; the pipeline's defaults are [dev]'s); Kontext: its card's guidance 2.5
    sample_defaults={
        "flux-dev": SampleDefaults(28, 3.5, "", "FluxPipeline"),
        "flux-schnell": SampleDefaults(4, 0.0, "", "FluxPipeline", differs=("steps", "guidance"),
                                       why="FLUX.1 [schnell]'s model card: 4 steps, guidance 0 (step-distilled)"),
        "flux-kontext": SampleDefaults(28, 2.5, "", "FluxKontextPipeline", differs=("guidance",),
                                       why="FLUX.1 Kontext [dev]'s model card: guidance 2.5")},
)
