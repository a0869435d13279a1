"""Full-size configs of Qwen-Image 2.1 (Qwen/Qwen-Image-2.1): see :mod:`trainer.families.common.full_size`. The
transformer and the VAE are their diffusers classes' defaults (documented as the released model's); the text encoder
is Qwen/Qwen3-VL-8B-Instruct's config.json (4096 wide, the transformer's ``context_in_dim``), its vision tower
included as the pipeline loads it."""

import inspect

from diffusers import AutoencoderKLQwenImage21

from trainer.families.common.full_size import QWEN_MAX_LENGTH
from trainer.families.qwenimage21.keys import CONFIG

TRANSFORMER = {k: v for k, v in CONFIG.items() if k != "_class_name"}
# AutoencoderKLQwenImage21's defaults, every one of them: the values are laid over the tiny VAE's config
VAE = {name: p.default for name, p in inspect.signature(AutoencoderKLQwenImage21.__init__).parameters.items()
       if p.default is not inspect.Parameter.empty}
QWEN3_VL_8B = {
    "text_config": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
}

FULL_SIZE = {v: {
    "tiny": f"tiny-{v}",
    "configs": {"transformer": TRANSFORMER, "vae": VAE, "text_encoder": QWEN3_VL_8B},
    "max_length": {"processor": QWEN_MAX_LENGTH},
} for v in ("qwen-image-21", "qwen-image-21-turbo")}
