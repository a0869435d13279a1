"""Tiny Wan models with seeded random weights, in the layouts people download: a diffusers ``WanPipeline`` folder and
the transformer as the original single file.

- ``builtin:tiny-wan21``: Wan 2.1 text-to-video.
- ``builtin:tiny-wan22-5b``: Wan 2.2 TI2V-5B: the pipeline's ``expand_timesteps`` (a timestep per token), the 2.2 VAE
  (48 latent channels, residual blocks, pixels patchified 2×2 first: 16× in space) with its 48 latent statistics,
  the scheduler's flow shift 5.
- ``builtin:tiny-wan22-a14b``: Wan 2.2 T2V A14B: two experts of the 2.1 architecture (``transformer`` for high noise,
  ``transformer_2`` for low noise, seeded apart) switched at ``boundary_ratio`` 0.875, the 2.1 VAE, flow shift 12
  (the official T2V inference shift); its single file is the high-noise expert.
- ``builtin:tiny-wan21-i2v``: Wan 2.1 I2V 14B: ``WanImageToVideoPipeline`` with a 36-channel transformer (noise ‖
  mask ‖ first-frame latents) that cross-attends to CLIP image features too (``image_dim``, ``add_k_proj``/
  ``add_v_proj``: ``img_emb``, ``k_img``/``v_img`` in its single file), a ``CLIPVisionModel`` image encoder and its
  ``CLIPImageProcessor`` (32 px here, 224 in the real one).
- ``builtin:tiny-wan22-i2v-a14b``: Wan 2.2 I2V A14B: two 36-channel experts without image features or image
  encoder, ``boundary_ratio`` 0.9, flow shift 5 (Wan2.2's i2v_A14B config: boundary 0.900, sample_shift 5.0).

The real topology
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
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    UMT5Config,
    UMT5EncoderModel,
)

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.wan.keys import diffusers_to_original

TINY_VERSION = 1
MAX_LENGTH = 512  # google/umt5-xxl's tokenizer, as Wan-AI's diffusers folders ship it
# WanPipeline's scheduler as diffusers' Wan docs configure it: UniPC over flow sigmas, flow_shift 3 (Wan's default)
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear",
             "beta_start": 0.0001, "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
             "final_sigmas_type": "zero", "flow_shift": 3.0, "lower_order_final": True, "num_train_timesteps": 1000,
             "predict_x0": True, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
             "sample_max_value": 1.0, "solver_order": 2, "solver_p": None, "solver_type": "bh2",
             "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace", "trained_betas": None,
             "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
             "use_karras_sigmas": False}


# Wan-AI/Wan2.2-TI2V-5B-Diffusers: its scheduler's shift; the VAE's 48 channel statistics are drawn here (the tiny
# VAE is random: any per-channel values exercise the normalisation)
SHIFT_22_5B = 5.0
SHIFT_22_A14B, BOUNDARY_A14B = 12.0, 0.875
SHIFT_I2V_A14B, BOUNDARY_I2V_A14B = 5.0, 0.9
I2V_CHANNELS = 36  # noise 16 ‖ mask 4 ‖ first-frame latents 16
CLIP_SIDE = 32  # the tiny image encoder's input size (ViT-H/14's is 224)


def _vae(wan22: bool) -> AutoencoderKLWan:
    if not wan22:
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                                temperal_downsample=[False, True, True])
    stats = torch.rand(2, 48)
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=16, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=[round(float(v) - 0.5, 4) for v in stats[0]],
                            latents_std=[round(float(v) + 0.5, 4) for v in stats[1]])


def _transformer(channels: int, out_channels: int = 0, image_dim: int = 0) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=channels,
        out_channels=out_channels or channels, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64, image_dim=image_dim or None,
        added_kv_proj_dim=32 if image_dim else None)


def _image_encoder() -> CLIPVisionModel:
    """CLIP ViT-H/14's layout (the penultimate layer's features feed the transformer) at width 32."""
    return CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=2, image_size=CLIP_SIDE, patch_size=16,
                                            hidden_act="gelu", projection_dim=32))


def build_tiny_i2v(folder: Path, seed: int = 0, experts: bool = False) -> WanImageToVideoPipeline:
    """Wan 2.1 I2V 14B's layout (CLIP image features), or with ``experts`` Wan 2.2 I2V A14B's (two experts, no image
    encoder)."""
    t2v = build_tiny_pipeline(folder, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer = _transformer(I2V_CHANNELS, 16, image_dim=0 if experts else 32)
        low = _transformer(I2V_CHANNELS, 16) if experts else None
        encoder = None if experts else _image_encoder()
    processor = None if experts else CLIPImageProcessor(
        size={"shortest_edge": CLIP_SIDE}, crop_size={"height": CLIP_SIDE, "width": CLIP_SIDE}, do_center_crop=True,
        resample=3, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    shift = SHIFT_I2V_A14B if experts else SCHEDULER["flow_shift"]
    return WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae, transformer=transformer,
        transformer_2=low, image_encoder=encoder, image_processor=processor,
        boundary_ratio=BOUNDARY_I2V_A14B if experts else None,
        scheduler=UniPCMultistepScheduler.from_config(dict(SCHEDULER, flow_shift=shift)))


def build_tiny_pipeline(folder: Path, seed: int = 0, wan22: bool = False, experts: bool = False) -> WanPipeline:
    """``wan22``: the TI2V-5B layout (48-channel latents, the 2.2 VAE, a timestep per token); ``experts``: A14B's two
    experts."""
    write_tiny_t5_tokenizer(folder / "tokenizer", max_length=MAX_LENGTH)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    channels = 48 if wan22 else 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer(channels)
        vae = _vae(wan22)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        low = _transformer(channels) if experts else None
    shift = SHIFT_22_5B if wan22 else SHIFT_22_A14B if experts else SCHEDULER["flow_shift"]
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       transformer_2=low, boundary_ratio=BOUNDARY_A14B if experts else None,
                       scheduler=UniPCMultistepScheduler.from_config(dict(SCHEDULER, flow_shift=shift)),
                       expand_timesteps=wan22)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <WanPipeline folder>, "single_file": <original .safetensors>}``."""
    wan22, experts = kind == "tiny-wan22-5b", kind in ("tiny-wan22-a14b", "tiny-wan22-i2v-a14b")
    if kind.endswith("-i2v") or kind.endswith("-i2v-a14b"):
        return store_tiny(kind, root, TINY_VERSION, lambda folder: build_tiny_i2v(folder, experts=experts),
                          diffusers_to_original)
    return store_tiny(kind, root, TINY_VERSION,
                      lambda folder: build_tiny_pipeline(folder, wan22=wan22, experts=experts), diffusers_to_original)
