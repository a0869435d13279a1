"""Tiny Stable Cascade (``builtin:tiny-cascade``) with seeded random weights, in the layouts people have: a
diffusers combined pipeline folder (prior, its CLIP-G text encoder, decoder stage B, VQGAN stage A, as
``StableCascadeCombinedPipeline.save_pretrained`` writes them) with ``effnet_encoder.safetensors`` beside them (as
in stabilityai/stable-cascade), and the stage C single file in the original layout. The real topology (ResBlock /
TimestepBlock with sca+crp / AttnBlock levels, CLIP text, pooled and image mappers; stage B with effnet and pixel
mappers; Paella VQGAN; an EfficientNetV2-shaped encoder) at widths of 16–32. Built without touching torch's
global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import DDPMWuerstchenScheduler, StableCascadeCombinedPipeline, StableCascadeUNet
from transformers import CLIPTokenizer

from trainer.families.common.cascade_keys import diffusers_to_original
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
        prior = StableCascadeUNet(
            in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1, conditioning_dim=32,
            block_out_channels=(32, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1), clip_text_in_channels=32, clip_text_pooled_in_channels=32,
            clip_image_in_channels=32, clip_seq=4, kernel_size=3, dropout=(0.0, 0.0), self_attn=True,
            timestep_conditioning_type=("sca", "crp"), switch_level=(False,))
        decoder = StableCascadeUNet(
            in_channels=4, out_channels=4, timestep_ratio_embedding_dim=64, patch_size=2, conditioning_dim=32,
            block_out_channels=(16, 32), num_attention_heads=(0, 2), down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
            block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                                   ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock")),
            clip_text_pooled_in_channels=32, effnet_in_channels=16, pixel_mapper_in_channels=3, kernel_size=3,
            dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca",), switch_level=None)
        vqgan = wuerstchen_class("PaellaVQModel")(in_channels=3, out_channels=3, up_down_scale_factor=2, levels=2,
                                                  bottleneck_blocks=1, embed_dim=16, latent_channels=4,
                                                  num_vq_embeddings=64, scale_factor=0.3764)
        fill_zero_weights(prior, decoder, vqgan)
        prior_text = tiny_clip(tokenizer, projection=True)
        decoder_text = tiny_clip(tokenizer, projection=True)
    return StableCascadeCombinedPipeline(
        tokenizer=tokenizer, text_encoder=decoder_text, decoder=decoder, scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan, prior_prior=prior, prior_text_encoder=prior_text, prior_tokenizer=tokenizer,
        prior_scheduler=DDPMWuerstchenScheduler())


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <combined pipeline folder>, "single_file": <stage C .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original,
                      denoiser=lambda pipe: pipe.prior_prior,
                      extras=lambda folder: save_effnet(tiny_effnet(c_latent=16, affine=False, seed=1),
                                                        folder / "effnet_encoder.safetensors"))
