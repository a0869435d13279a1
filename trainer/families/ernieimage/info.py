"""Registry entry of ERNIE-Image (torch-free): baidu's 8B single-stream DiT over a Mistral3 text model."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="ernieimage",
    label="ERNIE-Image",
    choices=("ernie-image",),
    variants=("ernie-image",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Mistral3")),
    objective="flow",
    family_class="trainer.families.ernieimage.family:ErnieImage",
    detect="trainer.families.ernieimage.detect",
    tiny={"tiny-ernie-image": "trainer.families.ernieimage.tiny:ensure_tiny"},
    caption_limit=1024,  # the cap on the tokens a caption keeps (the pipeline truncates at its tokenizer's length)
    refuses=(("parts.text_encoder_1.train", False,
              "ERNIE-Image LoRA files carry the transformer (diffusers' ErnieImagePipeline loads no text-encoder "
              "LoRA), and a fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "ERNIE-Image LoRA files are in the layout ComfyUI and diffusers both read (diffusion_model.<module>."
              "lora_A/lora_B), which has no place for LoHa/LoKr factors, DoRA's magnitudes or OFT's blocks")),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("ernieimage", "ERNIE-Image", {"lora": "ernie-image-lora"}),),
    # ErnieImagePipeline.__call__'s defaults: 50 steps, guidance 4.0 (uncond + 4·(cond − uncond)), negative ""
    sample_defaults={"ernie-image": SampleDefaults(50, 4.0, "", "ErnieImagePipeline")},
)
