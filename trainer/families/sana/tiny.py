"""Tiny Sana (``builtin:tiny-sana``) with seeded random weights, in the layouts people download: a diffusers
``SanaPipeline`` folder and the original single file of the transformer. The real topology at widths of 32: Sana 1.5's
linear-attention blocks (q/k RMS norms across heads, cross-attention to Gemma features, Mix-FFN convolutions), a
DC-AE with ResBlock and EfficientViT stages and 32 latent channels (3 stages: ×4, not the real ×32, so 64 px samples
keep a 16² latent), Gemma-2 read at its last layer, the pipeline's flow DPM-Solver with Sana's shift of 3, and a
Gemma-style tokenizer built offline: bytes, plus each word of the pipeline's instruction preamble as one token, so the
preamble is 363 tokens (spaces apart; Gemma's own tokenizer needs fewer) rather than 1,058 bytes (the VRAM estimate
reads this tokenizer). Built without touching torch's global RNG."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_gemma_tokenizer
from trainer.families.sana.family import INSTRUCTION
from trainer.families.sana.keys import diffusers_to_original

TINY_VERSION = 2
# Efficient-Large-Model/Sana_1600M_1024px_diffusers scheduler/scheduler_config.json (the values that matter)
SCHEDULER = {"flow_shift": 3.0, "use_flow_sigmas": True, "prediction_type": "flow_prediction",
             "num_train_timesteps": 1000}


def write_tiny_sana_tokenizer(folder: Path) -> None:
    """Lumina 2's tiny Gemma tokenizer (gemma-2-2b-it's model_max_length) with the preamble's words as whole tokens."""
    write_tiny_gemma_tokenizer(folder, max_length=8192)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = sorted({w for line in INSTRUCTION for w in re.findall(r"[A-Za-z']+", line)})
    tok.add_tokens([AddedToken(w, single_word=True) for w in words])
    tok.save(str(folder / "tokenizer.json"))


def build_tiny_pipeline(folder: Path, seed: int = 0) -> SanaPipeline:
    write_tiny_sana_tokenizer(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SanaTransformer2DModel(
            in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
            mlp_ratio=2.5, sample_size=32, patch_size=1, qk_norm="rms_norm_across_heads")
        vae = AutoencoderDC(
            in_channels=3, latent_channels=32, attention_head_dim=8,
            encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 16, 32), decoder_block_out_channels=(8, 16, 32),
            encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
            encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
            downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
            decoder_act_fns="silu", scaling_factor=0.41407)
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, sliding_window=4096, pad_token_id=0,
            bos_token_id=2, eos_token_id=1))
    return SanaPipeline(scheduler=DPMSolverMultistepScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <SanaPipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
