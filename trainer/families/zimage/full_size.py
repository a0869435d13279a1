"""Full-size configs of Z-Image (Tongyi-MAI/Z-Image-Turbo): see :mod:`trainer.families.common.full_size`."""

from trainer.families.common.full_size import FLUX_VAE, QWEN3_4B, QWEN_MAX_LENGTH

FULL_SIZE = {"z-image": {
    "tiny": "tiny-zimage",
    "configs": {"transformer": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840,
                                "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
                                "norm_eps": 1e-05, "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0,
                                "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512]},
                "vae": FLUX_VAE, "text_encoder": QWEN3_4B},
    "max_length": {"tokenizer": QWEN_MAX_LENGTH},
}}
