"""Tiny Qwen-Image (``builtin:tiny-qwen-image``) with seeded random weights, in the layouts people download: a
diffusers ``QwenImagePipeline`` folder and the transformer as one file. The real topology (MMDiT blocks with their
own image/text modulation and q/k RMSNorm, 3-axis RoPE, a Qwen2.5-VL text model with its vision tower, the
Wan-style one-frame video VAE with per-channel latent statistics) at widths of 8–32, and a byte-level Qwen-style
tokenizer built offline. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer

TINY_VERSION = 1
# Qwen/Qwen-Image scheduler/scheduler_config.json: the resolution-dependent shift, exponential time shift
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "time_shift_type": "exponential"}


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=1024)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
        with torch.no_grad():  # a trained VAE's posterior is narrow; a random one's would bury the image in noise
            vae.quant_conv.weight[16:].zero_()  # the log-variance half of the posterior
            vae.quant_conv.bias[16:].fill_(-9.0)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                             bos_token_id=None, eos_token_id=None, pad_token_id=None),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               fullatt_block_indexes=[0])))
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <QwenImagePipeline folder>, "single_file": <transformer .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, dict)
