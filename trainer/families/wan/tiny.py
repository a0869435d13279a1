"""Tiny Wan 2.1 text-to-video model (``builtin:tiny-wan21``) with seeded random weights, in the layouts people
download: a diffusers ``WanPipeline`` folder and the transformer as the original single file. The real topology
(a 3-D patch embedding over (1, 2, 2) patches, blocks with self-attention under 3-axis RoPE, cross-attention to UMT5
features with q/k RMSNorm across heads, per-block modulation tables; the causal 3-D VAE with its four levels, 8×
spatial and 4× temporal compression and per-channel latent statistics; a UMT5 encoder with its own relative-position
buckets per layer) at widths of 8–32, and a T5-style SentencePiece tokenizer built offline. Built without touching
torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.wan.keys import diffusers_to_original

TINY_VERSION = 1
MAX_LENGTH = 512  # google/umt5-xxl's tokenizer, as Wan-AI's diffusers folders ship it
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json: UniPC over flow sigmas, shift 3 (480p)
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear",
             "beta_start": 0.0001, "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
             "final_sigmas_type": "zero", "flow_shift": 3.0, "lower_order_final": True, "num_train_timesteps": 1000,
             "predict_x0": True, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
             "sample_max_value": 1.0, "solver_order": 2, "solver_p": None, "solver_type": "bh2",
             "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace", "trained_betas": None,
             "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
             "use_karras_sigmas": False}


def build_tiny_pipeline(folder: Path, seed: int = 0) -> WanPipeline:
    write_tiny_t5_tokenizer(folder / "tokenizer", max_length=MAX_LENGTH)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                               temperal_downsample=[False, True, True])
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler.from_config(dict(SCHEDULER)))


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <WanPipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
