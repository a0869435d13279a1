"""LoRA files in the diffusers/peft layout: ``<prefix>.<module path>.lora_A.weight`` / ``.lora_B.weight``.

The transformer families (Flux, PixArt) save their denoiser's LoRA this way because it is the one layout
both diffusers (``load_lora_weights``, or peft's ``set_peft_model_state_dict``) and ComfyUI read for them
(comfy/lora.py ``model_lora_keys_unet``: ``transformer.{diffusers key}`` for Flux and PixArt; ``load_lora``
reads ``{x}.lora_A.weight``/``{x}.lora_B.weight``). Neither reads an alpha for these keys, so the scale
α/r is baked into ``lora_B`` and the file means exactly what was trained.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping

import torch

from trainer.formats.kohya import check_plain_lora, kohya_alpha, lora_layers

Rename = Callable[[str], str]


def _same(path: str) -> str:
    return path


def peft_layout_state_dict(modules: Mapping[str, Any], prefixes: Mapping[str, str], adapter_name: str = "default",
                           renames: Mapping[str, Rename] = {}) -> Dict[str, Any]:
    """slot -> peft-wrapped module in, file tensors out (``{prefix}.{rename(path)}.lora_A/B.weight``)."""
    out: Dict[str, Any] = {}
    for slot, module in modules.items():
        rename = renames.get(slot, _same)
        for path, layer in lora_layers(module, adapter_name):
            check_plain_lora(path, layer, adapter_name)
            if adapter_name in layer.lora_magnitude_vector:
                raise ValueError("DoRA is not written in the diffusers/peft LoRA layout yet: use lora.type = lora")
            key = f"{prefixes[slot]}.{rename(path)}"
            scale = kohya_alpha(layer, adapter_name) / layer.r[adapter_name]
            out[f"{key}.lora_A.weight"] = layer.lora_A[adapter_name].weight.detach().cpu().clone()
            out[f"{key}.lora_B.weight"] = layer.lora_B[adapter_name].weight.detach().cpu().clone() * scale
    return out


def load_peft_layout(state: Mapping[str, Any], modules: Mapping[str, Any], prefixes: Mapping[str, str],
                     adapter_name: str = "default", renames: Mapping[str, Rename] = {}) -> set:
    """Copy a file of :func:`peft_layout_state_dict` into fresh peft layers (``lora.init_weights``);
    returns the file keys used. A layer the file lacks raises, naming it."""

    used = set()
    for slot, module in modules.items():
        rename = renames.get(slot, _same)
        for path, layer in lora_layers(module, adapter_name):
            key = f"{prefixes[slot]}.{rename(path)}"
            a, b = state.get(f"{key}.lora_A.weight"), state.get(f"{key}.lora_B.weight")
            if a is None or b is None:
                raise ValueError(f"the LoRA file has no {key}.lora_A/lora_B (targets or components differ?)")
            with torch.no_grad():
                layer.lora_A[adapter_name].weight.copy_(a)
                layer.lora_B[adapter_name].weight.copy_(b / layer.scaling[adapter_name])
            used.update({f"{key}.lora_A.weight", f"{key}.lora_B.weight"})
    return used


def clip_text_model(path: str) -> str:
    """transformers 5's CLIPTextModel is flat; files name its modules ``text_model.…``."""
    return path if path.startswith("text_model.") else "text_model." + path


def target_regex(endings) -> str:
    """peft ``target_modules`` regex for module-name endings ('*' matches one path part)."""
    parts = [re.escape(e).replace(r"\*", r"[^.]+") for e in endings]
    return r"^(.*\.)?(" + "|".join(parts) + r")$"
