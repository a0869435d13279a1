"""Registry entry of Stable Diffusion 3 / 3.5 (torch-free)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

INFO = FamilyInfo(
    name="sd3",
    label="Stable Diffusion 3/3.5",
    choices=("sd3.5-large", "sd3.5-medium", "sd3-medium"),
    variants=("sd3.5-large", "sd3.5-medium", "sd3-medium"),
    parts=(Part("unet", "transformer", "denoiser", "Transformer (MMDiT)"),
           Part("text_encoder", "text_encoder", "text_encoder", "CLIP-L"),
           Part("text_encoder_2", "text_encoder_2", "text_encoder", "CLIP-G"),
           Part("text_encoder_3", "text_encoder_3", "text_encoder", "T5-XXL", optional=True)),
    objective="flow",
    family_class="trainer.families.sd3.family:SD3",
    detect="trainer.families.sd3.detect",
    tiny={"tiny-sd3": "trainer.families.sd3.tiny:ensure_tiny"},
    caption_limit=256,
    refuses=(("parts.text_encoder_3.train", False,
              "SD3 LoRA files carry the transformer and the two CLIPs (diffusers' StableDiffusion3Pipeline and ComfyUI "
              "load no T5 LoRA for SD3), and a fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "SD3 LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("sd3", "Stable Diffusion 3.5 (large / medium)", {"lora": "sd35-large-lora"}),),
    # the model cards: SD3.5 Large 28 steps at CFG 3.5, Medium 40 at 4.5; SD3 Medium the pipeline's 28 at 7
    sample_defaults={
        "sd3.5-large": SampleDefaults(28, 3.5, "", "StableDiffusion3Pipeline", differs=("guidance",),
                                      why="SD 3.5 Large's model card: 28 steps, CFG 3.5"),
        "sd3.5-medium": SampleDefaults(40, 4.5, "", "StableDiffusion3Pipeline", differs=("steps", "guidance"),
                                       why="SD 3.5 Medium's model card: 40 steps, CFG 4.5"),
        "sd3-medium": SampleDefaults(28, 7.0, "", "StableDiffusion3Pipeline")},
)
