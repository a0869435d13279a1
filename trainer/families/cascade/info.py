"""Registry entry of Stable Cascade (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="cascade",
    label="Stable Cascade",
    choices=("stable-cascade",),
    variants=("stable-cascade", "stable-cascade-lite"),
    parts=(Part("unet", "prior", "denoiser", "Prior (stage C)"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-G")),
    objective="cosine",
    family_class="trainer.families.cascade.family:StableCascade",
    detect="trainer.families.cascade.detect",
    tiny={"tiny-cascade": "trainer.families.cascade.tiny:ensure_tiny"},
    finetune_slots=("unet",),
    pixel_multiple=128,  # EfficientNet sees ¾ of the image and downsamples 32×: 1024 px → 24×24
    # ComfyUI maps Cascade LoRA keys as lora_prior_unet_<module> / lora_prior_te_<module> (comfy/lora.py), which the
    # kohya writer produces for LoRA, DoRA, LoHa and LoKr alike: nothing refused there.
    embeddings=True,
    own_fields=("model.effnet_path", "model.decoder_path", "loss.cosine_timesteps", "model.cascade_variant"),
    quick_start=(QuickChoice("cascade", "Stable Cascade (stage C prior; lite under 16 GB)",
                             {"lora": "cascade-lora-16gb", "finetune": "cascade-finetune"}),),
    # the combined pipeline's prior guidance 4; its 60 prior steps are the card's 20 (StableCascadePriorPipeline's
    # default); the decoder runs its own 10 steps without guidance
    sample_defaults={v: SampleDefaults(20, 4.0, "", "StableCascadeCombinedPipeline", "prior_num_inference_steps",
                                       "prior_guidance_scale", differs=("steps",),
                                       why="Stable Cascade's model card: 20 prior steps at guidance 4")
                     for v in ("stable-cascade", "stable-cascade-lite")},
)
