"""Registry entry of Flux.2 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="flux2",
    label="Flux.2",
    choices=("flux2-klein", "flux2-dev"),
    variants=("flux2-klein", "flux2-dev"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen3 / Mistral")),
    objective="flow",
    family_class="trainer.families.flux2.family:Flux2",
    detect="trainer.families.flux2.detect",
    tiny={"tiny-flux2-klein": "trainer.families.flux2.tiny:ensure_tiny",
          "tiny-flux2-dev": "trainer.families.flux2.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Flux.2 LoRA files carry the transformer (diffusers' Flux.2 pipelines load no text-encoder LoRA), and a "
              "fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "Flux.2 LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    # [dev] is guidance-distilled (guidance_embeds); [klein] has no guidance embedding (real CFG)
    guidance_variants=("flux2-dev",),
    own_fields=("model.guidance_scale",),
    quick_start=(
        QuickChoice("flux2", "Flux.2 [klein]", {"lora": "flux2-klein-lora"}),
        QuickChoice("flux2-refs", "Flux.2 [klein] with reference images", {"lora": "flux2-klein-lora-refs-16gb"}),
        QuickChoice("flux2-dev", "Flux.2 [dev] (32B; 24 GB and up)", {"lora": "flux2-dev-lora"}),
    ),
    # reference images (optional): BFL's limits, "up to 4" for [klein] 4B/9B and "recommended max 6" for [dev] (the
    # diffusers pipelines set none); see trainer/families/flux2/references.py
    controls={"flux2-klein": (0, 4), "flux2-dev": (0, 6)},
    # [dev]: Flux2Pipeline's 50 steps at guidance 4. [klein] 4B/9B are step-distilled (their cards: 4 steps,
    # guidance 1, which the pipeline ignores for them); the [klein] Base models take Flux2KleinPipeline's 50 steps at
    # CFG 4 (the loaded pipeline's is_distilled tells them apart)
    sample_defaults={
        "flux2-klein": SampleDefaults(4, 1.0, "", "Flux2KleinPipeline", differs=("steps", "guidance"),
                                      why="FLUX.2 [klein] 4B/9B model cards: 4 steps (step-distilled), guidance 1"),
        "flux2-klein-base": SampleDefaults(50, 4.0, "", "Flux2KleinPipeline"),
        "flux2-dev": SampleDefaults(50, 4.0, "", "Flux2Pipeline")},
)
