"""Registry entry of HiDream-I1 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

_CARD = "HiDream-I1's model card and inference script"

INFO = FamilyInfo(
    name="hidream",
    label="HiDream-I1",
    choices=("hidream-full", "hidream-dev", "hidream-fast"),
    variants=("hidream-full", "hidream-dev", "hidream-fast"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer (MoE)"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-L", optional=True),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "CLIP-G", optional=True),
           Part("text_encoder_3", "text_encoder_3", "text_encoder", "T5-XXL", optional=True),
           Part("text_encoder_4", "text_encoder_4", "text_encoder", "Llama 3.1 8B", optional=True)),
    objective="flow",
    family_class="trainer.families.hidream.family:HiDream",
    detect="trainer.families.hidream.detect",
    tiny={"tiny-hidream": "trainer.families.hidream.tiny:ensure_tiny"},
    caption_limit=128,  # HiDreamImagePipeline's max_sequence_length (T5 and Llama; the CLIPs read 128 too)
    refuses=tuple((f"parts.text_encoder_{n}.train", False,
                   "HiDream-I1 LoRA files carry the transformer alone (diffusers' HiDreamImagePipeline and ComfyUI "
                   "load no text-encoder LoRA for it), and a fine-tune is saved as the transformer alone")
                  for n in (1, 2, 3, 4)) + (
        ("lora.type", ("lora",),
         "HiDream-I1 LoRA files are written in the diffusers/peft layout ComfyUI and diffusers both read; LoHa, LoKr "
         "and DoRA files are not written for it yet"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("hidream", "HiDream-I1 (full / dev / fast)", {"lora": "hidream-lora"}),),
    # full: the pipeline's own 50 steps at CFG 5; dev and fast are guidance-distilled (no CFG) and step-distilled
    sample_defaults={
        "hidream-full": SampleDefaults(50, 5.0, "", "HiDreamImagePipeline"),
        "hidream-dev": SampleDefaults(28, 0.0, "", "HiDreamImagePipeline", differs=("steps", "guidance"),
                                      why=f"{_CARD}: HiDream-I1-Dev samples 28 steps without CFG"),
        "hidream-fast": SampleDefaults(16, 0.0, "", "HiDreamImagePipeline", differs=("steps", "guidance"),
                                       why=f"{_CARD}: HiDream-I1-Fast samples 16 steps without CFG")},
)
