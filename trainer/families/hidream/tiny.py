"""Tiny HiDream-I1 (``builtin:tiny-hidream``) with seeded random weights, in the layouts people download: a diffusers
``HiDreamImagePipeline`` folder and the original single file of the transformer. The real topology (one dual-stream
and one single-stream block, each with its shared expert and four routed experts of which two run, a Llama layer
per block, T5 and Llama text projections, the pooled CLIP-L ‖ CLIP-G vector) at widths of 16–32; CLIP-L and
CLIP-G with projections and HiDream's 248 positions, T5, a two-layer Llama with a Llama-3-style byte-level
tokenizer built offline, the Flux VAE's 16 channels. Built without touching torch's global RNG."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoTokenizer,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from trainer.families.common.sd_kit.tiny import bytes_to_unicode, write_tiny_tokenizer
from trainer.families.common.tiny_store import store_tiny
from trainer.families.common.tiny_text import write_tiny_t5_tokenizer
from trainer.families.hidream.keys import PREFIX

TINY_VERSION = 1
# HiDream-I1-Dev's scheduler: flow-matching Euler, fixed shift (a real folder's scheduler config decides)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False}
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def write_tiny_llama_tokenizer(folder: Path, max_length: int = 128) -> None:
    """Every byte a token, then Llama 3's special tokens; ``<|begin_of_text|>`` before each text, ``<|eot_id|>`` the
    end (Llama-3.1-Instruct's eos, which the pipeline pads with)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA_SPECIAL)
    bos = tok.token_to_id(LLAMA_SPECIAL[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{LLAMA_SPECIAL[0]} $A",
                                                       special_tokens=[(LLAMA_SPECIAL[0], bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": LLAMA_SPECIAL[0], "eos_token": LLAMA_SPECIAL[2]}), encoding="utf-8")


def build_tiny_pipeline(folder: Path, seed: int = 0):
    write_tiny_tokenizer(folder / "tokenizer")
    write_tiny_tokenizer(folder / "tokenizer_2", pad_token="!")
    write_tiny_t5_tokenizer(folder / "tokenizer_3", max_length=128)
    write_tiny_llama_tokenizer(folder / "tokenizer_4")
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    tokenizer_2 = CLIPTokenizer.from_pretrained(str(folder / "tokenizer_2"))
    tokenizer_3 = T5TokenizerFast.from_pretrained(str(folder / "tokenizer_3"))
    tokenizer_4 = AutoTokenizer.from_pretrained(str(folder / "tokenizer_4"))

    def clip(width: int) -> CLIPTextModelWithProjection:  # HiDream's CLIPs: 248 positions (the pipeline pads to 128)
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=248, projection_dim=width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32), llama_layers=[0, 1])
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1,
                            latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        with torch.no_grad():  # a trained VAE's posterior is narrow: a random one's would bury the image in noise
            vae.encoder.conv_out.weight[16:].zero_()
            vae.encoder.conv_out.bias[16:].fill_(-9.0)
        text_encoder, text_encoder_2 = clip(16), clip(16)  # pooled: 16 ‖ 16 = text_emb_dim
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        text_encoder_4 = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer_4), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=tokenizer_4.bos_token_id, eos_token_id=tokenizer_4.eos_token_id))
    return HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(dict(SCHEDULER)), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3, text_encoder_4=text_encoder_4, tokenizer_4=tokenizer_4, transformer=transformer)


def ensure_tiny(kind: str, root: str | os.PathLike) -> Dict[str, Path]:
    """Build (once) ``{"diffusers": <HiDreamImagePipeline folder>, "single_file": <ComfyUI-layout .safetensors>}``."""
    return store_tiny(kind, root, TINY_VERSION, build_tiny_pipeline,
                      lambda state: {PREFIX + k: v for k, v in state.items()})
