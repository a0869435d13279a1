"""Registry entry of Flux.1 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice

INFO = FamilyInfo(
    name="flux",
    label="Flux.1",
    choices=("flux-dev", "flux-schnell"),
    variants=("flux-dev", "flux-schnell"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-L"),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "T5-XXL", optional=True)),
    objective="flow",
    family_class="trainer.families.flux.family:Flux",
    detect="trainer.families.flux.detect",
    tiny={"tiny-flux": "trainer.families.flux.tiny:ensure_tiny",
          "tiny-flux-schnell": "trainer.families.flux.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_2.train", False,
              "Flux LoRA files carry the transformer and CLIP-L (diffusers loads no T5 LoRA for Flux), and a "
              "fine-tune is saved as the transformer alone"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("flux", "Flux.1 dev / schnell", {"lora": "flux-lora-24gb", "finetune": "flux-finetune"}),),
)
