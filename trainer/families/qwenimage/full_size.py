"""Full-size configs of Qwen-Image (Qwen/Qwen-Image) and its edit models (Qwen/Qwen-Image-Edit, -2509, -2511: the same
transformer, VAE and Qwen2.5-VL; 2511's transformer has ``zero_cond_t``): see :mod:`trainer.families.common.full_size`.
The edit models' config folders keep the tiny model's ``processor/`` (the real image processor settings)."""

from trainer.families.common.full_size import QWEN25_VL_7B, QWEN_IMAGE_VAE, QWEN_MAX_LENGTH

TRANSFORMER = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
               "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
               "axes_dims_rope": [16, 56, 56]}


def _spec(tiny: str, **transformer) -> dict:
    return {"tiny": tiny, "configs": {"transformer": dict(TRANSFORMER, **transformer), "vae": QWEN_IMAGE_VAE,
                                      "text_encoder": QWEN25_VL_7B},
            "max_length": {"tokenizer": QWEN_MAX_LENGTH}}


FULL_SIZE = {
    "qwen-image": _spec("tiny-qwen-image"),
    "qwen-image-edit": _spec("tiny-qwen-image-edit", zero_cond_t=False),
    "qwen-image-edit-2509": _spec("tiny-qwen-image-edit-2509", zero_cond_t=False),
    "qwen-image-edit-2511": _spec("tiny-qwen-image-edit-2511", zero_cond_t=True),
}
