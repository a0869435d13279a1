"""Registry entry of Wan 2.x (torch-free): Wan 2.1 text-to-video (1.3B and 14B: one architecture, two sizes),
Wan 2.2 TI2V-5B (its own VAE, a timestep per token), Wan 2.2 T2V A14B (two experts; ``model.wan_expert`` picks the
one that trains) and the image-to-video models: Wan 2.1 I2V 14B (first-frame latents and a mask beside the noisy
latents, CLIP image features) and Wan 2.2 I2V A14B (the same without CLIP, two experts). An image-to-video model's
samples start from an image (``sampling.prompts.N.image``)."""

from trainer.families import FamilyInfo, Part, QuickChoice, SampleDefaults, VideoSpec

VARIANTS = ("wan21-t2v", "wan22-ti2v-5b", "wan22-t2v-a14b", "wan21-i2v", "wan22-i2v-a14b")
IMAGE_TO_VIDEO = ("wan21-i2v", "wan22-i2v-a14b")
# not a model.family value: the name of Wan 2.1 T2V 14B's full-size configs (the VRAM estimate of a hub id naming
# 14B; the 1.3B and the 14B load and train as wan21-t2v)
T2V_14B = "wan21-t2v-14b"

INFO = FamilyInfo(
    name="wan",
    label="Wan 2.x",
    choices=VARIANTS,
    variants=VARIANTS + (T2V_14B,),
    parts=(Part("unet", "transformer", "denoiser", "Transformer"),
           Part("text_encoder", "text_encoder", "text_encoder", "UMT5-XXL")),
    objective="flow",
    family_class="trainer.families.wan.family:Wan",
    detect="trainer.families.wan.detect",
    tiny={"tiny-wan21": "trainer.families.wan.tiny:ensure_tiny",
          "tiny-wan22-5b": "trainer.families.wan.tiny:ensure_tiny",
          "tiny-wan22-a14b": "trainer.families.wan.tiny:ensure_tiny",
          "tiny-wan21-i2v": "trainer.families.wan.tiny:ensure_tiny",
          "tiny-wan22-i2v-a14b": "trainer.families.wan.tiny:ensure_tiny"},
    caption_limit=512,
    refuses=(("parts.text_encoder_1.train", False,
              "Wan LoRA files carry the transformer (ComfyUI's Wan nodes and diffusers' WanPipeline load no UMT5 "
              "LoRA), and a fine-tune is saved as the transformer alone"),
             ("lora.type", ("lora",),
              "Wan LoRA files are written in the original layout ComfyUI's Wan nodes and diffusers' WanPipeline read "
              "(lora_A/lora_B per module), which has no place for DoRA's magnitudes, LoHa/LoKr factors or "
              "OFT's blocks"),),
    finetune_slots=("unet",),
    quick_start=(QuickChoice("wan21-t2v", "Wan 2.1 text-to-video (1.3B / 14B; clips and images)",
                             {"lora": "wan21-t2v-lora"}),
                 QuickChoice("wan22-ti2v-5b", "Wan 2.2 TI2V-5B (text-to-video; clips and images)",
                             {"lora": "wan22-ti2v-5b-lora"}),
                 QuickChoice("wan22-t2v-a14b", "Wan 2.2 T2V A14B (one expert a run: model.wan_expert)",
                             {"lora": "wan22-t2v-a14b-lora"}),
                 QuickChoice("wan21-i2v", "Wan 2.1 I2V 14B (image-to-video: clips start from their first frame)",
                             {"lora": "wan21-i2v-lora"}),
                 QuickChoice("wan22-i2v-a14b", "Wan 2.2 I2V A14B (image-to-video, one expert a run)",
                             {"lora": "wan22-i2v-a14b-lora"})),
    own_fields=("model.wan_expert",),
    # WanPipeline's __call__ defaults: 50 steps, CFG 5, 81 frames (5 s at 16 fps)
    # (WanImageToVideoPipeline's are the same)
    sample_defaults={v: SampleDefaults(50, 5.0, "", "WanImageToVideoPipeline" if v in IMAGE_TO_VIDEO else "WanPipeline",
                                       frames=81) for v in VARIANTS + (T2V_14B,)},
    video=VideoSpec(frame_multiple=4, fps=16.0, max_frames=81),
    video_fps={"wan22-ti2v-5b": 24.0},  # the 5B was trained (and samples) at 24 fps
    start_image=IMAGE_TO_VIDEO,  # WanImageToVideoPipeline's image: each sample prompt names its start frame
)
