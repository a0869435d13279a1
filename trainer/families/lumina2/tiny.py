"""Tiny Lumina 2 (``builtin:tiny-lumina2``) with seeded random weights, in the layouts people download: a diffusers
``Lumina2Pipeline`` folder and the original single file of the transformer. The real topology (context and noise
refiners, single-stream layers with q/k norm and grouped keys/values, 3-axis RoPE, a Gemma-2 text model read at its
second-to-last layer, the Flux VAE's 16 channels) at widths of 32, and a Gemma-style tokenizer (``<bos>`` first,
``▁`` for spaces, as transformers' ``GemmaTokenizer`` normalises them) built offline. Built without touching torch's
global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_gemma_tokenizer
from trainer.families.lumina2.keys import diffusers_to_original

TINY_VERSION = 1
# Lumina-Image-2.0's scheduler: flow matching with a fixed shift (a real folder's scheduler config decides)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False}
def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_gemma_tokenizer(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Lumina2Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(300, 64, 64),
            cap_feat_dim=32)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=64, pad_token_id=0,
            bos_token_id=2, eos_token_id=1))
    return Lumina2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                           text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <Lumina2Pipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
