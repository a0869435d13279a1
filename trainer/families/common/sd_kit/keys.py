"""The SD lineage's key maps: diffusers names -> the original (CompVis/A1111/SGM) single-file layout for the UNet,
VAE and CLIP/OpenCLIP text encoders, what each variant (sd15, sd2, sdxl) puts where, and its kohya LoRA namer.

diffusers ships no diffusers→original exporter (see LIBRARY-NOTES), so a full fine-tune cannot become
the one-file checkpoint A1111/ComfyUI users expect without our own key mapping. We derive that
mapping by *inverting* diffusers' loader (``diffusers/loaders/single_file_utils.py``) and test it by
loading our files back with ``from_single_file``. Casting and the atomic write are
:mod:`trainer.formats.checkpoint`'s; the LoRA files themselves are :mod:`trainer.formats.kohya`'s, named by
:func:`sd_namer`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Tuple

import torch

from trainer.families.base import Namer
from trainer.formats.checkpoint import cast_state_dict, reject_adapter_layers, write_checkpoint

# --------------------------------------------------------------------------------------------
# UNet: diffusers names → original (CompVis/SGM) names
# --------------------------------------------------------------------------------------------

_RESNET_TO_ORIGINAL = {
    "norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection",
}
# longest prefix first, so that "class_embedding.linear_1" wins over "class_embedding"
_UNET_TOP_TO_ORIGINAL = sorted({
    "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
    "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2",
    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
    "class_embedding": "label_emb",
}.items(), key=lambda kv: -len(kv[0]))


@dataclass(frozen=True)
class _UNetLayout:
    """What the original block numbering depends on, read from the UNet itself.

    Original UNets number their blocks flat: ``input_blocks.N`` = conv_in, then per level
    ``layers_per_block`` (resnet[, attention]) blocks and a downsampler; ``output_blocks.N`` per
    level ``layers_per_block + 1`` blocks, the last one carrying the upsampler at index 1 (no
    attention at that level) or 2 (after the attention).
    """

    layers_per_block: int
    up_has_attention: tuple[bool, ...]

    @classmethod
    def of(cls, unet: Any) -> "_UNetLayout":
        lpb = unet.config.layers_per_block
        if not isinstance(lpb, int):
            raise NotImplementedError(
                f"UNets with per-level layers_per_block ({lpb!r}) have no original single-file layout "
                "that diffusers can read back; export a diffusers folder instead.")
        up_attn = tuple(len(getattr(block, "attentions", None) or ()) > 0 for block in unet.up_blocks)
        mid_attn = len(getattr(unet.mid_block, "attentions", None) or ()) if unet.mid_block else 0
        if unet.mid_block is not None and mid_attn != 1:
            raise NotImplementedError(
                f"a UNet mid block with {mid_attn} attentions has no original layout diffusers reads back")
        return cls(lpb, up_attn)


def _resnet_part(rest: list[str], key: str) -> list[str]:
    if not rest or rest[0] not in _RESNET_TO_ORIGINAL:
        raise KeyError(f"no original-layout name for UNet resnet key {key!r}")
    return _RESNET_TO_ORIGINAL[rest[0]].split(".") + rest[1:]


def _join(*parts: object) -> str:
    return ".".join(str(p) for p in parts)


def _unet_key(key: str, layout: _UNetLayout) -> str:
    parts = key.split(".")
    step = layout.layers_per_block + 1
    head = parts[0]
    if head in ("down_blocks", "up_blocks") and len(parts) >= 4:
        level, kind, index, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
        if head == "down_blocks":
            n = 1 + level * step + index
            if kind == "resnets":
                return _join("input_blocks", n, 0, *_resnet_part(rest, key))
            if kind == "attentions":
                return _join("input_blocks", n, 1, *rest)
            if kind == "downsamplers" and index == 0 and rest[:1] == ["conv"]:
                return _join("input_blocks", 1 + level * step + layout.layers_per_block, 0, "op", *rest[1:])
        else:
            n = level * step + index
            if kind == "resnets":
                return _join("output_blocks", n, 0, *_resnet_part(rest, key))
            if kind == "attentions":
                return _join("output_blocks", n, 1, *rest)
            if kind == "upsamplers" and index == 0 and rest[:1] == ["conv"]:
                slot = 2 if layout.up_has_attention[level] else 1
                return _join("output_blocks", level * step + layout.layers_per_block, slot, "conv", *rest[1:])
    elif head == "mid_block" and len(parts) >= 3:
        kind, index, rest = parts[1], int(parts[2]), parts[3:]
        if kind == "resnets":
            return _join("middle_block", 2 * index, *_resnet_part(rest, key))
        if kind == "attentions":
            return _join("middle_block", 2 * index + 1, *rest)
    else:
        for prefix, target in _UNET_TOP_TO_ORIGINAL:
            if key == prefix or key.startswith(prefix + "."):
                return target + key[len(prefix):]
    raise KeyError(f"no original-layout name for UNet key {key!r}")


def unet_key_to_original(key: str, unet: Any) -> str:
    """Map one diffusers UNet parameter or module path (``down_blocks.1.resnets.0.conv1``) to its
    original-layout name (``input_blocks.4.0.in_layers.2``), using the UNet's own topology."""
    try:
        return _unet_key(key, _UNetLayout.of(unet))
    except ValueError as err:  # a non-numeric block index
        raise KeyError(f"no original-layout name for UNet key {key!r}") from err


def _unet_state_dict(unet: Any) -> dict[str, "torch.Tensor"]:
    state = unet.state_dict()
    reject_adapter_layers("UNet", state)
    layout = _UNetLayout.of(unet)
    return {"model.diffusion_model." + _unet_key(k, layout): v for k, v in state.items()}


# --------------------------------------------------------------------------------------------
# VAE: diffusers names → original names
# --------------------------------------------------------------------------------------------

_VAE_ATTN_TO_ORIGINAL = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae_resnet(rest: list[str]) -> list[str]:
    return ["nin_shortcut" if p == "conv_shortcut" else p for p in rest]


def _vae_key(key: str, n_up: int) -> str:
    parts = key.split(".")
    if parts[0] in ("quant_conv", "post_quant_conv"):
        return key
    side, sub, rest = parts[0], parts[1], parts[2:]
    if side not in ("encoder", "decoder"):
        raise KeyError(f"no original-layout name for VAE key {key!r}")
    if sub in ("conv_in", "conv_out"):
        return key
    if sub == "conv_norm_out":
        return _join(side, "norm_out", *rest)
    if sub in ("down_blocks", "up_blocks") and len(rest) >= 3:
        level, kind, index, tail = int(rest[0]), rest[1], int(rest[2]), rest[3:]
        word, original_level = ("down", level) if sub == "down_blocks" else ("up", n_up - 1 - level)
        if kind == "resnets":
            return _join(side, word, original_level, "block", index, *_vae_resnet(tail))
        if kind in ("downsamplers", "upsamplers") and index == 0 and tail[:1] == ["conv"]:
            return _join(side, word, original_level, "downsample" if word == "down" else "upsample", *tail)
    if sub == "mid_block" and len(rest) >= 2:
        kind, index, tail = rest[0], int(rest[1]), rest[2:]
        if kind == "resnets":
            return _join(side, "mid", f"block_{index + 1}", *_vae_resnet(tail))
        if kind == "attentions" and index == 0:
            name = ".".join(tail[:-1])
            if name in _VAE_ATTN_TO_ORIGINAL:
                return _join(side, "mid", "attn_1", _VAE_ATTN_TO_ORIGINAL[name], tail[-1])
    raise KeyError(f"no original-layout name for VAE key {key!r}")


def _vae_state_dict(vae: Any) -> dict[str, "torch.Tensor"]:
    """Original VAE keys; the mid-block attention's linear weights become 1×1 conv weights
    ``[C, C, 1, 1]``, as in the original ``AttnBlock`` (diffusers' loader squeezes them back)."""
    state = vae.state_dict()
    reject_adapter_layers("VAE", state)
    n_up = len(vae.decoder.up_blocks)
    out = {}
    for key, value in state.items():
        new = _vae_key(key, n_up)
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value.reshape(*value.shape, 1, 1)
        out["first_stage_model." + new] = value
    return out


# --------------------------------------------------------------------------------------------
# text encoders
# --------------------------------------------------------------------------------------------

def _clip_keys(text_encoder: Any) -> dict[str, "torch.Tensor"]:
    """State dict with the ``text_model.`` prefix that transformers 5's flattened CLIPTextModel lacks."""
    state = text_encoder.state_dict()
    reject_adapter_layers("text encoder", state)
    return {k if k.startswith(("text_model.", "text_projection.")) else "text_model." + k: v
            for k, v in state.items()}


def _clip_state_dict(text_encoder: Any, prefix: str = "cond_stage_model.transformer.") -> dict[str, "torch.Tensor"]:
    """OpenAI CLIP (SD1): the transformers layout under ``cond_stage_model.transformer.text_model``."""
    state = _clip_keys(text_encoder)
    extra = [k for k in state if not k.startswith("text_model.")]
    if extra:
        raise ValueError(f"SD1 checkpoints hold a plain CLIP text model; unexpected keys {extra}")
    return {prefix + k: v for k, v in state.items()}


_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
                    "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}


def _open_clip_state_dict(text_encoder: Any, prefix: str = "cond_stage_model.model.") -> dict[str, "torch.Tensor"]:
    """OpenCLIP (SD2): ``transformer.resblocks.N`` with q/k/v fused into ``attn.in_proj_*``.

    ``text_projection`` is written only if the model has one (``CLIPTextModelWithProjection``);
    SD2's UNet never uses it, and diffusers' loader then splits ``in_proj`` by hidden size.
    """

    state = _clip_keys(text_encoder)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        k = key.removeprefix("text_model.")
        if k == "embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif k == "embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif k.startswith("final_layer_norm."):
            out["ln_final." + k.split(".", 1)[1]] = value
        elif k == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        elif k.startswith("encoder.layers."):
            _, _, n, rest = k.split(".", 3)
            module, param = rest.rsplit(".", 1)
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((n, param), {})[module[-6]] = value
            elif module in _OPEN_CLIP_LAYER:
                out[f"transformer.resblocks.{n}.{_OPEN_CLIP_LAYER[module]}.{param}"] = value
            else:
                raise KeyError(f"no OpenCLIP name for text-encoder key {key!r}")
        else:
            raise KeyError(f"no OpenCLIP name for text-encoder key {key!r}")
    for (n, param), parts in qkv.items():
        out[f"transformer.resblocks.{n}.attn.in_proj_{param}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return {prefix + k: v for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# what each SD-lineage variant's files hold
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextEncoderFile:
    """Where one text encoder goes in the variant's files: its part slot, its kohya LoRA key prefix, and its
    original single-file layout (``to_original``: OpenAI CLIP in the transformers layout, or OpenCLIP's
    resblocks) under ``single_file_prefix``."""

    slot: str
    lora_prefix: str
    to_original: Callable[..., dict]
    single_file_prefix: str


@dataclass(frozen=True)
class SDVariant:
    """The facts an SD-lineage variant's files differ in, read by the single-file writer, the LoRA namer and the
    LoRA header (:func:`trainer.families.common.sd_kit.lora.lora_metadata`).

    ``original_unet_lora_names``: LoRA files name UNet modules in the original block layout (SDXL: A1111 misses
    some diffusers-named keys there, see LIBRARY-NOTES); SD1/2 keep diffusers' names, as kohya trains on them.
    ``base_model_version``: kohya's ``ss_base_model_version``, with ``_v`` appended for v-prediction when
    ``v_suffix`` (kohya's get_model_version_str_for_sd1_sd2). ``architecture``: ``modelspec.architecture`` per
    prediction type (``epsilon``/``v``)."""

    text_encoders: Tuple[TextEncoderFile, ...]
    original_unet_lora_names: bool
    base_model_version: str
    v_suffix: bool
    ss_v2: bool
    architecture: Mapping[str, str]


SD_VARIANTS: Dict[str, SDVariant] = {
    "sd15": SDVariant(
        (TextEncoderFile("text_encoder", "lora_te", _clip_state_dict, "cond_stage_model.transformer."),),
        original_unet_lora_names=False, base_model_version="sd_v1", v_suffix=True, ss_v2=False,
        architecture={"epsilon": "stable-diffusion-v1", "v": "stable-diffusion-v1"}),
    "sd2": SDVariant(
        (TextEncoderFile("text_encoder", "lora_te", _open_clip_state_dict, "cond_stage_model.model."),),
        original_unet_lora_names=False, base_model_version="sd_v2", v_suffix=True, ss_v2=True,
        architecture={"epsilon": "stable-diffusion-v2-512", "v": "stable-diffusion-v2-768-v"}),
    # SGM layout: CLIP-L in the HF layout, OpenCLIP-G (with text_projection) in open_clip's
    "sdxl": SDVariant(
        (TextEncoderFile("text_encoder", "lora_te1", _clip_state_dict, "conditioner.embedders.0.transformer."),
         TextEncoderFile("text_encoder_2", "lora_te2", _open_clip_state_dict, "conditioner.embedders.1.model.")),
        original_unet_lora_names=True, base_model_version="sdxl_base_v1-0", v_suffix=False, ss_v2=False,
        architecture={"epsilon": "stable-diffusion-xl-v1-base", "v": "stable-diffusion-xl-v1-base"}),
}
FAMILIES = tuple(SD_VARIANTS)


def sd_variant(family: str) -> SDVariant:
    """The file facts of ``family`` (sd15, sd2, sdxl); ValueError naming the choices for anything else."""
    if family not in SD_VARIANTS:
        raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")
    return SD_VARIANTS[family]


# --------------------------------------------------------------------------------------------
# LoRA file names
# --------------------------------------------------------------------------------------------

def text_encoder_rename(text_encoder: Any) -> Callable[[str], str]:
    """transformers 5's CLIPTextModel is flat; A1111/ComfyUI expect ``text_model_encoder_...``."""
    flat = not hasattr(text_encoder, "text_model")
    return (lambda p: p if p.startswith("text_model.") else "text_model." + p) if flat else (lambda p: p)


def sd_namer(family: str, unet: Any = None, text_encoder: Any = None, text_encoder_2: Any = None) -> Namer:
    """The SD 1.x/2.x/SDXL LoRA namer: slot -> (kohya prefix, module-path rename). SD1/2 keep the
    diffusers UNet names (kohya trains on them); SDXL names UNet modules in the original layout;
    text encoders get ``text_model.`` back (transformers 5's CLIPTextModel is flat)."""
    variant = sd_variant(family)
    if len(variant.text_encoders) == 1 and text_encoder_2 is not None:
        raise ValueError(f"family {family!r} has one text encoder; text_encoder_2 is for 'sdxl'")
    namer: Namer = {}
    if unet is not None:
        if variant.original_unet_lora_names:
            layout = _UNetLayout.of(unet)
            namer["unet"] = ("lora_unet", lambda p: _unet_key(p, layout))
        else:
            namer["unet"] = ("lora_unet", lambda p: p)
    for encoder, model in zip(variant.text_encoders, (text_encoder, text_encoder_2)):
        if model is not None:
            namer[encoder.slot] = (encoder.lora_prefix, text_encoder_rename(model))
    return namer


# --------------------------------------------------------------------------------------------
# single-file checkpoints
# --------------------------------------------------------------------------------------------

def single_file_state_dict(unet: Any, vae: Any, text_encoder: Any, family: str,
                           text_encoder_2: Any = None) -> dict[str, "torch.Tensor"]:
    """The original-layout (CompVis/A1111/SGM) state dict of an SD1/SD2/SDXL model, tensors not yet cast.

    Raises if two diffusers keys would land on one original key, so a mapping bug cannot silently
    lose weights.
    """
    variant = sd_variant(family)
    two_encoders = len(variant.text_encoders) == 2
    if two_encoders != (text_encoder_2 is not None):
        raise ValueError("SDXL needs text_encoder_2 (OpenCLIP-G); SD1/SD2 have no second text encoder"
                         if two_encoders else f"family {family!r} has one text encoder; text_encoder_2 is for 'sdxl'")
    parts = [_unet_state_dict(unet), _vae_state_dict(vae)]
    for encoder, model in zip(variant.text_encoders, (text_encoder, text_encoder_2)):
        parts.append(encoder.to_original(model, prefix=encoder.single_file_prefix))
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    expected = sum(len(p) for p in parts)
    if len(merged) != expected:
        raise RuntimeError(f"original-layout mapping collided: {expected} tensors became {len(merged)} keys")
    return merged


def save_single_file_sd(path: str | os.PathLike, unet: Any, vae: Any, text_encoder: Any, family: str,
                        dtype: str, metadata: Mapping[str, Any] | None = None, text_encoder_2: Any = None) -> None:
    """Write an SD1 (``family="sd15"``), SD2 (``"sd2"``) or SDXL (``"sdxl"``, with ``text_encoder_2``)
    model as one original-layout checkpoint.

    That is the file A1111, ComfyUI and ``from_single_file`` load: UNet under
    ``model.diffusion_model.``, VAE under ``first_stage_model.``, text encoder under
    ``cond_stage_model.transformer.text_model.`` (SD1) or ``cond_stage_model.model.`` (SD2,
    OpenCLIP). ``.safetensors`` gets ``metadata`` in its header; ``.ckpt`` is
    ``torch.save({"state_dict": ...})``. The write is atomic and the models are not modified.

    SD2 note: diffusers' SD2 text encoder already dropped OpenCLIP's last layer (SD2 uses the
    penultimate one), so the file has one resblock fewer than Stability's release; A1111/ComfyUI
    never run that layer.

    SDXL (Stability's SGM layout, as in ``sd_xl_base_1.0.safetensors``): UNet and VAE as above,
    CLIP-L under ``conditioner.embedders.0.transformer.text_model.``, OpenCLIP-G under
    ``conditioner.embedders.1.model.`` (resblocks with fused ``in_proj``, ``text_projection`` stored
    transposed as open_clip does). diffusers keeps all of CLIP-G's layers, so nothing is dropped.
    """
    state = cast_state_dict(single_file_state_dict(unet, vae, text_encoder, family, text_encoder_2), dtype)
    write_checkpoint(Path(path), state, metadata)
