"""Full-size configs of Krea 2 (krea/Krea-2-Raw; Turbo is the same model with the pipeline's ``is_distilled``): see
:mod:`trainer.families.common.full_size`. The transformer is the released config (``keys.CONFIG``: diffusers'
``Krea2Transformer2DModel`` defaults, ai-toolkit's ``single_mmdit_large_wide``); the VAE is Qwen-Image's
(``QWEN_IMAGE_VAE``); the text encoder is Qwen/Qwen3-VL-4B-Instruct's config.json (its vision tower included, as the
pipeline loads it)."""

from trainer.families.common.full_size import QWEN_IMAGE_VAE, QWEN_MAX_LENGTH
from trainer.families.krea2.keys import CONFIG

# Qwen/Qwen3-VL-4B-Instruct config.json
QWEN3_VL_4B = {
    "text_config": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
                    "rms_norm_eps": 1e-06,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]},
}
# Krea2Pipeline's default taps of Qwen3-VL-4B's 36 layers
SELECT_LAYERS = [2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35]


def _spec(tiny: str) -> dict:
    return {"tiny": tiny, "configs": {"transformer": {k: v for k, v in CONFIG.items() if k != "_class_name"},
                                      "vae": QWEN_IMAGE_VAE, "text_encoder": QWEN3_VL_4B},
            "model_index": {"text_encoder_select_layers": SELECT_LAYERS},
            "max_length": {"tokenizer": QWEN_MAX_LENGTH}}


FULL_SIZE = {"krea2": _spec("tiny-krea2"), "krea2-turbo": _spec("tiny-krea2-turbo")}
