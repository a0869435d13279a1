"""Tiny Qwen-Image models with seeded random weights, in the layouts people download: a diffusers pipeline folder and
the transformer as one file. The real topology (MMDiT blocks with their own image/text modulation and q/k RMSNorm,
3-axis RoPE, a Qwen2.5-VL text model with its vision tower, the Wan-style one-frame video VAE with per-channel latent
statistics) at widths of 8–32, and a byte-level Qwen-style tokenizer built offline. Built without touching torch's
global RNG.

- ``builtin:tiny-qwen-image``: ``QwenImagePipeline`` (a 2-level VAE: latents at half the pixel size).
- ``builtin:tiny-qwen-image-edit``, ``-2509``, ``-2511``: ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``
  folders with a ``processor/`` folder as the real ones have (tokenizer + ``preprocessor_config.json``), Qwen2.5-VL's
  vision tokens in the tokenizer and the text model's config, the VAE's real 8× downsampling (the pipelines resize
  control images to 1024² pixels: at 2× that would be 65 536 tokens a control), and for 2511 the transformer's
  ``zero_cond_t``; the 2511 single file carries ComfyUI's ``__index_timestep_zero__`` marker as its split file does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.qwenimage.detect import MARKER_2511
from trainer.families.qwenimage.vl import PROCESSOR_CONFIG

TINY_VERSION = 1
EDIT_TINY_VERSION = 1
# Qwen/Qwen-Image scheduler/scheduler_config.json: the resolution-dependent shift, exponential time shift
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "time_shift_type": "exponential"}
# Qwen2.5-VL's vision tokens (151652…151656 in the real vocabulary), after the tiny tokenizer's three specials
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
EDIT = {"tiny-qwen-image-edit": "qwen-image-edit", "tiny-qwen-image-edit-2509": "qwen-image-edit-2509",
        "tiny-qwen-image-edit-2511": "qwen-image-edit-2511"}


def _text_encoder(tokenizer, vision_ids: Dict[str, int]) -> Qwen2_5_VLForConditionalGeneration:
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]), **vision_ids))


def _vae(levels: int) -> AutoencoderKLQwenImage:
    dim_mult = [1, 2] if levels == 2 else [1, 2, 4, 4]
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=dim_mult, num_res_blocks=1,
                                 temperal_downsample=[False] if levels == 2 else [False, True, True])
    with torch.no_grad():  # a trained VAE's posterior is narrow; a random one's would bury the image in noise
        vae.quant_conv.weight[16:].zero_()  # the log-variance half of the posterior
        vae.quant_conv.bias[16:].fill_(-9.0)
    return vae


def _transformer(**extra) -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       axes_dims_rope=(4, 6, 6), **extra)


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=1024)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer()
        vae = _vae(levels=2)
        text_encoder = _text_encoder(tokenizer, {})
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_tiny_edit_pipeline(folder: Path, variant: str, seed: int = 0):
    """An edit pipeline without its processor (written beside it by :func:`write_processor`)."""
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=1024, extra_special=VISION_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                    "<|video_pad|>"])))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer(zero_cond_t=True) if variant == "qwen-image-edit-2511" else _transformer()
        vae = _vae(levels=4)
        text_encoder = _text_encoder(tokenizer, ids)
    cls = QwenImageEditPipeline if variant == "qwen-image-edit" else QwenImageEditPlusPipeline
    return cls(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
               text_encoder=text_encoder, tokenizer=tokenizer, processor=None, transformer=transformer)


def write_processor(folder: Path) -> None:
    """``processor/`` as the real edit repos have it (the tokenizer's files and the image processor's settings), and
    ``model_index.json`` naming it."""
    target = folder / "processor"
    shutil.copytree(folder / "tokenizer", target)
    (target / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n", encoding="utf-8")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <pipeline folder>, "single_file": <transformer .safetensors>}``."""
    variant = EDIT.get(kind)
    if variant is None:
        return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, dict)
    marker = {MARKER_2511: torch.zeros(0)} if variant == "qwen-image-edit-2511" else {}
    return store_tiny(kind, root, EDIT_TINY_VERSION, lambda folder: build_tiny_edit_pipeline(folder, variant),
                      lambda state: {**state, **marker}, extras=write_processor)
