"""Registry entry of Qwen-Image and its edit models (torch-free).

The edit models are variants of the one family: the same MMDiT and VAE, Qwen2.5-VL seeing the control images
beside the instruction (its vision tower), and the control latents after the target's tokens. Qwen-Image-Edit
takes one control image; -2509 and -2511 ("Plus") one to three references."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults

EDIT_VARIANTS = ("qwen-image-edit", "qwen-image-edit-2509", "qwen-image-edit-2511")
VARIANTS = ("qwen-image",) + EDIT_VARIANTS

INFO = FamilyInfo(
    name="qwenimage",
    label="Qwen-Image",
    choices=VARIANTS,
    variants=VARIANTS,
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "Qwen2.5-VL")),
    objective="flow",
    # a function that picks the text-to-image or the edit class from the variant (both are in this folder)
    family_class="trainer.families.qwenimage.edit:load_qwen_image",
    detect="trainer.families.qwenimage.detect",
    tiny={"tiny-qwen-image": "trainer.families.qwenimage.tiny:ensure_tiny",
          "tiny-qwen-image-edit": "trainer.families.qwenimage.tiny:ensure_tiny",
          "tiny-qwen-image-edit-2509": "trainer.families.qwenimage.tiny:ensure_tiny",
          "tiny-qwen-image-edit-2511": "trainer.families.qwenimage.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Qwen-Image LoRA files carry the transformer (diffusers' QwenImagePipeline loads no Qwen2.5-VL LoRA), and "
              "a fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora", "loha", "lokr"),
              "Qwen-Image LoRA files are written in a layout (diffusers/peft keys, or BFL's) that has no place for "
              "DoRA's magnitudes or OFT's rotation blocks yet: the run would train every step and fail at save"),),
    finetune_slots=("unet",),
    controls={"qwen-image-edit": (1, 1), "qwen-image-edit-2509": (1, 3), "qwen-image-edit-2511": (1, 3)},
    quick_start=(QuickChoice("qwenimage", "Qwen-Image", {"lora": "qwen-image-lora"}),
                 QuickChoice("qwen-image-edit", "Qwen-Image-Edit (edit pairs: one control image)",
                             {"lora": "qwen-image-edit-lora"}),
                 QuickChoice("qwen-image-edit-2509", "Qwen-Image-Edit-2509 (one to three reference images)",
                             {"lora": "qwen-image-edit-2509-lora"}),
                 QuickChoice("qwen-image-edit-2511", "Qwen-Image-Edit-2511 (one to three reference images)",
                             {"lora": "qwen-image-edit-2511-lora"})),
    # the pipelines' true CFG 4 with a " " negative prompt; 50 steps (the 2509/2511 cards: 40)
    sample_defaults={
        "qwen-image": SampleDefaults(50, 4.0, "", "QwenImagePipeline", guidance_arg="true_cfg_scale"),
        "qwen-image-edit": SampleDefaults(50, 4.0, "", "QwenImageEditPipeline", guidance_arg="true_cfg_scale"),
        **{v: SampleDefaults(40, 4.0, "", "QwenImageEditPlusPipeline", guidance_arg="true_cfg_scale",
                             differs=("steps",), why="the Qwen-Image-Edit-2509/2511 model cards: 40 steps")
           for v in ("qwen-image-edit-2509", "qwen-image-edit-2511")}},
    dynamic_shift_variants=VARIANTS,  # the scheduler shifts by the image size (use_dynamic_shifting)
)
