"""Tiny Flux.2 [klein] (``builtin:tiny-flux2-klein``) and [dev] (``builtin:tiny-flux2-dev``) with seeded random
weights, in the layouts people download: a diffusers ``Flux2KleinPipeline`` / ``Flux2Pipeline`` folder and the
transformer as one file. [dev]: a guidance-embedding transformer over a tiny Mistral3 (text model read at three
layers, a Pixtral vision tower that the text path never runs) with a byte-level Mistral-style tokenizer. The real topology (double and single
blocks with shared modulation and fused single-block projections, 4-axis RoPE, a Qwen3 text model read at three
layers through its chat template, the 32-channel Flux.2 VAE with its BatchNorm statistics) at widths of 16–96,
and a byte-level Qwen-style tokenizer built offline. Built without touching torch's global RNG."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import (
    AutoTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_mistral_tokenizer, write_tiny_qwen_tokenizer
from trainer.families.flux2.keys import diffusers_to_bfl

TINY_VERSION = 2  # 2: the single file in BFL's layout, as the released files
# black-forest-labs/FLUX.2-klein-4B scheduler/scheduler_config.json: shift by resolution (the pipeline's μ)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "time_shift_type": "exponential"}


def _transformer_and_vae(guidance: bool):
    """The tiny transformer and the Flux.2 VAE (seeded by the caller): [dev]'s transformer embeds guidance."""
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=guidance)
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(16, 32), layers_per_block=1, latent_channels=32, norm_num_groups=8,
                             sample_size=64)
    with torch.no_grad():  # a trained VAE: a narrow posterior and latent statistics of its own
        vae.quant_conv.weight[32:].zero_()
        vae.quant_conv.bias[32:].fill_(-9.0)
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return transformer, vae


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_qwen_tokenizer(folder / "tokenizer", max_length=512)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, vae = _transformer_and_vae(guidance=False)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=False))
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_tiny_dev_pipeline(folder: Path, seed: int = 0):
    write_tiny_mistral_tokenizer(folder / "tokenizer", max_length=512)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, vae = _transformer_and_vae(guidance=True)
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=1024),
            vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=8, image_size=64, patch_size=8),
            spatial_merge_size=2, image_token_index=8))
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <Flux2KleinPipeline / Flux2Pipeline folder>, "single_file": <transformer
    .safetensors in BFL's layout, as BFL releases it>}``."""
    if kind == "tiny-flux2-dev":
        return store_tiny(kind, root, TINY_VERSION, build_tiny_dev_pipeline, diffusers_to_bfl, extras=_processor_layout)
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline, diffusers_to_bfl)


def _processor_layout(folder: Path) -> None:
    """As black-forest-labs/FLUX.2-dev keeps it: ``tokenizer/`` is a PixtralProcessor (model_index names it), with the
    image processor's config and the chat template beside the tokenizer's files."""
    tok = folder / "tokenizer"
    scratch = folder.parent / (folder.name + ".processor")
    write_tiny_mistral_tokenizer(scratch)
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.json"):
        shutil.copyfile(scratch / name, tok / name)
    shutil.rmtree(scratch)
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
