"""File formats users load elsewhere: original-layout single files, diffusers folders, kohya LoRA.

Why this module exists (see shared/LIBRARY-NOTES.md):
- diffusers ships no diffusers→original (CompVis/A1111) exporter, so a full fine-tune cannot become
  the one-file checkpoint A1111/ComfyUI users expect without our own key mapping. We derive that
  mapping by *inverting* diffusers' loader (``diffusers/loaders/single_file_utils.py``) and test it by
  loading our files back with ``from_single_file``.
- diffusers' own LoRA converters silently write wrong kohya files (alpha forced to rank, text-encoder
  keys without ``text_model``, dropped keys with mixed targets). A kohya writer that reads the peft
  layers directly is small and exact, so we write it ourselves.

Every write goes through :mod:`trainer.io` (temp file, then rename), so an interrupted save never
replaces a good file with a broken one.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from trainer.io import atomic_dir, atomic_path, save_safetensors_atomic

if TYPE_CHECKING:  # heavy imports stay out of module import time
    import torch

FAMILIES = ("sd15", "sd2", "sdxl")
DTYPES = ("fp32", "fp16", "bf16")

__all__ = [
    "FAMILIES", "DTYPES", "save_single_file_sd", "single_file_state_dict", "save_diffusers_folder",
    "kohya_lora_state_dict", "save_lora_kohya", "lora_metadata", "load_lora_kohya_into_peft",
    "unet_key_to_original", "lycoris_state_dict", "lycoris_metadata", "save_lycoris", "load_lycoris_into_peft",
    "save_embedding_a1111", "load_embedding_a1111", "bundle_embedding_state_dict",
]


# --------------------------------------------------------------------------------------------
# small shared helpers
# --------------------------------------------------------------------------------------------

def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {DTYPES}")
    return table[name]


def _check_family(family: str, allowed: tuple[str, ...] = FAMILIES) -> None:
    if family not in allowed:
        raise ValueError(f"unknown model family {family!r}; choose one of {allowed}")


def _cast(tensors: Mapping[str, "torch.Tensor"], dtype: str) -> dict[str, "torch.Tensor"]:
    """Detached CPU copies, floating tensors cast to ``dtype`` (integer buffers left alone)."""
    target = _torch_dtype(dtype)
    out = {}
    for key, value in tensors.items():
        value = value.detach().to("cpu")
        out[key] = value.to(target) if value.is_floating_point() else value
    return out


def _write_checkpoint(path: Path, state_dict: dict[str, "torch.Tensor"],
                      metadata: Mapping[str, Any] | None) -> None:
    """``.safetensors`` (with metadata) or ``.ckpt``/``.pt`` (``{"state_dict": ...}``), atomically."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        save_safetensors_atomic(state_dict, path, metadata)
    elif suffix in (".ckpt", ".pt", ".pth"):
        import torch

        with atomic_path(path) as tmp:
            torch.save({"state_dict": {k: v.contiguous() for k, v in state_dict.items()}}, tmp)
    else:
        raise ValueError(f"cannot tell the file format from {path.name!r}: use .safetensors or .ckpt")


def _reject_adapters(name: str, state_dict: Mapping[str, Any]) -> None:
    """A peft-wrapped model's state dict has ``base_layer``/``lora_`` keys no original layout knows."""
    bad = [k for k in state_dict if ".base_layer." in k or ".lora_" in k]
    if bad:
        raise ValueError(
            f"the {name} still carries LoRA adapter layers ({bad[0]!r}, …). Merge them first "
            "(e.g. peft's merge_and_unload / diffusers' fuse_lora + unload_lora_weights), or export "
            "the adapter on its own with save_lora_kohya.")


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
    _reject_adapters("UNet", state)
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
    _reject_adapters("VAE", state)
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
    _reject_adapters("text encoder", state)
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
    import torch

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
# single-file checkpoints
# --------------------------------------------------------------------------------------------

def single_file_state_dict(unet: Any, vae: Any, text_encoder: Any, family: str,
                           text_encoder_2: Any = None) -> dict[str, "torch.Tensor"]:
    """The original-layout (CompVis/A1111/SGM) state dict of an SD1/SD2/SDXL model, tensors not yet cast.

    Raises if two diffusers keys would land on one original key, so a mapping bug cannot silently
    lose weights.
    """
    _check_family(family)
    if (family == "sdxl") != (text_encoder_2 is not None):
        raise ValueError("SDXL needs text_encoder_2 (OpenCLIP-G); SD1/SD2 have no second text encoder"
                         if family == "sdxl" else f"family {family!r} has one text encoder; text_encoder_2 is for 'sdxl'")
    if family == "sdxl":  # SGM layout: CLIP-L in the HF layout, OpenCLIP-G (with text_projection) in open_clip's
        parts = [_unet_state_dict(unet), _vae_state_dict(vae),
                 _clip_state_dict(text_encoder, prefix="conditioner.embedders.0.transformer."),
                 _open_clip_state_dict(text_encoder_2, prefix="conditioner.embedders.1.model.")]
    else:
        parts = [_unet_state_dict(unet), _vae_state_dict(vae),
                 _clip_state_dict(text_encoder) if family == "sd15" else _open_clip_state_dict(text_encoder)]
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
    state = _cast(single_file_state_dict(unet, vae, text_encoder, family, text_encoder_2), dtype)
    _write_checkpoint(Path(path), state, metadata)


# --------------------------------------------------------------------------------------------
# diffusers folders
# --------------------------------------------------------------------------------------------

def _cast_saved_folder(folder: Path, dtype: str) -> None:
    """Rewrite every saved ``*.safetensors`` under ``folder`` in ``dtype`` and note it in configs.

    Why here and not on the models: casting a training model to fp16 and back would destroy its
    fp32 weights, and a cast copy of a big UNet doubles memory. Files are converted one at a time.
    """
    from safetensors import safe_open

    from trainer.io import save_safetensors_atomic
    target = _torch_dtype(dtype)
    for file in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if all(t.dtype == target or not t.is_floating_point() for t in tensors.values()):
            continue
        # atomically, and readable as the umask says (safetensors' save_file alone leaves 0600 files)
        save_safetensors_atomic(_cast(tensors, dtype), file, metadata=meta)
    torch_name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]
    for config in folder.rglob("config.json"):  # transformers configs record the weights' dtype
        data = json.loads(config.read_text(encoding="utf-8"))
        changed = False
        for field in ("dtype", "torch_dtype"):
            if field in data and data[field] != torch_name:
                data[field] = torch_name
                changed = True
        if changed:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_diffusers_folder(folder: str | os.PathLike, pipeline_or_components: Any, dtype: str) -> None:
    """Save a pipeline (or a ``{name: component}`` mapping) as a diffusers folder, atomically.

    ``save_pretrained`` writes into a temporary sibling folder, weights are converted to ``dtype``
    on disk, and only then does the folder take ``folder``'s place. A mapping is written one
    sub-folder per component without ``model_index.json`` (use it to replace, e.g., only the UNet).
    """
    _torch_dtype(dtype)
    with atomic_dir(folder) as tmp:
        if isinstance(pipeline_or_components, Mapping):
            for name, component in pipeline_or_components.items():
                if component is None:
                    continue
                if not hasattr(component, "save_pretrained"):
                    raise TypeError(f"component {name!r} ({type(component).__name__}) cannot be saved")
                kwargs = {"safe_serialization": True} if _takes_safe_serialization(component) else {}
                component.save_pretrained(tmp / name, **kwargs)
        else:
            pipeline_or_components.save_pretrained(tmp, safe_serialization=True)
        _cast_saved_folder(Path(tmp), dtype)


def _takes_safe_serialization(component: Any) -> bool:
    import inspect

    try:
        return "safe_serialization" in inspect.signature(component.save_pretrained).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# kohya LoRA
# --------------------------------------------------------------------------------------------

_PEFT_PREFIXES = ("base_model.model.",)


def _lora_layers(model: Any, adapter: str) -> Iterator[tuple[str, Any]]:
    """(module path, peft LoraLayer) for every layer that carries ``adapter``."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A):
            for prefix in _PEFT_PREFIXES:
                name = name.removeprefix(prefix)
            yield name, module


def _check_plain_lora(name: str, layer: Any, adapter: str) -> None:
    """Refuse what the kohya format cannot express instead of writing a file that loads wrong."""
    if adapter in layer.lora_embedding_A:
        raise NotImplementedError(f"{name}: LoRA on embedding layers has no kohya representation")
    if layer.lora_bias.get(adapter, False):
        raise NotImplementedError(f"{name}: LoRA with lora_bias=True has no kohya representation")
    variant = layer.lora_variant.get(adapter) if hasattr(layer, "lora_variant") else None
    if variant is not None and "Dora" not in type(variant).__name__:
        raise NotImplementedError(f"{name}: peft LoRA variant {type(variant).__name__} has no kohya representation")


def _kohya_alpha(layer: Any, adapter: str) -> float:
    """kohya scales by alpha/rank; peft by alpha/rank, or alpha/sqrt(rank) with rsLoRA."""
    alpha = float(layer.lora_alpha[adapter])
    if layer.use_rslora.get(adapter, False):
        alpha *= math.sqrt(layer.r[adapter])
    return alpha


def _module_names(model: Any, prefix: str, adapter: str, rename,
                  layers=_lora_layers) -> dict[str, tuple[str, Any]]:
    """kohya name → (module path, layer), checking that no two modules share a name."""
    out: dict[str, tuple[str, Any]] = {}
    for path, layer in layers(model, adapter):
        kohya = f"{prefix}_{rename(path).replace('.', '_')}"
        if kohya in out:
            raise RuntimeError(f"modules {out[kohya][0]!r} and {path!r} both map to kohya name {kohya!r}")
        out[kohya] = (path, layer)
    return out


def _text_encoder_rename(text_encoder: Any):
    """transformers 5's CLIPTextModel is flat; A1111/ComfyUI expect ``text_model_encoder_...``."""
    flat = not hasattr(text_encoder, "text_model")
    return (lambda p: p if p.startswith("text_model.") else "text_model." + p) if flat else (lambda p: p)


def sd_namer(family: str, unet: Any = None, text_encoder: Any = None, text_encoder_2: Any = None) -> dict:
    """The SD 1.x/2.x/SDXL LoRA namer: slot -> (kohya prefix, module-path rename). SD1/2 keep the
    diffusers UNet names (kohya trains on them); SDXL names UNet modules in the original layout;
    text encoders get ``text_model.`` back (transformers 5's CLIPTextModel is flat)."""
    _check_family(family)
    if family != "sdxl" and text_encoder_2 is not None:
        raise ValueError(f"family {family!r} has one text encoder; text_encoder_2 is for 'sdxl'")
    namer: dict = {}
    if unet is not None:
        if family == "sdxl":
            layout = _UNetLayout.of(unet)
            namer["unet"] = ("lora_unet", lambda p: _unet_key(p, layout))
        else:
            namer["unet"] = ("lora_unet", lambda p: p)
    te_prefixes = ("lora_te1", "lora_te2") if family == "sdxl" else ("lora_te",)
    for slot, model, prefix in zip(("text_encoder", "text_encoder_2"), (text_encoder, text_encoder_2), te_prefixes):
        if model is not None:
            namer[slot] = (prefix, _text_encoder_rename(model))
    return namer


def _named_targets(unet: Any, text_encoder: Any, text_encoder_2: Any, adapter: str,
                   family: str, layers=_lora_layers, modules: Optional[Mapping[str, Any]] = None,
                   namer: Optional[Mapping[str, Any]] = None) -> dict[str, tuple[str, Any]]:
    """kohya name -> (module path, layer) over ``modules`` (slot -> module) with a family's ``namer``;
    without them, over the SD/SDXL ``unet``/``text_encoder``/``text_encoder_2`` with :func:`sd_namer`."""
    if modules is None:
        modules = {"unet": unet, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2}
        namer = sd_namer(family, unet, text_encoder, text_encoder_2)
    names: dict[str, tuple[str, Any]] = {}
    for slot, model in modules.items():
        if model is None:
            continue
        if slot not in namer:
            raise ValueError(f"the model family has no LoRA file names for its {slot} part")
        prefix, rename = namer[slot]
        for kohya, found in _module_names(model, prefix, adapter, rename, layers).items():
            if kohya in names:
                raise RuntimeError(f"modules {names[kohya][0]!r} and {found[0]!r} both map to kohya name {kohya!r}")
            names[kohya] = found
    return names


def kohya_lora_state_dict(unet: Any = None, text_encoder: Any = None, text_encoder_2: Any = None,
                          adapter_name: str = "default", family: str = "sd15", *,
                          modules: Optional[Mapping[str, Any]] = None,
                          namer: Optional[Mapping[str, Any]] = None,
                          dora_format: str = "lycoris") -> dict[str, "torch.Tensor"]:
    """Read the peft LoRA layers of the given models into a kohya-format state dict.

    Per module: ``<name>.lora_down.weight`` (peft ``lora_A``), ``<name>.lora_up.weight``
    (``lora_B``), ``<name>.alpha`` (scalar), and ``<name>.dora_scale`` for DoRA in the loader
    convention ``dora_format`` (:func:`dora_scale_for`; ``lycoris``: ``lora_magnitude_vector`` reshaped
    to ``(out, 1[, 1, 1])``, what backups hold). Conv layers keep 4-D shapes
    (LoCon). Names: ``lora_unet_`` + diffusers module path (SD1/2; original block names for SDXL),
    ``lora_te_`` (``lora_te1_``/``lora_te2_`` for SDXL) + ``text_model_...``.
    Tensors are detached CPU copies in the layers' dtype; alpha is float32.
    """
    import torch

    names = _named_targets(unet, text_encoder, text_encoder_2, adapter_name, family, modules=modules, namer=namer)
    if not names:
        raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found in the given models")
    out: dict[str, torch.Tensor] = {}
    for kohya, (path, layer) in names.items():
        _check_plain_lora(path, layer, adapter_name)
        out[f"{kohya}.lora_down.weight"] = layer.lora_A[adapter_name].weight.detach().cpu().clone()
        out[f"{kohya}.lora_up.weight"] = layer.lora_B[adapter_name].weight.detach().cpu().clone()
        out[f"{kohya}.alpha"] = torch.tensor(_kohya_alpha(layer, adapter_name), dtype=torch.float32)
        if adapter_name in layer.lora_magnitude_vector:
            out[f"{kohya}.dora_scale"] = dora_scale_for(layer, adapter_name, dora_format)
    return out


# --------------------------------------------------------------------------------------------
# DoRA: one trained layer, three loader formulas
# --------------------------------------------------------------------------------------------
#
# peft (what trains) and LyCORIS compute W' = m · V / ‖V‖ with V = W + (α/r)·up·down and the norm taken
# per output row of V. Loaders read the same ``dora_scale`` key differently (their published code):
# - ComfyUI and Forge (comfy/weight_adapter/base.py ``weight_decompose``): a dora_scale with one value
#   per output row is divided by the norm of the *original* W (+ eps): W' = V · s / (‖W‖ + eps).
# - AUTOMATIC1111 v1.10 (extensions-builtin/Lora/network.py ``apply_weight_decompose``, and ComfyUI/Forge
#   before the output-axis branch): the norm over the *input* axis of V: W' = V · s / ‖V‖_col.
# - LyCORIS / kohya sd-scripts / OneTrainer: W' = V · s / ‖V‖_row, s = m as trained.
# A file can satisfy one of them; ``output.dora_format`` picks which. Each is exact for its loader.

DORA_FORMATS = ("comfyui", "a1111", "lycoris")
_COMFY_EPS = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps: ComfyUI adds it to the norm


def _dora_norms(layer: Any, adapter: str) -> tuple:
    """(‖W‖ per output row, ‖V‖ per output row, ‖V‖ per input channel, W's shape), float32, on CPU."""
    base = layer.get_base_layer().weight.detach().float().cpu()
    down = layer.lora_A[adapter].weight.detach().float().cpu()
    up = layer.lora_B[adapter].weight.detach().float().cpu()
    delta = (up.flatten(1) @ down.flatten(1)).reshape(base.shape) * float(layer.scaling[adapter])
    merged = base + delta
    rows_w = base.flatten(1).norm(dim=1)
    rows_v = merged.flatten(1).norm(dim=1)
    cols_v = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
    return rows_w, rows_v, cols_v, base.shape


def dora_scale_for(layer: Any, adapter: str, dora_format: str = "comfyui") -> "torch.Tensor":
    """The ``dora_scale`` tensor that makes ``dora_format``'s loader rebuild this layer's trained weight."""
    if dora_format not in DORA_FORMATS:
        raise ValueError(f"output.dora_format = {dora_format!r}: choose one of {', '.join(DORA_FORMATS)}")
    magnitude = layer.lora_magnitude_vector[adapter].weight.detach().float().cpu().reshape(-1)
    ndim = layer.get_base_layer().weight.ndim
    if dora_format == "lycoris":
        return magnitude.reshape(-1, *([1] * (ndim - 1))).clone()
    rows_w, rows_v, cols_v, shape = _dora_norms(layer, adapter)
    if dora_format == "comfyui":
        return (magnitude * (rows_w + _COMFY_EPS) / rows_v).reshape(-1, *([1] * (ndim - 1)))
    # a1111: s / ‖V‖_col must equal m / ‖V‖_row for every entry, so s holds one value per (out, in) pair
    full = (magnitude / rows_v)[:, None] * cols_v[None, :]
    return full.reshape(shape[0], shape[1], *([1] * (ndim - 2)))


def dora_magnitude_from(scale: "torch.Tensor", layer: Any, adapter: str, dora_format: str) -> "torch.Tensor":
    """peft's magnitude from a file's ``dora_scale`` (the inverse of :func:`dora_scale_for`); the layer's
    up/down weights and scaling must already be the file's. A scale with one value per (out, in) pair is
    the a1111 form whatever the header says; one value per output row is read as ``dora_format``."""
    scale = scale.detach().float().cpu()
    per_row = scale.numel() == scale.shape[0]
    if per_row and dora_format != "comfyui":
        return scale.reshape(-1)
    rows_w, rows_v, cols_v, shape = _dora_norms(layer, adapter)
    if per_row:
        return scale.reshape(-1) * rows_v / (rows_w + _COMFY_EPS)
    per = scale.reshape(shape[0], shape[1], -1)[:, :, 0] / cols_v[None, :]
    return per.mean(dim=1) * rows_v


_BASE_MODEL_VERSION = {"sd15": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}


def _modelspec_architecture(family: str, prediction_type: str) -> str:
    if family == "sd15":
        return "stable-diffusion-v1"
    if family == "sd2":
        return "stable-diffusion-v2-768-v" if prediction_type == "v" else "stable-diffusion-v2-512"
    return "stable-diffusion-xl-v1-base"


def modelspec_common(*, title: str, resolution: tuple[int, int] | int | None = None) -> dict[str, str]:
    """The family-independent ``modelspec.*`` header keys (title, date, resolution)."""
    meta = {"modelspec.sai_model_spec": "1.0.0", "modelspec.title": title,
            "modelspec.date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}
    if resolution is not None:
        w, h = (resolution, resolution) if isinstance(resolution, int) else resolution
        meta["modelspec.resolution"] = f"{w}x{h}"
    return meta


def lora_metadata(family: str, *, title: str, prediction_type: str = "epsilon",
                  resolution: tuple[int, int] | int | None = None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The family-specific header keys kohya users and model sites read (``ss_*``, ``modelspec.*``).

    Only facts we know are written; ``save_lora_kohya`` adds what it can read from the tensors
    (``ss_network_dim``, ``ss_network_alpha``, ``ss_network_args``). ``extra`` wins on conflicts.
    """
    _check_family(family)
    pred = {"v_prediction": "v", "v": "v", "epsilon": "epsilon"}.get(prediction_type)
    if pred is None:
        raise ValueError(f"unknown prediction type {prediction_type!r}; use 'epsilon' or 'v_prediction'")
    meta = {
        # kohya's get_model_version_str_for_sd1_sd2: sd_v1 / sd_v2, "_v" appended for v-prediction
        "ss_base_model_version": _BASE_MODEL_VERSION[family] + ("_v" if pred == "v" and family != "sdxl" else ""),
        "ss_v2": str(family == "sd2"),
        "ss_network_module": "networks.lora",
        "modelspec.architecture": _modelspec_architecture(family, pred) + "/lora",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.prediction_type": pred,
        **modelspec_common(title=title, resolution=resolution),
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


def _network_shape_metadata(state_dict: Mapping[str, "torch.Tensor"]) -> dict[str, str]:
    """Most common (rank, alpha) of linear/1×1 layers and of k×k convs, as kohya's headers state them."""
    linear: Counter = Counter()
    conv: Counter = Counter()
    for key, down in state_dict.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        rank = int(down.shape[0])
        alpha_t = state_dict.get(f"{name}.alpha")
        alpha = float(alpha_t.item()) if alpha_t is not None else float(rank)
        is_kxk_conv = down.ndim == 4 and tuple(down.shape[2:]) != (1, 1)
        (conv if is_kxk_conv else linear)[(rank, alpha)] += 1
    meta: dict[str, str] = {}
    if linear:
        rank, alpha = linear.most_common(1)[0][0]
        meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    if conv:
        rank, alpha = conv.most_common(1)[0][0]
        meta["ss_network_args"] = json.dumps({"conv_dim": str(rank), "conv_alpha": str(alpha)})
        if not linear:
            meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    return meta


def _cast_adapter_tensors(state_dict: Mapping[str, "torch.Tensor"], dtype: str) -> dict[str, "torch.Tensor"]:
    """Adapter weights cast to ``dtype`` on the CPU; ``.alpha`` scalars stay float32 (loaders read them
    as exact numbers)."""
    import torch
    target = _torch_dtype(dtype)
    out = {}
    for key, value in state_dict.items():
        value = value.detach().cpu()
        if key.endswith(".alpha"):
            out[key] = value.to(torch.float32)
        else:
            out[key] = value.to(target) if value.is_floating_point() else value
    return out


def save_lora_kohya(path: str | os.PathLike, state_dict: Mapping[str, "torch.Tensor"],
                    metadata: Mapping[str, Any] | None, dtype: str) -> None:
    """Write a kohya-format LoRA ``.safetensors`` atomically.

    Weights are cast to ``dtype``; ``.alpha`` scalars stay float32 so an alpha like 0.3 survives
    fp16. Header: rank/alpha read from the tensors, then ``metadata`` (e.g. from
    :func:`lora_metadata`) on top.
    """
    if Path(path).suffix.lower() != ".safetensors":
        raise ValueError(f"kohya LoRA files are .safetensors; got {Path(path).name!r}")
    tensors = _cast_adapter_tensors(state_dict, dtype)
    header = _network_shape_metadata(state_dict)
    header.update({str(k): str(v) for k, v in (metadata or {}).items()})
    save_safetensors_atomic(tensors, path, header)


def _load_lora_file(path_or_state_dict: str | os.PathLike | Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    if isinstance(path_or_state_dict, Mapping):
        return dict(path_or_state_dict)
    from safetensors.torch import load_file

    return load_file(str(path_or_state_dict))


def _split_kohya_keys(state: Mapping[str, "torch.Tensor"]) -> tuple[dict[str, dict[str, "torch.Tensor"]], list[str]]:
    """Group ``name.lora_down.weight``/``.lora_up.weight``/``.alpha``/``.dora_scale`` by name."""
    suffixes = (".lora_down.weight", ".lora_up.weight", ".alpha", ".dora_scale")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        for suffix in suffixes:
            if key.endswith(suffix):
                groups.setdefault(key[: -len(suffix)], {})[suffix] = value
                break
        else:
            unknown.append(key)
    return groups, unknown


def _assign(param: "torch.Tensor", value: "torch.Tensor", what: str) -> None:
    import torch

    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{what}: file has shape {tuple(value.shape)}, model expects {tuple(param.shape)} "
                         "(different rank or target layer?)")
    with torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def load_lora_kohya_into_peft(path: str | os.PathLike | Mapping[str, "torch.Tensor"], unet: Any = None,
                              text_encoder: Any = None, text_encoder_2: Any = None, *,
                              adapter_name: str = "default", family: str = "sd15", strict: bool = True,
                              modules: Optional[Mapping[str, Any]] = None,
                              namer: Optional[Mapping[str, Any]] = None,
                              dora_format: str = "lycoris") -> int:
    """Copy a kohya LoRA file into the peft LoRA layers already added to the models (resume, or
    ``lora.init_weights``). Returns the number of layers loaded. ``dora_format``: the convention the
    file's ``dora_scale`` was written in (its ``atelier_dora_format`` header; LyCORIS/kohya files: lycoris).

    The file's alpha replaces the layer's (``lora_alpha`` and ``scaling``). Any file key without a
    matching peft layer raises, naming the keys; with ``strict`` (default) peft layers the file does
    not cover raise too, because they would keep their fresh initialisation unnoticed.
    """
    state = _load_lora_file(path)
    names = _named_targets(unet, text_encoder, text_encoder_2, adapter_name, family, modules=modules, namer=namer)
    groups, unknown = _split_kohya_keys(state)
    unmatched = sorted(unknown + [f"{n}.*" for n in groups if n not in names])
    if unmatched:
        shown = ", ".join(unmatched[:10]) + (f" … ({len(unmatched)} in all)" if len(unmatched) > 10 else "")
        raise ValueError(f"LoRA file keys match no LoRA layer of the model (targets or family differ?): {shown}")
    missing = sorted(n for n in names if n not in groups)
    if strict and missing:
        shown = ", ".join(missing[:10]) + (f" … ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"model LoRA layers not in the file (pass strict=False to keep them as they are): {shown}")
    for name, parts in groups.items():
        _load_one(name, parts, names[name][1], adapter_name, dora_format)
    return len(groups)


def _load_one(name: str, parts: Mapping[str, "torch.Tensor"], layer: Any, adapter: str,
              dora_format: str = "lycoris") -> None:
    _check_plain_lora(name, layer, adapter)
    for suffix in (".lora_down.weight", ".lora_up.weight"):
        if suffix not in parts:
            raise ValueError(f"LoRA file has no {name}{suffix}")
    _assign(layer.lora_A[adapter].weight, parts[".lora_down.weight"], f"{name}.lora_down.weight")
    _assign(layer.lora_B[adapter].weight, parts[".lora_up.weight"], f"{name}.lora_up.weight")
    rank = layer.r[adapter]
    alpha = float(parts[".alpha"].item()) if ".alpha" in parts else float(rank)  # kohya: no alpha = rank
    layer.scaling[adapter] = alpha / rank
    layer.lora_alpha[adapter] = alpha / math.sqrt(rank) if layer.use_rslora.get(adapter, False) else alpha
    has_dora = adapter in layer.lora_magnitude_vector
    if ".dora_scale" in parts and not has_dora:
        raise ValueError(f"{name}: the file is DoRA (dora_scale) but the model layer is plain LoRA (use_dora=False)")
    if has_dora:
        if ".dora_scale" not in parts:
            raise ValueError(f"{name}: the model layer is DoRA but the file has no dora_scale")
        magnitude = layer.lora_magnitude_vector[adapter].weight
        value = dora_magnitude_from(parts[".dora_scale"], layer, adapter, dora_format)
        _assign(magnitude, value.reshape(magnitude.shape), f"{name}.dora_scale")


# --------------------------------------------------------------------------------------------
# LyCORIS LoHa / LoKr (trained on peft's LoHaLayer / LoKrLayer)
# --------------------------------------------------------------------------------------------
#
# The LyCORIS file format (what A1111, ComfyUI and lycoris-lora load) uses kohya's module names
# with per-module keys ``hada_w1_a … hada_t2`` (LoHa) or ``lokr_w1[_a/_b] … lokr_t2`` (LoKr) and
# ``.alpha``. peft's parameters carry the same names and shapes; the one difference is LoKr's
# scale when neither factor is decomposed: LyCORIS/A1111/ComfyUI then take scale 1 whatever the
# alpha, while peft always scales by alpha/r — so we bake peft's scale into ``lokr_w1`` and write
# alpha = rank.

_LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
_LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def _lycoris_layers(model: Any, adapter: str) -> Iterator[tuple[str, Any]]:
    """(module path, peft LoHaLayer/LoKrLayer) for every layer that carries ``adapter``."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer

    for name, module in model.named_modules():
        if isinstance(module, (LoHaLayer, LoKrLayer)) and adapter in module._available_adapters:
            for prefix in _PEFT_PREFIXES:
                name = name.removeprefix(prefix)
            yield name, module


def _lycoris_algo(layer: Any) -> str:
    from peft.tuners.loha import LoHaLayer

    return "loha" if isinstance(layer, LoHaLayer) else "lokr"


def _lokr_full(layer: Any, adapter: str) -> bool:
    """Neither Kronecker factor is decomposed: LyCORIS loaders then use scale 1."""
    return adapter in layer.lokr_w1 and adapter in layer.lokr_w2


def lycoris_state_dict(unet: Any = None, text_encoder: Any = None, text_encoder_2: Any = None,
                       adapter_name: str = "default", family: str = "sd15", *,
                       modules: Optional[Mapping[str, Any]] = None,
                       namer: Optional[Mapping[str, Any]] = None) -> dict[str, "torch.Tensor"]:
    """Read peft LoHa/LoKr layers into a LyCORIS-format state dict with kohya names.

    Per module ``<name>.hada_*`` or ``<name>.lokr_*`` (peft's tensors as they are) and
    ``<name>.alpha`` = scaling × rank, so that every loader's alpha/rank equals peft's scaling.
    LoKr layers with two full factors get the scaling baked into ``lokr_w1`` and alpha = rank.
    """
    import torch

    names = _named_targets(unet, text_encoder, text_encoder_2, adapter_name, family, _lycoris_layers,
                           modules=modules, namer=namer)
    if not names:
        raise ValueError(f"no peft LoHa/LoKr layers with adapter {adapter_name!r} found in the given models")
    out: dict[str, torch.Tensor] = {}
    for kohya, (path, layer) in names.items():
        keys = _LOHA_KEYS if _lycoris_algo(layer) == "loha" else _LOKR_KEYS
        rank = layer.r[adapter_name]
        scaling = float(layer.scaling[adapter_name])
        for key in keys:
            store = getattr(layer, key)
            if adapter_name in store:
                out[f"{kohya}.{key}"] = store[adapter_name].detach().cpu().clone()
        if _lycoris_algo(layer) == "lokr" and _lokr_full(layer, adapter_name):
            out[f"{kohya}.lokr_w1"] = out[f"{kohya}.lokr_w1"] * scaling
            scaling = 1.0
        out[f"{kohya}.alpha"] = torch.tensor(scaling * rank, dtype=torch.float32)
    return out


def _lycoris_rank(state: Mapping[str, "torch.Tensor"], name: str) -> int | None:
    """The rank a LyCORIS loader reads for one module (None: LoKr with two full factors)."""
    for key in (".hada_w1_b", ".lokr_w1_b", ".lokr_w2_b"):
        if name + key in state:
            return int(state[name + key].shape[0])
    return None


def lycoris_metadata(state_dict: Mapping[str, "torch.Tensor"], algo: str,
                     network_args: Mapping[str, Any] | None = None) -> dict[str, str]:
    """kohya-style header of a LyCORIS file: ``ss_network_module = lycoris.kohya``, the most common
    (rank, alpha) as ``ss_network_dim``/``ss_network_alpha``, and ``ss_network_args`` with the algo."""
    seen: Counter = Counter()
    for key, value in state_dict.items():
        if key.endswith(".alpha"):
            rank = _lycoris_rank(state_dict, key[: -len(".alpha")])
            if rank is not None:
                seen[(rank, float(value.item()))] += 1
    meta = {"ss_network_module": "lycoris.kohya",
            "ss_network_args": json.dumps({"algo": algo, **{k: str(v) for k, v in (network_args or {}).items()}})}
    if seen:
        (rank, alpha), _ = seen.most_common(1)[0]
        meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    return meta


def save_lycoris(path: str | os.PathLike, state_dict: Mapping[str, "torch.Tensor"],
                 metadata: Mapping[str, Any] | None, dtype: str, algo: str,
                 network_args: Mapping[str, Any] | None = None) -> None:
    """Write a LyCORIS LoHa/LoKr ``.safetensors`` atomically.

    Weights are cast to ``dtype``, ``.alpha`` stays float32; the header is ``metadata`` (e.g. from
    :func:`lora_metadata`) with the LyCORIS keys of :func:`lycoris_metadata` on top.
    """
    if Path(path).suffix.lower() != ".safetensors":
        raise ValueError(f"LyCORIS files are .safetensors; got {Path(path).name!r}")
    tensors = _cast_adapter_tensors(state_dict, dtype)
    header = {str(k): str(v) for k, v in (metadata or {}).items()}
    header.update(lycoris_metadata(state_dict, algo, network_args))
    save_safetensors_atomic(tensors, path, header)


def load_lycoris_into_peft(path: str | os.PathLike | Mapping[str, "torch.Tensor"], unet: Any = None,
                           text_encoder: Any = None, text_encoder_2: Any = None, *,
                           adapter_name: str = "default", family: str = "sd15", strict: bool = True,
                           modules: Optional[Mapping[str, Any]] = None,
                           namer: Optional[Mapping[str, Any]] = None) -> int:
    """Copy a LyCORIS LoHa/LoKr file into peft LoHa/LoKr layers already added to the models
    (``lora.init_weights``); the inverse of :func:`lycoris_state_dict`. Returns the layers loaded."""
    state = _load_lora_file(path)
    names = _named_targets(unet, text_encoder, text_encoder_2, adapter_name, family, _lycoris_layers,
                           modules=modules, namer=namer)
    suffixes = tuple("." + k for k in _LOHA_KEYS + _LOKR_KEYS) + (".alpha",)
    groups: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        name, dot, part = key.partition(".")
        if dot and "." + part in suffixes:
            groups.setdefault(name, {})[part] = value
        elif not key.startswith("bundle_emb."):
            unknown.append(key)
    unmatched = sorted(unknown + [f"{n}.*" for n in groups if n not in names])
    if unmatched:
        shown = ", ".join(unmatched[:10]) + (f" … ({len(unmatched)} in all)" if len(unmatched) > 10 else "")
        raise ValueError(f"LyCORIS file keys match no LoHa/LoKr layer of the model (algo, targets or family "
                         f"differ?): {shown}")
    missing = sorted(n for n in names if n not in groups)
    if strict and missing:
        shown = ", ".join(missing[:10]) + (f" … ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"model LoHa/LoKr layers not in the file (pass strict=False to keep them as they are): {shown}")
    for name, parts in groups.items():
        layer = names[name][1]
        keys = _LOHA_KEYS if _lycoris_algo(layer) == "loha" else _LOKR_KEYS
        for key in keys:
            store = getattr(layer, key)
            if (adapter_name in store) != (key in parts):
                raise ValueError(f"{name}: the file's {_lycoris_algo(layer)} factors differ from the model's "
                                 f"({key} {'missing in the file' if key not in parts else 'unexpected'}): "
                                 "rank, factor or decompose_both changed?")
            if key in parts:
                _assign(store[adapter_name], parts[key], f"{name}.{key}")
        rank = layer.r[adapter_name]
        if _lycoris_algo(layer) == "lokr" and _lokr_full(layer, adapter_name):
            scaling = 1.0  # LyCORIS convention: alpha ignored, the scale is in the weights
        else:
            scaling = float(parts["alpha"].item()) / rank if "alpha" in parts else 1.0
        layer.scaling[adapter_name] = scaling
        layer.alpha[adapter_name] = scaling * rank
    return len(groups)


# --------------------------------------------------------------------------------------------
# textual-inversion embeddings (A1111 formats)
# --------------------------------------------------------------------------------------------

CLIP_STAR_TOKEN_ID = 265  # "*" in the CLIP vocab: A1111's placeholder in .pt files


def save_embedding_a1111(path: str | os.PathLike, vectors: "torch.Tensor | Mapping[str, torch.Tensor]", *,
                         name: str, step: int | None = None, metadata: Mapping[str, Any] | None = None,
                         dtype: str = "fp32") -> None:
    """Write a textual-inversion embedding the way A1111 (and kohya) do, atomically.

    ``.safetensors``: ``{"emb_params": T[num_vectors, dim]}`` (SD1/2) — or, given a mapping such as
    ``{"clip_l": …, "clip_g": …}`` (SDXL), those tensors. ``.pt``: A1111's
    ``{"string_to_param": {"*": T}, "string_to_token": {"*": 265}, "name", "step"}``.
    Both load with diffusers' ``load_textual_inversion``, A1111 and ComfyUI.
    """
    path = Path(path)
    tensors = dict(vectors) if isinstance(vectors, Mapping) else {"emb_params": vectors}
    tensors = {k: v.detach().reshape(-1, v.shape[-1]) for k, v in tensors.items()}
    tensors = _cast(tensors, dtype)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        save_safetensors_atomic({k: v.contiguous() for k, v in tensors.items()}, path,
                                {str(k): str(v) for k, v in (metadata or {}).items()})
    elif suffix == ".pt":
        import torch

        if set(tensors) != {"emb_params"}:
            raise ValueError("A1111 .pt embeddings hold one tensor; save SDXL embeddings as .safetensors")
        data = {"string_to_param": {"*": tensors["emb_params"].contiguous()},
                "string_to_token": {"*": CLIP_STAR_TOKEN_ID}, "name": name, "step": step}
        with atomic_path(path) as tmp:
            torch.save(data, tmp)
    else:
        raise ValueError(f"embeddings are .safetensors or .pt; got {path.name!r}")


def load_embedding_a1111(path: str | os.PathLike) -> "torch.Tensor":
    """The vectors ``[num_vectors, dim]`` of an A1111 (``emb_params`` / ``string_to_param``) or
    diffusers (``{token: T}``) embedding file."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        data: Any = load_file(str(path))
    else:
        import torch

        data = torch.load(path, map_location="cpu", weights_only=True)
    if "string_to_param" in data:
        params = data["string_to_param"]
        if len(params) != 1:
            raise ValueError(f"{path.name}: the embedding holds {len(params)} terms; expected one")
        tensor = next(iter(params.values()))
    elif "emb_params" in data:
        tensor = data["emb_params"]
    elif len(data) == 1:
        tensor = next(iter(data.values()))
    else:
        raise ValueError(f"{path.name}: not an SD1/2 embedding (keys {sorted(data)[:5]}); SDXL files hold "
                         "clip_l/clip_g")
    return tensor.detach().reshape(-1, tensor.shape[-1]).float()


def bundle_embedding_state_dict(name: str, vectors: "torch.Tensor | Mapping[str, torch.Tensor]"
                                ) -> dict[str, "torch.Tensor"]:
    """Keys that bundle an embedding into a LoRA file: ``bundle_emb.<name>.string_to_param.*``
    (A1111's Lora extension reads them; the embedding's prompt word is ``name``). An SDXL embedding
    (a mapping ``{"clip_l", "clip_g"}``) gives ``bundle_emb.<name>.clip_l`` / ``.clip_g``, which A1111
    collects into the same dict its SDXL embedding files hold."""
    if not name or "." in name or any(c.isspace() for c in name):
        raise ValueError(f"bundled embedding name {name!r} must be non-empty without dots or spaces")
    if isinstance(vectors, Mapping):
        return {f"bundle_emb.{name}.{k}": v.detach().cpu().reshape(-1, v.shape[-1]).clone()
                for k, v in vectors.items()}
    return {f"bundle_emb.{name}.string_to_param.*": vectors.detach().cpu().reshape(-1, vectors.shape[-1]).clone()}
