"""The full-size configs of each family's public models, without their weights: what builds the real model
from configs alone (the VRAM estimator, ``trainer/memory/estimate.py``, builds it from them on fake tensors, so a
hub id that is not downloaded still gets a VRAM estimate).

A family that has them keeps a ``full_size.py`` module in its folder with ``FULL_SIZE = {variant: spec}``;
a spec names the family's built-in tiny model (``tiny``: its folder gives the pipeline layout, scheduler
config and tokenizers) and the components whose configs are the real ones (``configs``: component ->
config values laid over the tiny model's config; ``None`` values drop a key), and optionally tokenizer
lengths (``max_length``: tokenizer folder -> the real tokenizer's ``model_max_length``) and pipeline settings
(``model_index``: values laid over its ``model_index.json``). Component
configs shared by several families (CLIP-L, CLIP-G, T5-XXL, the Flux/SD3 VAEs, Qwen3-4B, Qwen2.5-VL-7B)
are here. Values are those of the models' published ``config.json`` files (named at each).

Public API: :func:`spec_for`, :func:`config_folder`."""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

from trainer.families import info_for

# openai/clip-vit-large-patch14 (text tower): Flux.1's text_encoder, SD 3.5's text_encoder (with projection)
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 768, "hidden_act": "quick_gelu",
          "layer_norm_eps": 1e-05}
# laion/CLIP-ViT-bigG-14 (text tower): SD 3.5's text_encoder_2 (as SDXL's)
CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
          "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 1280, "hidden_act": "gelu",
          "layer_norm_eps": 1e-05}
# google/t5-v1_1-xxl encoder: Flux.1's text_encoder_2, SD 3.5's text_encoder_3, Chroma's text_encoder
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24,
          "vocab_size": 32128, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-06}
# black-forest-labs/FLUX.1-dev vae/config.json (Flux.1, Chroma and Z-Image use it)
FLUX_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 16,
            "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "force_upcast": True}
# stabilityai/stable-diffusion-3.5-large vae/config.json: the Flux.1 layout with SD3's scale and shift
SD3_VAE = {**FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
# Qwen/Qwen3-4B: Z-Image's and Flux.2 [klein] 4B's text encoder
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-06, "layer_types": None, "max_window_layers": 36}
# Qwen/Qwen2.5-VL-7B-Instruct: Qwen-Image's text encoder (its vision tower included, as the pipeline loads it)
QWEN25_VL_7B = {
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "layer_types": None,
                    "max_window_layers": 28,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                        "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}
# Qwen/Qwen-Image vae/config.json (AutoencoderKLQwenImage; Krea 2 uses it too)
QWEN_IMAGE_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                  "temperal_downsample": [False, True, True], "dropout": 0.0}
# google/gemma-2-2b: Lumina 2's and Sana's text encoder
GEMMA2_2B = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-06, "sliding_window": 4096, "query_pre_attn_scalar": 256,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
             "layer_types": None}
#: ``model_max_length`` of the real tokenizers (the families cap the length they use themselves)
T5_MAX_LENGTH = 512
QWEN_MAX_LENGTH = 131072

_VERSION = 1
_STAMP = ".atelier-full-size"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".ckpt")


def _family_module(variant: str) -> Any:
    """The ``full_size`` module of ``variant``'s family folder, or None."""
    package = info_for(variant).family_class.split(":")[0].rsplit(".", 1)[0]
    try:
        return importlib.import_module(package + ".full_size")
    except ModuleNotFoundError:
        return None


def spec_for(variant: str) -> Optional[Dict[str, Any]]:
    """The full-size spec of ``variant`` (``model.family`` value), or None when its family ships none."""
    module = _family_module(variant)
    return getattr(module, "FULL_SIZE", {}).get(variant) if module is not None else None


def _merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rope_parameters":
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_folder(variant: str, cache_root: Path, prediction_type: Optional[str] = None) -> Path:
    """``cache_root/configs/<variant>/``: the family's tiny diffusers folder without weights, with the real
    models' component configs and tokenizer lengths (built once; rebuilt when the spec changes). A family whose
    ``full_size`` module has its own ``config_folder`` (the SD lineage: whole shipped configs, chosen by
    ``prediction_type``) gives that instead. Raises ValueError naming what to do when the family ships none."""
    module = _family_module(variant)
    own = getattr(module, "config_folder", None)
    if own is not None:
        return own(variant, cache_root, prediction_type)
    spec = spec_for(variant)
    if spec is None:
        raise ValueError(f"no full-size configs are shipped for {variant}: point model.path at a local diffusers "
                         "folder of the model (only its config files are read)")
    fingerprint = hashlib.sha256(json.dumps([_VERSION, variant, spec], sort_keys=True).encode()).hexdigest()
    parent = Path(cache_root) / "configs"
    target = parent / variant
    try:
        if (target / _STAMP).read_text(encoding="utf-8") == fingerprint:
            return target
    except OSError:
        pass
    info = info_for(variant)
    module_name, func = info.tiny[spec["tiny"]].split(":")
    tiny = Path(getattr(importlib.import_module(module_name), func)(spec["tiny"], Path(cache_root) / "models")["diffusers"])
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}.building-", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        for src in sorted(tiny.rglob("*")):
            if src.is_file() and not src.name.endswith(_WEIGHTS) and not src.name.startswith(".atelier"):
                dst = tmp / src.relative_to(tiny)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        for component, values in spec["configs"].items():
            path = tmp / component / "config.json"
            if not path.is_file():  # an image processor's settings
                path = tmp / component / "preprocessor_config.json"
            path.write_text(json.dumps(_merge(json.loads(path.read_text(encoding="utf-8")), values), indent=2) + "\n",
                            encoding="utf-8")
        if spec.get("model_index"):  # pipeline settings a real folder's model_index.json holds (Krea 2's taps)
            path = tmp / "model_index.json"
            index = {**json.loads(path.read_text(encoding="utf-8")), **spec["model_index"]}
            path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for tokenizer, length in spec.get("max_length", {}).items():
            path = tmp / tokenizer / "tokenizer_config.json"
            config = json.loads(path.read_text(encoding="utf-8"))
            config["model_max_length"] = int(length)
            path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / _STAMP).write_text(fingerprint, encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = ["CLIP_G", "CLIP_L", "FLUX_VAE", "QWEN25_VL_7B", "QWEN3_4B", "SD3_VAE", "T5_XXL", "config_folder",
           "spec_for"]
