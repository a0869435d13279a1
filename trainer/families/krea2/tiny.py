"""Tiny Krea 2 models with seeded random weights (``builtin:tiny-krea2``, ``builtin:tiny-krea2-turbo``), in the layouts
people download: a diffusers ``Krea2Pipeline`` folder and the transformer as the original single file. The real
topology (text fusion across the tapped layers then across tokens, single-stream blocks with grouped keys/values, q/k
RMSNorm, an attention gate and per-block modulation tables, 3-axis RoPE; a Qwen3-VL model with its vision tower whose
hidden layers are tapped; the Qwen-Image one-frame video VAE with per-channel latent statistics) at widths of 16–32,
and a byte-level Qwen-style tokenizer built offline. The turbo folder is the same weights with the pipeline's
``is_distilled`` set, as the released turbo folder differs from the raw one. Built without touching torch's global
RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLModel

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.krea2.keys import diffusers_to_original

TINY_VERSION = 2
# the Krea2Pipeline docstring's scheduler: the resolution-aware exponential time shift
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 6400, "time_shift_type": "exponential"}
SELECT_LAYERS = (1, 2)  # the tapped hidden states of the 2-layer text model (the real model taps 12 of 36)


def _text_encoder(vocab: int) -> Qwen3VLModel:
    return Qwen3VLModel(Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           deepstack_visual_indexes=[], num_position_embeddings=16)))


def _vae() -> AutoencoderKLQwenImage:
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    with torch.no_grad():  # a trained VAE's posterior is narrow; a random one's would bury the image in noise
        vae.quant_conv.weight[16:].zero_()  # the log-variance half of the posterior
        vae.quant_conv.bias[16:].fill_(-9.0)
    return vae


def build_tiny_pipeline(folder: Path, distilled: bool = False, seed: int = 0) -> Krea2Pipeline:
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=256)  # the text length the tiny model trains at
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Krea2Transformer2DModel(
            in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=len(SELECT_LAYERS),
            text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
            num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
        with torch.no_grad():  # the zero-initialised modulation and norm tables of an untrained model: small values
            for name, p in transformer.named_parameters():
                if name.endswith(("scale_shift_table", "norm.weight", "norm1.weight", "norm2.weight")):
                    p.normal_(0.0, 0.1)
        vae = _vae()
        text_encoder = _text_encoder(len(tokenizer))
    return Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                         text_encoder_select_layers=SELECT_LAYERS, is_distilled=distilled)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <Krea2Pipeline folder>, "single_file": <original .safetensors>}``."""
    distilled = kind == "tiny-krea2-turbo"
    return store_tiny(kind, root, TINY_VERSION, lambda folder: build_tiny_pipeline(folder, distilled),
                      diffusers_to_original)
