"""Tiny PixArt-Σ (``tiny-pixart``) and PixArt-α 1024 (``tiny-pixart-alpha``) with seeded random weights, in the
layouts people download: a diffusers ``PixArtSigmaPipeline``/``PixArtAlphaPipeline`` folder and the original
single file (transformer only). The real topology (adaLN-single DiT blocks with self- and cross-attention,
learned σ output, T5 caption projection; α adds the size/aspect-ratio embedders and ``sample_size`` 128, which
is what makes diffusers' α pipeline pass them) at width 16 (α 24), a T5 tokenizer built offline, a 4-channel VAE
with the SD (α) or SDXL (Σ) latent scale. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKL,
    DPMSolverMultistepScheduler,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
)
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.pixart.keys import diffusers_to_original

TINY_VERSION = 1


def build_tiny_pipeline(folder: Path, seed: int = 0, alpha: bool = False):
    write_tiny_t5_tokenizer(folder / "tokenizer", max_length=64)
    tokenizer = T5TokenizerFast.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = PixArtTransformer2DModel(
            # α's size and aspect-ratio embedders are width // 3 each (1152 = 3 × 384): a width of 24, not 16
            num_attention_heads=2, attention_head_dim=12 if alpha else 8, in_channels=4, out_channels=8, num_layers=2,
            cross_attention_dim=24 if alpha else 16, caption_channels=32, sample_size=128 if alpha else 32,
            patch_size=2, attention_bias=True, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, use_additional_conditions=alpha,
            interpolation_scale=2 if alpha else 1)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=4, norm_num_groups=8, sample_size=64,
                            scaling_factor=0.18215 if alpha else 0.13025)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    scheduler = DPMSolverMultistepScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                                            num_train_timesteps=1000, prediction_type="epsilon")
    pipe_cls = PixArtAlphaPipeline if alpha else PixArtSigmaPipeline
    return pipe_cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                    scheduler=scheduler)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <pipeline folder>, "single_file": <original-layout .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, lambda tokenizers: build_tiny_pipeline(
        tokenizers, alpha=kind.endswith("alpha")), diffusers_to_original)
