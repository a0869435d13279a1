"""Tiny Chroma (``builtin:tiny-chroma``) with seeded random weights, in the layouts people download: a diffusers
``ChromaPipeline`` folder and the original single file of the transformer. The real topology (Flux double and
single blocks without modulation layers, the approximator that gives every block its modulation, T5 alone, a
16-channel VAE with Flux's latent shift and scale) at widths of 32. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from trainer.families.common.bfl_keys import diffusers_to_bfl
from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer

TINY_VERSION = 1
# lodestones/Chroma1-HD scheduler/scheduler_config.json: Flux dev's resolution-dependent shift
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_t5_tokenizer(folder / "tokenizer")
    tokenizer = T5TokenizerFast.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
            approximator_hidden_dim=32, approximator_layers=1)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)),
                          vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <ChromaPipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_bfl)
