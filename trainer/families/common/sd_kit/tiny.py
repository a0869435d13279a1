"""The built-in tiny model family: SD-shaped networks with seeded random weights.

Why: no machine here can download weights, yet tests and the offline demo must run the *real*
loading code. So we build tiny UNet/VAE/CLIP models with the real SD topologies (so LoRA key names
match real files, see LIBRARY-NOTES) but narrow widths, and write them to disk in the real layouts:
a diffusers folder and a single original-layout ``.safetensors`` file. The VAEs are set by hand to a near
identity (:mod:`trainer.families.common.tiny_vae`: 8× average pool / nearest upscale), so samples show
what the tiny UNet learned.

``builtin:tiny-sd``  — SD 1.5-shaped (CLIPTextModel, epsilon prediction)
``builtin:tiny-sd2`` — SD 2.x-shaped (linear projections, v-prediction)
``builtin:tiny-sdxl`` — SDXL-shaped (3 levels, two text encoders, text_time added conditioning, Euler)
``builtin:tiny-sd-inpaint`` / ``builtin:tiny-sdxl-inpaint`` — the same with a 9-channel inpainting UNet
(noisy latents ‖ mask ‖ masked-image latents), saved as StableDiffusion(XL)InpaintPipeline folders
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from trainer.families.common.sd_kit.keys import save_single_file_sd
from trainer.families.common.tiny_vae import make_identity_vae

TINY_NAMES = ("tiny-sd", "tiny-sd2", "tiny-sdxl", "tiny-sd-inpaint", "tiny-sdxl-inpaint")
TINY_VERSION = 2  # bump when the builder changes, so stale built copies are rebuilt


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte→unicode table (no longer importable from transformers 5)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


# A few merges so that common words become single tokens; everything else falls back to bytes.
_WORDS = ["a", "photo", "of", "the", "sks", "dog", "cat", "red", "blue", "green", "square", "circle",
          "on", "white", "black", "background", "painting", "style", "in", "an", "with", "and"]


def write_tiny_tokenizer(folder: Path, pad_token: str = "<|endoftext|>") -> None:
    """A CLIP BPE tokenizer with a small vocab: all bytes (+ end-of-word forms) and a few words.

    ``pad_token="!"`` gives the OpenCLIP flavour (SD 2.x, SDXL's ``tokenizer_2``)."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges: list[str] = []
    for word in _WORDS:
        # left-to-right merges building each word; the last merge yields "word</w>"
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        cur = pieces[0]
        for nxt in pieces[1:]:
            merge = f"{cur} {nxt}"
            cur = cur + nxt
            if merge not in merges:
                merges.append(merge)
            if cur not in vocab:
                vocab[cur] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": pad_token,
        "do_lower_case": True}), encoding="utf-8")


def build_tiny_pipeline(kind: str = "tiny-sd", seed: int = 0):
    """Build the tiny pipeline in memory (seeded, deterministic)."""

    if kind not in TINY_NAMES:
        raise ValueError(f"unknown tiny model {kind!r}; choose from {TINY_NAMES}")
    inpaint = kind.endswith("-inpaint")
    if kind.startswith("tiny-sdxl"):
        return _build_tiny_sdxl(seed, inpaint=inpaint)
    sd2 = kind == "tiny-sd2"
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp, model_max_length=77)

    torch.manual_seed(seed)
    te_hidden = 32
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=te_hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=te_hidden,
        hidden_act="gelu" if sd2 else "quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    # Real SD topology (4 levels, 3 cross-attention down blocks, 2 layers per block), tiny widths.
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=9 if inpaint else 4, out_channels=4, layers_per_block=2,
        block_out_channels=(16, 32, 32, 32), norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=te_hidden,
        attention_head_dim=(2, 4, 4, 4) if sd2 else 8,
        use_linear_projection=sd2,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=64,
        block_out_channels=(8, 16, 16, 16), norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        scaling_factor=0.18215,
    )
    make_identity_vae(vae)  # latents are 8×-pooled pictures: samples show what the denoiser learned
    scheduler = DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, steps_offset=1,
        prediction_type="v_prediction" if sd2 else "epsilon",
    )
    if inpaint:
        return StableDiffusionInpaintPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return pipe


def _build_tiny_sdxl(seed: int = 0, inpaint: bool = False):
    """SDXL topology with tiny widths (see LIBRARY-NOTES "Tiny offline models").

    UNet: 3 levels (DownBlock2D + 2 CrossAttnDownBlock2D), ``layers_per_block=2``, transformer depths
    (1, 2, 2) instead of (1, 2, 10) — present at every attention level, so LoRA key names are the real
    ones up to the block index — linear projections, ``text_time`` added conditioning. Text encoders:
    CLIPTextModel (CLIP-L-like, quick_gelu) and CLIPTextModelWithProjection (OpenCLIP-G-like, gelu);
    their hidden sizes differ (32 vs 48) so that diffusers' single-file loader tells them apart by
    width, as it does for the real 768 vs 1280. VAE: 4 levels (factor 8: 64 px → 8×8 latents),
    SDXL's scaling factor. Scheduler: Euler with SDXL's settings."""

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(Path(tmp) / "l")
        write_tiny_tokenizer(Path(tmp) / "g", pad_token="!")
        tokenizer = CLIPTokenizer.from_pretrained(Path(tmp) / "l", model_max_length=77)
        tokenizer_2 = CLIPTokenizer.from_pretrained(Path(tmp) / "g", model_max_length=77)

    def text_config(hidden: int, act: str, projection_dim: int) -> "CLIPTextConfig":
        return CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=projection_dim, hidden_act=act,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)

    te1_hidden, te2_hidden, time_dim = 32, 48, 8
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(text_config(te1_hidden, "quick_gelu", te1_hidden))
    text_encoder_2 = CLIPTextModelWithProjection(text_config(te2_hidden, "gelu", te2_hidden))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=9 if inpaint else 4, out_channels=4, layers_per_block=2,
        block_out_channels=(16, 32, 32),
        norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2), attention_head_dim=(2, 4, 4), use_linear_projection=True,
        cross_attention_dim=te1_hidden + te2_hidden, addition_embed_type="text_time",
        addition_time_embed_dim=time_dim, projection_class_embeddings_input_dim=6 * time_dim + te2_hidden,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=64,
        block_out_channels=(8, 16, 16, 16), norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        scaling_factor=0.13025, force_upcast=True,
    )
    make_identity_vae(vae)
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, timestep_spacing="leading", interpolation_type="linear", prediction_type="epsilon",
    )
    if inpaint:
        return StableDiffusionXLInpaintPipeline(
            vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
            add_watermarker=False, requires_aesthetics_score=False,
        )
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    return pipe


def ensure_tiny_model(kind: str, root: str | os.PathLike) -> dict[str, Path]:
    """Build (once) and return the paths of a tiny model in both layouts:
    ``{"diffusers": <folder>, "single_file": <file.safetensors>}``."""
    root = Path(root)
    folder = root / kind
    single = root / f"{kind}.safetensors"
    stamp = folder / ".atelier-tiny"
    if not (stamp.exists() and stamp.read_text() == str(TINY_VERSION) and single.exists()):
        with torch.random.fork_rng(devices=[]):  # the builders seed torch: leave the caller's RNG as it was
            pipe = build_tiny_pipeline(kind)
        tmp = root / f".{kind}.building"
        if tmp.exists():
            shutil.rmtree(tmp)
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / ".atelier-tiny").write_text(str(TINY_VERSION))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        if kind.startswith("tiny-sdxl"):
            save_single_file_sd(single, pipe.unet, pipe.vae, pipe.text_encoder, family="sdxl", dtype="fp32",
                                text_encoder_2=pipe.text_encoder_2)
        else:
            save_single_file_sd(single, pipe.unet, pipe.vae, pipe.text_encoder,
                                family="sd2" if kind == "tiny-sd2" else "sd15", dtype="fp32")
    return {"diffusers": folder, "single_file": single}
