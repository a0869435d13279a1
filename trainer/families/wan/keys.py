"""Wan transformer keys: the original single file (Wan-AI's release, ComfyUI's repackaged files) ↔ diffusers'
``WanTransformer3DModel``. Original → diffusers is diffusers' own ``convert_wan_transformer_to_diffusers``;
:func:`diffusers_to_original` inverts it (``self_attn``/``cross_attn``, ``q``/``k``/``v``/``o``, ``ffn.0``/``ffn.2``,
``modulation``, ``head.head``, and the swap of the two block norms: diffusers' ``norm2`` is the original ``norm3``).
:func:`module_to_original` names one adapted module the way LoRA files for ComfyUI's Wan nodes do."""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json; the 14B model differs in heads, FFN width and depth
CONFIG_13B: Dict[str, Any] = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2],
                              "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
                              "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
                              "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
                              "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024}
CONFIG_14B: Dict[str, Any] = dict(CONFIG_13B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and -720P): 36 input channels (noise ‖ mask ‖ first-frame latents), CLIP
# ViT-H/14 image features (1280 wide) through their own key/value projections in every cross-attention
CONFIG_14B_I2V: Dict[str, Any] = dict(CONFIG_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# Wan-AI/Wan2.2-I2V-A14B-Diffusers: each expert 36 input channels, no image features
CONFIG_A14B_I2V: Dict[str, Any] = dict(CONFIG_14B, in_channels=36)

# diffusers module path → original, applied in order to a dotted path (whole parts only)
_TOP = (("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
        ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
        ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
        ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
        ("condition_embedder.time_proj", "time_projection.1"),
        ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
        ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
        ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
        ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
        ("proj_out", "head.head"), ("scale_shift_table", "head.modulation"))
_ATTN = {"attn1": "self_attn", "attn2": "cross_attn"}
_PROJ = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "add_k_proj": "k_img", "add_v_proj": "v_img",
         "norm_added_k": "norm_k_img"}
_OTHER = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "scale_shift_table": "modulation", "norm2": "norm3",
          "norm3": "norm2"}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _swap(path: str, table: Mapping[str, str]) -> str:
    """``path`` with its leading part(s) renamed by ``table`` (whole dotted parts only)."""
    for ours, theirs in table.items():
        if path == ours or path.startswith(ours + "."):
            return theirs + path[len(ours):]
    return path


def module_to_original(path: str) -> str:
    """A diffusers module (or parameter) path as the original file names it: ``blocks.0.attn1.to_q`` →
    ``blocks.0.self_attn.q``, ``condition_embedder.time_proj`` → ``time_projection.1``."""
    m = _BLOCK.match(path)
    if m is None:
        return _swap(path, dict(_TOP))
    rest = m.group(2)
    head = rest.split(".", 1)[0]
    if head in _ATTN:
        inner = rest[len(head) + 1:]
        rest = _ATTN[head] + ("." + _swap(inner, _PROJ) if inner else "")
    else:
        rest = _swap(rest, _OTHER)
    return f"blocks.{m.group(1)}.{rest}"


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    return convert_wan_transformer_to_diffusers(dict(state))


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    return {module_to_original(k): v for k, v in state.items()}


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)), default=-1)


def config_from_original(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """A WanTransformer3DModel config for original-layout weights: ``base`` (a local folder's transformer config)
    with the sizes the tensors tell."""
    cfg = dict(CONFIG_13B, **dict(base))
    patch = state["patch_embedding.weight"]
    dim, in_channels = int(patch.shape[0]), int(patch.shape[1])
    head = int(cfg.get("attention_head_dim", 128))
    if dim % head:  # a model whose heads are narrower than the released ones' (tiny models): keep its base's count
        head = dim // int(cfg["num_attention_heads"])
    cfg.update(in_channels=in_channels, out_channels=int(state["head.head.weight"].shape[0]) // int(patch[0].numel()
               // in_channels), num_layers=_count(state, "blocks."), attention_head_dim=head,
               num_attention_heads=dim // head, ffn_dim=int(state["blocks.0.ffn.0.weight"].shape[0]),
               text_dim=int(state["text_embedding.0.weight"].shape[1]),
               freq_dim=int(state["time_embedding.0.weight"].shape[1]), patch_size=list(patch.shape[2:]))
    if "img_emb.proj.1.weight" in state:
        cfg.update(image_dim=int(state["img_emb.proj.1.weight"].shape[1]), added_kv_proj_dim=dim)
    else:  # text-to-video, or a Wan 2.2 I2V expert: no image features whatever the base config says
        cfg.update(image_dim=None, added_kv_proj_dim=None)
    return cfg
