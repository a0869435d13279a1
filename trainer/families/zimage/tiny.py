"""Tiny Z-Image (``builtin:tiny-zimage``) with seeded random weights, in the layouts people download: a diffusers
``ZImagePipeline`` folder and the original single file of the transformer. The real topology (noise and context
refiners, single-stream layers with q/k norm and grouped keys/values, 3-axis RoPE, a Qwen3 text model read at its
second-to-last layer through a chat template, the Flux VAE's 16 channels) at widths of 32, and a byte-level
Qwen-style tokenizer built offline. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.zimage.keys import diffusers_to_original

TINY_VERSION = 1
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}  # Z-Image-Turbo's


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_qwen_tokenizer(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False))
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <ZImagePipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
