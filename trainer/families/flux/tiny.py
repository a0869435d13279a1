"""Tiny Flux.1 models with seeded random weights, in the layouts people download: a diffusers
``FluxPipeline`` folder and the BFL single file (transformer only, as ``flux1-dev.safetensors``).

``builtin:tiny-flux`` (dev: guidance embedding, resolution-dependent shift), ``builtin:tiny-flux-schnell`` and
``builtin:tiny-flux-kontext`` (dev's layout under a ``model_index.json`` naming ``FluxKontextPipeline``, as
black-forest-labs/FLUX.1-Kontext-dev; its single file has dev's keys). The real topology (double and single blocks,
16-channel VAE with shift and scale, CLIP-L pooled + T5 hidden states) at widths of 32, so the real loading, packing
and key maps run in tests and the offline demo. Built without touching torch's global RNG.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline,
                       FluxTransformer2DModel)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

from trainer.families.common.sd_kit.tiny import write_tiny_tokenizer
from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.flux.keys import diffusers_to_bfl

TINY_VERSION = 1


def build_tiny_pipeline(kind: str = "tiny-flux", seed: int = 0, folder: Path = None):
    """The tiny FluxPipeline (FluxKontextPipeline for ``tiny-flux-kontext``) in memory (tokenizers are written to
    ``folder``/tokenizer*). Kontext's weights are dev's (the same seed): only the pipeline differs."""

    dev = kind in ("tiny-flux", "tiny-flux-kontext")
    write_tiny_tokenizer(folder / "tokenizer")
    write_tiny_t5_tokenizer(folder / "tokenizer_2")
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    tokenizer_2 = T5TokenizerFast.from_pretrained(str(folder / "tokenizer_2"))
    sched = json.loads((Path(__file__).parent / "configs" / ("flux-dev" if dev else "flux-schnell")
                        / "scheduler" / "scheduler_config.json").read_text())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=dev, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    pipeline_cls = FluxKontextPipeline if kind == "tiny-flux-kontext" else FluxPipeline
    pipe = pipeline_cls(scheduler=FlowMatchEulerDiscreteScheduler.from_config(sched), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                        tokenizer_2=tokenizer_2, transformer=transformer)
    return pipe


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <FluxPipeline or FluxKontextPipeline folder>, "single_file": <BFL transformer
    .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, lambda tokenizers: build_tiny_pipeline(kind, folder=tokenizers),
                      diffusers_to_bfl)
