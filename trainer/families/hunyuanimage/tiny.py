"""A tiny HunyuanImage 2.1 model with seeded random weights (``builtin:tiny-hunyuan-image``), in the layouts people
download: a diffusers ``HunyuanImagePipeline`` folder (with its adaptive projected guider) and the transformer as
Tencent's original single file. The real topology (dual- then single-stream blocks with q/k RMSNorm, the token refiner
over Qwen2.5-VL features, the ByT5 glyph projection, 2-axis RoPE; a Qwen2.5-VL model with its vision tower whose third
last hidden layer is read; a ByT5 encoder; the 2-D VAE whose latents are only scaled) at widths of 16–32, the VAE at 4×
instead of 32× (a 64 px image is then 16×16 latents), and offline tokenizers (byte-level Qwen-style, ByT5's bytes).
Built without touching torch's global RNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AdaptiveProjectedMixGuidance,
    AutoencoderKLHunyuanImage,
    FlowMatchEulerDiscreteScheduler,
    HunyuanImagePipeline,
    HunyuanImageTransformer2DModel,
)
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
)

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
from trainer.families.hunyuanimage.keys import diffusers_to_original

TINY_VERSION = 3
# hunyuanvideo-community/HunyuanImage-2.1-Diffusers scheduler/scheduler_config.json: a fixed shift of 5
SCHEDULER = {"num_train_timesteps": 1000, "shift": 5.0, "use_dynamic_shifting": False}
SCALING = 0.75289  # the released VAE's scaling_factor (ComfyUI's HunyuanImage21 latent format too)


def _text_encoder(vocab: int) -> Qwen2_5_VLForConditionalGeneration:
    # 3 layers: the pipeline reads hidden_states[-3], a layer's output and not the embeddings
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0])))


def build_tiny_pipeline(folder: Path, seed: int = 0) -> HunyuanImagePipeline:
    # 350 tokens after the template's 34 (a byte-level tokenizer: a token a character)
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=384)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    ByT5Tokenizer().save_pretrained(str(folder / "tokenizer_2"))
    tokenizer_2 = ByT5Tokenizer.from_pretrained(str(folder / "tokenizer_2"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HunyuanImageTransformer2DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, rope_axes_dim=(8, 8))
        vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=8,
                                        block_out_channels=(32, 32, 32),
                                        layers_per_block=1, spatial_compression_ratio=4, sample_size=64,
                                        scaling_factor=SCALING)
        text_encoder = _text_encoder(len(tokenizer))
        text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=32,
                                                 num_layers=1, num_heads=2))
    return HunyuanImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                                text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                tokenizer_2=tokenizer_2, transformer=transformer,
                                guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5))


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <HunyuanImagePipeline folder>, "single_file": <original .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_original)
