"""The SD lineage's LoRA facts: default targets, the LoRA file header, and kohya files from an SD pipeline's parts.

The family (``LatentDiffusionFamily``) hands the generic writers of :mod:`trainer.formats` its namer
(:func:`~trainer.families.common.sd_kit.keys.sd_namer`) and this header; the SD-parts entry points below do the
same for callers that hold a pipeline's ``unet``/``text_encoder``/``text_encoder_2`` and its variant name.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Mapping

from trainer.families.common.sd_kit.keys import sd_namer, sd_variant
from trainer.formats.kohya import kohya_lora_state_dict, load_lora_kohya_into_peft, lora_layers, named_targets
from trainer.formats.metadata import modelspec_common

if TYPE_CHECKING:
    import torch

# ``parts.denoiser.lora_targets`` presets -> UNet module-name endings
UNET_TARGETS: Dict[str, List[str]] = {
    "attn": ["to_q", "to_k", "to_v", "to_out.0"],
    "attn_mlp": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"],
    # LoCon: kohya's conv targets (ResNet convs, shortcuts, down/up-sampler convs) on top.
    "all": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
            "conv1", "conv2", "conv_shortcut", "conv", "time_emb_proj"],
}
# out_proj/fc1/fc2 as kohya does: q/k/v alone is not loadable by diffusers (LIBRARY-NOTES).
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def lora_metadata(family: str, *, title: str, prediction_type: str = "epsilon",
                  resolution: tuple[int, int] | int | None = None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The family-specific header keys kohya users and model sites read (``ss_*``, ``modelspec.*``).

    Only facts we know are written; ``save_lora_kohya`` adds what it can read from the tensors
    (``ss_network_dim``, ``ss_network_alpha``, ``ss_network_args``). ``extra`` wins on conflicts.
    """
    variant = sd_variant(family)
    pred = {"v_prediction": "v", "v": "v", "epsilon": "epsilon"}.get(prediction_type)
    if pred is None:
        raise ValueError(f"unknown prediction type {prediction_type!r}; use 'epsilon' or 'v_prediction'")
    meta = {
        "ss_base_model_version": variant.base_model_version + ("_v" if pred == "v" and variant.v_suffix else ""),
        "ss_v2": str(variant.ss_v2),
        "ss_network_module": "networks.lora",
        "modelspec.architecture": variant.architecture[pred] + "/lora",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.prediction_type": pred,
        **modelspec_common(title=title, resolution=resolution),
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


# --------------------------------------------------------------------------------------------
# kohya files from an SD pipeline's parts
# --------------------------------------------------------------------------------------------

def _parts(unet: Any, text_encoder: Any, text_encoder_2: Any) -> Dict[str, Any]:
    return {"unet": unet, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2}


def sd_named_targets(unet: Any, text_encoder: Any, text_encoder_2: Any, adapter: str,
                     family: str) -> dict[str, tuple[str, Any]]:
    """kohya name -> (module path, peft LoRA layer) over an SD/SDXL model's parts (None: not adapted)."""
    return named_targets(_parts(unet, text_encoder, text_encoder_2),
                         sd_namer(family, unet, text_encoder, text_encoder_2), adapter, lora_layers)


def sd_kohya_lora_state_dict(unet: Any = None, text_encoder: Any = None, text_encoder_2: Any = None,
                             adapter_name: str = "default", family: str = "sd15", *,
                             dora_format: str = "lycoris") -> dict[str, "torch.Tensor"]:
    """:func:`trainer.formats.kohya.kohya_lora_state_dict` of an SD1/SD2/SDXL model's parts: ``lora_unet_`` +
    diffusers module path (SD1/2; original block names for SDXL), ``lora_te_`` (``lora_te1_``/``lora_te2_`` for
    SDXL) + ``text_model_...``."""
    return kohya_lora_state_dict(_parts(unet, text_encoder, text_encoder_2),
                                 sd_namer(family, unet, text_encoder, text_encoder_2), adapter_name,
                                 dora_format=dora_format)


def sd_load_lora_kohya_into_peft(path: str | os.PathLike | Mapping[str, "torch.Tensor"], unet: Any = None,
                                 text_encoder: Any = None, text_encoder_2: Any = None, *,
                                 adapter_name: str = "default", family: str = "sd15", strict: bool = True,
                                 dora_format: str = "lycoris") -> int:
    """:func:`trainer.formats.kohya.load_lora_kohya_into_peft` into an SD1/SD2/SDXL model's parts."""
    return load_lora_kohya_into_peft(path, _parts(unet, text_encoder, text_encoder_2),
                                     sd_namer(family, unet, text_encoder, text_encoder_2),
                                     adapter_name=adapter_name, strict=strict, dora_format=dora_format)
