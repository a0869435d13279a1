"""A tiny ERNIE-Image model with seeded random weights (``builtin:tiny-ernie-image``), in the layouts people download:
a diffusers ``ErnieImagePipeline`` folder and the transformer as one file (the original layout is diffusers' own
names). The real topology (a 1×1 patch embedding of the 128 patchified latent channels, text projected into the
image stream, one shared AdaLN modulation for every block, q/k RMSNorm, 3-axis RoPE with the image placed after each
caption's real tokens, a gated-GELU MLP, an AdaLN-continuous final norm; a Mistral3 model with its Pixtral vision
tower, read at its second-to-last hidden state; the 32-channel Flux.2 VAE with its BatchNorm statistics) at widths
of 16–64, and a byte-level Mistral-style tokenizer built offline. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKLFlux2,
    ErnieImagePipeline,
    ErnieImageTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
)
from transformers import AutoTokenizer, Mistral3Config, Mistral3Model, MistralConfig, PixtralVisionConfig

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_mistral_tokenizer

TINY_VERSION = 1
# baidu/ERNIE-Image scheduler/scheduler_config.json: a fixed shift of 4 (ai-toolkit trains at 3)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 4.0, "use_dynamic_shifting": False}


def _vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(16, 32), layers_per_block=1, latent_channels=32, norm_num_groups=8,
                             sample_size=64)
    with torch.no_grad():  # a trained VAE: a narrow posterior and latent statistics of its own
        vae.quant_conv.weight[32:].zero_()
        vae.quant_conv.bias[32:].fill_(-9.0)
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def build_tiny_pipeline(folder: Path, seed: int = 0) -> ErnieImagePipeline:
    write_tiny_mistral_tokenizer(folder / "tokenizer", max_length=256)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ErnieImageTransformer2DModel(hidden_size=32, num_attention_heads=2, num_layers=2,
                                                   ffn_hidden_size=64, in_channels=128, out_channels=128,
                                                   text_in_dim=48, rope_axes_dim=(4, 6, 6))
        with torch.no_grad():  # the zero-initialised modulation and output layers of an untrained model
            for module in (transformer.adaLN_modulation[-1], transformer.final_linear):
                module.weight.normal_(0.0, 0.05)
                module.bias.normal_(0.0, 0.05)
        vae = _vae()
        text_encoder = Mistral3Model(Mistral3Config(
            text_config=MistralConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      max_position_embeddings=1024),
            vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=8, image_size=64, patch_size=8),
            spatial_merge_size=2, image_token_index=8))
    return ErnieImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <ErnieImagePipeline folder>, "single_file": <transformer .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, dict)
