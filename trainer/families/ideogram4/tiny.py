"""Tiny Ideogram 4 (``builtin:tiny-ideogram4``) with seeded random weights, in the layouts people download: a diffusers
``Ideogram4Pipeline`` folder (its conditional and unconditional transformers, the Flux.2 VAE with its BatchNorm
statistics, a Qwen3-VL text encoder and tokenizer) and the original single file of the conditional transformer.

The real topology at small widths: Qwen3-VL keeps its 36 decoder layers (the pipeline reads 13 of them by index, up to
layer 35), 16 wide, so the transformer's text input is 13 × 16 = 208 features; the transformer has two blocks with the
real 3-axis interleaved MRoPE; the VAE the Flux.2 one with 8 latent channels (patchified 2×2: 32 per token). The
tokenizer is byte-level with Qwen's special tokens and Qwen3-VL's chat template cut to text turns. Built without
touching torch's global RNG."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Ideogram4Pipeline,
    Ideogram4Transformer2DModel,
)
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLModel

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.ideogram4.keys import diffusers_to_original

TINY_VERSION = 1
# the pipeline sets its own σ schedule (resolution-aware logit-normal); the scheduler only steps
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}
# Qwen3-VL's chat template for text-only turns (content a string or a list of {"type": "text"} parts)
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is string "
    "%}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
TRANSFORMER = {"in_channels": 32, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
               "intermediate_size": 64, "adaln_dim": 16, "llm_features_dim": 13 * 16, "rope_theta": 10000,
               "mrope_section": [4, 2, 2]}


def write_tokenizer(folder: Path) -> None:
    write_tiny_qwen_tokenizer(folder, max_length=512)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tokenizer(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Ideogram4Transformer2DModel(**TRANSFORMER)
        unconditional = Ideogram4Transformer2DModel(**TRANSFORMER)
        vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                                 block_out_channels=(16, 16), layers_per_block=1, latent_channels=8, norm_num_groups=8,
                                 sample_size=32)
        with torch.no_grad():  # a trained VAE: a narrow posterior and latent statistics of its own
            vae.quant_conv.weight[8:].zero_()
            vae.quant_conv.bias[8:].fill_(-9.0)
            vae.bn.running_mean.normal_(0.0, 0.1)
            vae.bn.running_var.uniform_(0.5, 2.0)
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config={"vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32,
                         "num_hidden_layers": 36, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                         "max_position_embeddings": 1024,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": 16, "deepstack_visual_indexes": [0], "patch_size": 8,
                           "num_position_embeddings": 64}))
    return Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                             unconditional_transformer=unconditional)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <Ideogram4Pipeline folder>, "single_file": <conditional transformer, original
    layout>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
