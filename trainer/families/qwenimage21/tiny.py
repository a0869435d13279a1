"""Tiny Qwen-Image 2.1 models with seeded random weights (``builtin:tiny-qwen-image-21``,
``builtin:tiny-qwen-image-21-turbo``), in the layouts people download: a diffusers ``QwenImage21Pipeline`` folder (its
``processor/`` as the real repo has it) and the transformer as the original single file. The real topology at widths
of 16–32: the single-stream block-causal transformer with its shared modulation and 3-axis RoPE, a Qwen3-VL model with
its vision tower, the 64-channel-style VAE with four 2× stages (16× as the pipeline assumes, RGBA in and out) and
16 latent channels, and a byte-level Qwen-style tokenizer with the vision tokens, built offline. The Turbo folder is
the same weights with a shipped ``sample_sigmas``, as the released Turbo folder differs from the base one. Built
without touching torch's global RNG."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
from diffusers import QwenImage21Transformer2DModel
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.qwenimage21.keys import diffusers_to_original
from trainer.families.qwenimage21.processor import CHAT_TEMPLATE, IMAGE_CONFIG, build_processor

TINY_VERSION = 2
# QwenImage21Pipeline's scheduler: flow matching with the image-size μ (Qwen-Image's settings)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "time_shift_type": "exponential"}
TURBO_SIGMAS = [1.0, 0.95, 0.9, 0.8, 0.65, 0.5, 0.35, 0.2]
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TRANSFORMER = {"in_channels": 16, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "context_in_dim": 32, "mlp_ratio": 2, "axes_dims_rope": (4, 6, 6)}


def _text_encoder(tokenizer) -> Qwen3VLForConditionalGeneration:
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           deepstack_visual_indexes=[], num_position_embeddings=16, patch_size=16), **ids))


def _vae() -> AutoencoderKLQwenImage21:
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False] * 4,
                                   latents_mean=[0.1 * (i % 5) for i in range(16)],
                                   latents_std=[1.0 + 0.1 * (i % 3) for i in range(16)])
    with torch.no_grad():  # a trained VAE's posterior is narrow; a random one's would bury the image in noise
        vae.quant_conv.weight[16:].zero_()
        vae.quant_conv.bias[16:].fill_(-9.0)
    return vae


def build_tiny_pipeline(folder: Path, turbo: bool = False, seed: int = 0) -> QwenImage21Pipeline:
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=1024, extra_special=VISION_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    tokenizer.chat_template = CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImage21Transformer2DModel(**TRANSFORMER)
        vae = _vae()
        text_encoder = _text_encoder(tokenizer)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                               text_encoder=text_encoder, processor=build_processor(tokenizer),
                               transformer=transformer, sample_sigmas=TURBO_SIGMAS if turbo else None)
    pipe.register_modules(processor=None)  # written by write_processor: this processor has no save of its own
    return pipe


def write_processor(folder: Path, tokenizer_folder: Path) -> None:
    """``processor/`` as the real repo has it (the tokenizer's files, the image processor's settings), and
    ``model_index.json`` naming it."""
    target = folder / "processor"
    shutil.copytree(tokenizer_folder, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (target / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG, indent=2) + "\n", encoding="utf-8")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    shutil.copytree(target, folder / "tokenizer")  # what a component loader reads as the processor's tokenizer
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <QwenImage21Pipeline folder>, "single_file": <original .safetensors>}``."""
    turbo = kind == "tiny-qwen-image-21-turbo"
    saved: Dict[str, Path] = {}

    def build(tokenizers: Path) -> QwenImage21Pipeline:
        saved["tokenizers"] = tokenizers
        return build_tiny_pipeline(tokenizers, turbo)

    def extras(folder: Path) -> None:  # the tokenizer folder is gone by now: rebuild its files
        write_tiny_qwen_tokenizer(folder / ".tok", max_length=1024, extra_special=VISION_TOKENS)
        write_processor(folder, folder / ".tok")
        shutil.rmtree(folder / ".tok")

    return store_tiny(kind, root, TINY_VERSION, build, diffusers_to_original, extras=extras)
