"""Ideogram 4 transformer keys: the original single file (Ideogram's release, ComfyUI's ``ideogram4`` model) ↔
diffusers' ``Ideogram4Transformer2DModel``.

The two layouts differ in the attention alone (read in ComfyUI ``comfy/ldm/ideogram4/model.py`` and diffusers 0.42.1
``transformer_ideogram4.py`` / ``_convert_non_diffusers_ideogram4_lora_to_diffusers``): the original fuses q/k/v into
``attention.qkv`` (rows q, k, v, each as wide as the model) and names the output ``attention.o``; diffusers has
``attention.to_q/to_k/to_v`` and ``attention.to_out.0``. Every other key is the same in both. diffusers 0.42.1 ships no
single-file converter for the model, so these maps are the one Atelier reads and writes with. Ideogram's fp8 release
stores each Linear weight in float8 with a ``<name>.weight_scale`` beside it: the key names are these.

The released file may carry a prefix (ComfyUI's ``model.diffusion_model.``, ``diffusion_model.``, or
``conditional_transformer.`` as diffusers' LoRA converter also strips); it is dropped on reading."""

from __future__ import annotations

from typing import Any, Dict, Mapping

# Ideogram4Transformer2DModel's defaults are the released model (ideogram-ai/ideogram-v4 transformer/config.json)
CONFIG: Dict[str, Any] = {"_class_name": "Ideogram4Transformer2DModel", "in_channels": 128, "num_layers": 34,
                          "attention_head_dim": 256, "num_attention_heads": 18, "intermediate_size": 12288,
                          "adaln_dim": 512, "llm_features_dim": 53248, "rope_theta": 5_000_000,
                          "mrope_section": [24, 20, 20], "norm_eps": 1e-5}
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "conditional_transformer.")
# the other components of an all-in-one checkpoint
OTHER_PARTS = ("first_stage_model.", "text_encoders.", "cond_stage_model.", "vae.", "unconditional_transformer.")
_QKV = ("attention.to_q", "attention.to_k", "attention.to_v")


def strip_prefix(key: str) -> str:
    """``key`` without the first of :data:`PREFIXES` it starts with."""
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def original_module(path: str) -> str:
    """A diffusers module path -> its original module path (q/k/v -> the fused ``attention.qkv``)."""
    block, _, rest = path.rpartition(".attention.")
    if block and rest in ("to_q", "to_k", "to_v"):
        return f"{block}.attention.qkv"
    if block and rest == "to_out.0":
        return f"{block}.attention.o"
    return path


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors (with or without a prefix) as diffusers' tensors; q/k/v are three equal row blocks."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if key.startswith(OTHER_PARTS):
            continue
        key = strip_prefix(key)
        module, _, end = key.rpartition(".")
        if module.endswith(".attention.qkv"):
            block = module[:-len(".qkv")]
            for part, tensor in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                out[f"{block}.{part}.{end}"] = tensor
        elif module.endswith(".attention.o"):
            out[f"{module[:-len('.o')]}.to_out.0.{end}"] = value
        else:
            out[key] = value
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers` (no prefix, as ComfyUI's diffusion-model loader reads it)."""
    import torch  # here: detect.py (validate's torch-free path) imports this module for its key names
    out: Dict[str, Any] = {}
    for key, value in state.items():
        module, _, end = key.rpartition(".")
        if module.endswith(_QKV[1:]):
            continue
        if module.endswith(_QKV[0]):
            value = torch.cat([value, state[key.replace(".to_q.", ".to_k.")], state[key.replace(".to_q.", ".to_v.")]])
        out[f"{original_module(module)}.{end}"] = value
    return out


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """An Ideogram4Transformer2DModel config for original-layout weights: ``base`` (a local folder's config, else the
    released model's) with the sizes the tensors tell (the head width, which no tensor holds alone, from the q/k
    norm)."""
    state = {strip_prefix(k): v for k, v in state.items()}
    cfg = dict(CONFIG, **dict(base))
    hidden, in_channels = state["input_proj.weight"].shape
    head = int(state["layers.0.attention.norm_q.weight"].shape[0])
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    cfg.update(in_channels=int(in_channels), num_layers=layers, attention_head_dim=head,
               num_attention_heads=int(hidden) // head,
               intermediate_size=int(state["layers.0.feed_forward.w1.weight"].shape[0]),
               adaln_dim=int(state["adaln_proj.weight"].shape[0]),
               llm_features_dim=int(state["llm_cond_proj.weight"].shape[1]))
    if 2 * sum(cfg["mrope_section"]) != head:  # the rotary sections fill half a head (tiny models)
        side = head // 8
        cfg["mrope_section"] = [head // 2 - 2 * side, side, side]
    return cfg
