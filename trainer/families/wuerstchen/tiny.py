"""Tiny Würstchen 2 (``builtin:tiny-wuerstchen``) with seeded random weights: a diffusers combined pipeline folder
(prior, its CLIP-G text encoder, the DiffNeXt decoder, the Paella VQGAN, as ``WuerstchenCombinedPipeline.
save_pretrained`` writes them) with its EfficientNet encoder as ``effnet_encoder.safetensors`` beside them, and the
prior alone as one file. The real topology at widths of 16–32. Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import DDPMWuerstchenScheduler, WuerstchenCombinedPipeline
from transformers import CLIPTokenizer

from trainer.families.common.cascade_kit import fill_zero_weights, tiny_clip, wuerstchen_class
from trainer.families.common.effnet import save_effnet, tiny_effnet
from trainer.families.common.sd_kit.tiny import write_tiny_tokenizer
from trainer.families.common.tiny_store import store_tiny

TINY_VERSION = 1


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_tokenizer(folder / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        prior = wuerstchen_class("WuerstchenPrior")(c_in=16, c=32, c_cond=32, c_r=64, depth=2, nhead=2, dropout=0.0)
        decoder = wuerstchen_class("WuerstchenDiffNeXt")(
            c_in=4, c_out=4, c_r=64, patch_size=2, c_cond=32, c_hidden=[16, 32], nhead=[-1, 2], blocks=[1, 1],
            level_config=["CT", "CTA"], inject_effnet=[False, True], effnet_embd=16, clip_embd=32, kernel_size=3,
            dropout=0.0)
        vqgan = wuerstchen_class("PaellaVQModel")(in_channels=3, out_channels=3, up_down_scale_factor=2, levels=2,
                                                  bottleneck_blocks=1, embed_dim=16, latent_channels=4,
                                                  num_vq_embeddings=64, scale_factor=0.3764)
        fill_zero_weights(prior, decoder, vqgan)
        prior_text = tiny_clip(tokenizer, projection=False)
        decoder_text = tiny_clip(tokenizer, projection=False)
    return WuerstchenCombinedPipeline(
        tokenizer=tokenizer, text_encoder=decoder_text, decoder=decoder, scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan, prior_tokenizer=tokenizer, prior_text_encoder=prior_text, prior_prior=prior,
        prior_scheduler=DDPMWuerstchenScheduler())


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <combined pipeline folder>, "single_file": <prior .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, dict, denoiser=lambda pipe: pipe.prior_prior,
                      extras=lambda folder: save_effnet(_tiny_encoder(), folder / "effnet_encoder.safetensors"))


def _tiny_encoder():
    """Würstchen 2's encoder ends in an affine BatchNorm whose outputs the prior sees as (x + 1) / 42: scaled so
    that the tiny one's latents have the spread of the real ones (about unit variance), not 1/42 of it."""

    encoder = tiny_effnet(c_latent=16, affine=True, seed=1)
    with torch.no_grad():
        encoder.mapper[1].weight.fill_(42.0)
        encoder.mapper[1].bias.fill_(-1.0)
    return encoder
