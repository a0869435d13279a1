"""Registry entry of Würstchen 2 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="wuerstchen",
    label="Würstchen 2",
    choices=("wuerstchen-2",),
    variants=("wuerstchen-2",),
    parts=(Part("unet", "prior", "denoiser", "Prior"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-G")),
    objective="cosine",
    family_class="trainer.families.wuerstchen.family:Wuerstchen",
    detect="trainer.families.wuerstchen.detect",
    tiny={"tiny-wuerstchen": "trainer.families.wuerstchen.tiny:ensure_tiny"},
    finetune_slots=("unet",),
    pixel_multiple=128,  # EfficientNet sees ¾ of the image and downsamples 32×: 1024 px → 24×24
    # ComfyUI has no Würstchen 2 model; its LoRA is written in the diffusers/peft layout that diffusers'
    # WuerstchenPriorPipeline.load_lora_weights reads, which holds plain LoRA only
    refuses=(("lora.type", "lora", "a Würstchen 2 LoRA file is written in the diffusers/peft layout that "
              "WuerstchenPriorPipeline.load_lora_weights reads, which holds plain LoRA only"),),
    embeddings=True,
    own_fields=("model.effnet_path", "model.decoder_path", "loss.cosine_timesteps"),
    quick_start=(QuickChoice("wuerstchen", "Würstchen 2 (prior)", {"lora": "wuerstchen-2-lora"}),),
    # the combined pipeline's own: 60 prior steps at guidance 4 (the decoder: 12 steps, no guidance)
    sample_defaults={"wuerstchen-2": SampleDefaults(60, 4.0, "", "WuerstchenCombinedPipeline",
                                                    "prior_num_inference_steps", "prior_guidance_scale")},
)
