"""Krea 2 transformer keys: the original single file (krea-ai's, ComfyUI's ``model.diffusion_model.`` checkpoints)
↔ diffusers' ``Krea2Transformer2DModel``.

The renames are diffusers 0.42.1's ``convert_krea2_transformer_checkpoint_to_diffusers`` (single_file_utils.py) and
its LoRA converter's module table (``_convert_non_diffusers_krea2_lora_to_diffusers``), both ways: every Linear keeps
its shape (no fused q/k/v), the norms' ``scale`` is diffusers' ``weight``, and a block's six modulation vectors are one
flat ``mod.lin`` [6·hidden] in the original file and a ``scale_shift_table`` [6, hidden] in diffusers."""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

# krea/Krea-2-Raw transformer/config.json as Krea2Transformer2DModel's defaults describe the released model
CONFIG: Dict[str, Any] = {"_class_name": "Krea2Transformer2DModel", "in_channels": 64, "num_layers": 28,
                          "attention_head_dim": 128, "num_attention_heads": 48, "num_key_value_heads": 12,
                          "intermediate_size": 16384, "timestep_embed_dim": 256, "text_hidden_dim": 2560,
                          "num_text_layers": 12, "text_num_attention_heads": 20, "text_num_key_value_heads": 20,
                          "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
                          "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0, "norm_eps": 1e-5}

# whole-path renames of the top-level modules (original -> diffusers), Linears and norms
_TOP = {"first": "img_in", "tmlp.0": "time_embed.linear_1", "tmlp.2": "time_embed.linear_2",
        "tproj.1": "time_mod_proj", "txtmlp.0": "txt_in.norm", "txtmlp.1": "txt_in.linear_1",
        "txtmlp.3": "txt_in.linear_2", "txtfusion.projector": "text_fusion.projector", "last.linear": "final_layer.linear",
        "last.norm": "final_layer.norm"}
# inside a block (the image blocks and the text fusion's layerwise/refiner blocks)
_INNER = {"attn.wq": "attn.to_q", "attn.wk": "attn.to_k", "attn.wv": "attn.to_v", "attn.wo": "attn.to_out.0",
          "attn.gate": "attn.to_gate", "attn.qknorm.qnorm": "attn.norm_q", "attn.qknorm.knorm": "attn.norm_k",
          "mlp.gate": "ff.gate", "mlp.up": "ff.up", "mlp.down": "ff.down", "prenorm": "norm1", "postnorm": "norm2"}
_BLOCKS = {"blocks": "transformer_blocks", "txtfusion.layerwise_blocks": "text_fusion.layerwise_blocks",
           "txtfusion.refiner_blocks": "text_fusion.refiner_blocks"}
_ORIG_BLOCK = re.compile(r"^(blocks|txtfusion\.layerwise_blocks|txtfusion\.refiner_blocks)\.(\d+)\.(.+)$")
_DIFF_BLOCK = re.compile(r"^(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)\.(\d+)\.(.+)$")
_INV = {"top": {v: k for k, v in _TOP.items()}, "inner": {v: k for k, v in _INNER.items()},
        "blocks": {v: k for k, v in _BLOCKS.items()}}
# the norms' parameter: ``scale`` in the original file, ``weight`` in diffusers
_NORMS = ("txtmlp.0", "last.norm", "attn.qknorm.qnorm", "attn.qknorm.knorm", "prenorm", "postnorm")


def original_module(path: str) -> str:
    """A diffusers module path's original name (KeyError: a module the original layout does not have)."""
    m = _DIFF_BLOCK.match(path)
    if m:
        return f"{_INV['blocks'][m.group(1)]}.{m.group(2)}.{_INV['inner'][m.group(3)]}"
    return _INV["top"][path]


def diffusers_module(name: str) -> str:
    """An original module name's diffusers path (KeyError: none)."""
    m = _ORIG_BLOCK.match(name)
    if m:
        return f"{_BLOCKS[m.group(1)]}.{m.group(2)}.{_INNER[m.group(3)]}"
    return _TOP[name]


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The original file's tensors (``model.diffusion_model.`` already removed) under diffusers' names."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if key == "last.modulation.lin":
            out["final_layer.scale_shift_table"] = value
            continue
        module, _, param = key.rpartition(".")
        if param == "lin" and module.endswith(".mod"):  # a block's flat modulation table
            block = _ORIG_BLOCK.match(module)
            out[f"{_BLOCKS[block.group(1)]}.{block.group(2)}.scale_shift_table"] = value.reshape(6, -1)
            continue
        out[f"{diffusers_module(module)}.{'weight' if param == 'scale' else param}"] = value
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`original_to_diffusers`: the original single file's tensors."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if key == "final_layer.scale_shift_table":
            out["last.modulation.lin"] = value
            continue
        module, _, param = key.rpartition(".")
        if param == "scale_shift_table":
            block = _DIFF_BLOCK.match(f"{module}.x")
            out[f"{_INV['blocks'][block.group(1)]}.{block.group(2)}.mod.lin"] = value.reshape(-1)
            continue
        name = original_module(module)
        is_norm = name.endswith(_NORMS)
        out[f"{name}.{'scale' if is_norm and param == 'weight' else param}"] = value
    return out


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the original file's tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    hidden, in_ch = state["first.weight"].shape
    head = int(state["blocks.0.attn.qknorm.qnorm.scale"].shape[0])
    text_head = int(state["txtfusion.refiner_blocks.0.attn.qknorm.qnorm.scale"].shape[0])
    text_dim = int(state["txtmlp.1.weight"].shape[1])

    def count(prefix: str) -> int:
        return 1 + max(int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix))

    cfg.update(in_channels=int(in_ch), attention_head_dim=head, num_attention_heads=int(hidden) // head,
               num_key_value_heads=int(state["blocks.0.attn.wk.weight"].shape[0]) // head,
               intermediate_size=int(state["blocks.0.mlp.up.weight"].shape[0]),
               timestep_embed_dim=int(state["tmlp.0.weight"].shape[1]), text_hidden_dim=text_dim,
               num_text_layers=int(state["txtfusion.projector.weight"].shape[1]),
               text_num_attention_heads=text_dim // text_head,
               text_num_key_value_heads=int(state["txtfusion.refiner_blocks.0.attn.wk.weight"].shape[0]) // text_head,
               text_intermediate_size=int(state["txtfusion.refiner_blocks.0.mlp.up.weight"].shape[0]),
               num_layers=count("blocks."), num_layerwise_text_blocks=count("txtfusion.layerwise_blocks."),
               num_refiner_text_blocks=count("txtfusion.refiner_blocks."))
    if sum(cfg["axes_dims_rope"]) != head:  # rope axes fill the head (tiny models)
        t = head // 8 * 2
        cfg["axes_dims_rope"] = [t, (head - t) // 2, head - t - (head - t) // 2]
    return cfg
