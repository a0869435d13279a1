"""Tiny Stable Diffusion 3.5 medium-shaped model (``builtin:tiny-sd3``) with seeded random weights, in the layouts
people download: a diffusers ``StableDiffusion3Pipeline`` folder and Stability's single file of the transformer.
The real topology (joint MMDiT blocks with q/k RMSNorm, a dual-attention first block as in 3.5 medium, the last
block's context stream pre-only, CLIP-L and CLIP-G with projections, T5, a 16-channel VAE with SD3's latent shift
and scale) at widths of 16–32. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from trainer.families.common.sd_kit.tiny import write_tiny_tokenizer
from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.sd3.keys import ORIGINAL_PREFIX, diffusers_to_original

TINY_VERSION = 1


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_tokenizer(folder / "tokenizer")
    write_tiny_tokenizer(folder / "tokenizer_2")
    write_tiny_t5_tokenizer(folder / "tokenizer_3")
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    tokenizer_2 = CLIPTokenizer.from_pretrained(str(folder / "tokenizer_2"))
    tokenizer_3 = T5TokenizerFast.from_pretrained(str(folder / "tokenizer_3"))

    def clip() -> CLIPTextModelWithProjection:  # 16 wide: CLIP-L ‖ CLIP-G = 32 = T5's width, as 768 + 1280 ≤ 4096
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=77, projection_dim=16, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
            pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0,))
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=1.5305,
                            shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
        with torch.no_grad():  # a trained VAE's posterior is narrow (std ~0.01): a random one's (std ~1) would bury
            vae.encoder.conv_out.weight[16:].zero_()  # the image under sampling noise in every training latent
            vae.encoder.conv_out.bias[16:].fill_(-9.0)
        text_encoder, text_encoder_2 = clip(), clip()
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <StableDiffusion3Pipeline folder>, "single_file": <MMDiT .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline,
                      lambda state: {ORIGINAL_PREFIX + k: v for k, v in diffusers_to_original(state).items()})
