"""ERNIE-Image transformer files: the original layout is diffusers' ``ErnieImageTransformer2DModel`` names (baidu's
release and ComfyUI's ``comfy/ldm/ernie/model.py`` use the same module paths; diffusers' single-file converter
``convert_ernie_image_transformer_checkpoint_to_diffusers`` only strips ``model.diffusion_model.``). What a file
cannot say by its names is the config: :func:`config_from_state` reads it from the tensors' shapes."""

from __future__ import annotations

from typing import Any, Dict, Mapping

# the released transformer (baidu/ERNIE-Image, 8B): ComfyUI's ErnieImageModel defaults
CONFIG: Dict[str, Any] = {"_class_name": "ErnieImageTransformer2DModel", "hidden_size": 4096, "num_attention_heads": 32,
                          "num_layers": 36, "ffn_hidden_size": 12288, "in_channels": 128, "out_channels": 128,
                          "patch_size": 1, "text_in_dim": 3072, "rope_theta": 256, "rope_axes_dim": [32, 48, 48],
                          "eps": 1e-6, "qk_layernorm": True}


def strip_prefix(state: Mapping[str, Any]) -> Dict[str, Any]:
    """ComfyUI's ``model.diffusion_model.`` removed, as diffusers' converter does."""
    return {k.split("model.diffusion_model.", 1)[-1]: v for k, v in state.items()}


def config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a diffusers config, or the released model's) with the sizes the file's tensors tell."""
    cfg = dict(CONFIG, **dict(base))
    hidden, in_ch, patch, _ = state["x_embedder.proj.weight"].shape
    head = int(state["layers.0.self_attention.norm_q.weight"].shape[0])
    text = state.get("text_proj.weight")
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    cfg.update(hidden_size=int(hidden), num_attention_heads=int(hidden) // head, num_layers=layers,
               ffn_hidden_size=int(state["layers.0.mlp.up_proj.weight"].shape[0]), in_channels=int(in_ch),
               out_channels=int(state["final_linear.weight"].shape[0]) // int(patch) ** 2, patch_size=int(patch),
               text_in_dim=int(hidden) if text is None else int(text.shape[1]))
    if sum(cfg["rope_axes_dim"]) != head:  # rope axes fill the head (tiny models)
        t = head // 8 * 2
        cfg["rope_axes_dim"] = [t, (head - t) // 2, head - t - (head - t) // 2]
    return cfg
