"""Registry entry of Qwen-Image (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice

INFO = FamilyInfo(
    name="qwenimage",
    label="Qwen-Image",
    choices=("qwen-image",),
    variants=("qwen-image",),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen2.5-VL")),
    objective="flow",
    family_class="trainer.families.qwenimage.family:QwenImage",
    detect="trainer.families.qwenimage.detect",
    tiny={"tiny-qwen-image": "trainer.families.qwenimage.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Qwen-Image LoRA files carry the transformer (diffusers' QwenImagePipeline loads no Qwen2.5-VL LoRA), and "
              "a fine-tune is saved as the transformer alone"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("qwenimage", "Qwen-Image", {"lora": "qwen-image-lora"}),),
)
