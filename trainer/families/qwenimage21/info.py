"""Registry entry of Qwen-Image 2.1 (torch-free): the base model and its few-step Turbo checkpoint, one architecture.

A family of its own, not a variant of Qwen-Image: every part differs (a single-stream block-causal transformer with
one shared modulation instead of the dual-stream MMDiT, Qwen3-VL instead of Qwen2.5-VL, a 64-channel 16× VAE read
unpatched instead of the 16-channel 8× one packed 2×2), and so do the inputs, the LoRA names and the single file."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

VARIANTS = ("qwen-image-21", "qwen-image-21-turbo")

INFO = FamilyInfo(
    name="qwenimage21",
    label="Qwen-Image 2.1",
    choices=VARIANTS,
    variants=VARIANTS,
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen3-VL")),
    objective="flow",
    family_class="trainer.families.qwenimage21.family:QwenImage21",
    detect="trainer.families.qwenimage21.detect",
    tiny={"tiny-qwen-image-21": "trainer.families.qwenimage21.tiny:ensure_tiny",
          "tiny-qwen-image-21-turbo": "trainer.families.qwenimage21.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Qwen-Image 2.1 LoRA files carry the transformer (diffusers' QwenImage21Pipeline loads no Qwen3-VL "
              "LoRA), and a fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "Qwen-Image 2.1 LoRA files are in the layout ComfyUI and diffusers both read (diffusion_model.<module>), "
              "which has no place for LoHa/LoKr factors, DoRA's magnitudes or OFT's blocks")),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("qwen-image-21", "Qwen-Image 2.1", {"lora": "qwen-image-21-lora"}),),
    # QwenImage21Pipeline.__call__: 40 steps, true_cfg_scale 1 (no guidance: "meant to be sampled without
    # guidance"); Turbo: the 8 steps of its shipped sample_sigmas (the Turbo modular blocks' default), no guidance
    sample_defaults={
        "qwen-image-21": SampleDefaults(40, 1.0, "", "QwenImage21Pipeline", guidance_arg="true_cfg_scale"),
        "qwen-image-21-turbo": SampleDefaults(8, 1.0, "", "QwenImage21Pipeline", guidance_arg="true_cfg_scale",
                                              differs=("steps",),
                                              why="the Turbo checkpoint's sample_sigmas and the QwenImage21Turbo "
                                                  "modular blocks: 8 steps"),
    },
    dynamic_shift_variants=VARIANTS,  # both sample with the scheduler's μ of the image size
)
