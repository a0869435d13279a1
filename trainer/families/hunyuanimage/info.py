"""Registry entry of HunyuanImage 2.1 (torch-free): the base text-to-image model on diffusers' HunyuanImagePipeline."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

VARIANTS = ("hunyuan-image",)

INFO = FamilyInfo(
    name="hunyuanimage",
    label="HunyuanImage 2.1",
    choices=VARIANTS,
    variants=VARIANTS,
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen2.5-VL"),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "ByT5 (quoted text)")),
    objective="flow",
    family_class="trainer.families.hunyuanimage.family:HunyuanImage",
    detect="trainer.families.hunyuanimage.detect",
    tiny={"tiny-hunyuan-image": "trainer.families.hunyuanimage.tiny:ensure_tiny"},
    caption_limit=1000,  # HunyuanImagePipeline's tokenizer_max_length
    refuses=(("parts.text_encoder_1.train", False,
              "HunyuanImage 2.1 LoRA files carry the transformer (HunyuanImagePipeline loads no text-encoder LoRA), "
              "and a fine-tune is saved as the transformer alone"),
             ("parts.text_encoder_2.train", False, "the ByT5 glyph encoder stays frozen, as in the anchors' trainers"),
             ("lora.type", ("lora",),
              "HunyuanImage 2.1 LoRA files are plain LoRA (lora_A/lora_B), which has no place for LoHa/LoKr factors, "
              "DoRA's magnitudes or OFT's blocks")),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("hunyuan-image", "HunyuanImage 2.1", {"lora": "hunyuan-image-lora"}),),
    # HunyuanImagePipeline's 50 steps; cfg_scale is the guider's guidance_scale (adaptive projected guidance, 3.5 in
    # the released model's guider/config.json), not the pipeline's distilled_guidance_scale (the distilled model's)
    sample_defaults={
        "hunyuan-image": SampleDefaults(50, 3.5, "", "HunyuanImagePipeline", guidance_arg="distilled_guidance_scale",
                                        differs=("guidance",),
                                        why="the base model's guidance is its guider's guidance_scale (3.5 in "
                                            "hunyuanvideo-community/HunyuanImage-2.1-Diffusers guider/config.json); "
                                            "the pipeline's distilled_guidance_scale is the distilled model's"),
    },
)
