"""Keys of the Flux-architecture transformers (Flux.1, Chroma): diffusers (``FluxTransformer2DModel``,
``ChromaTransformer2DModel``) ↔ the original BFL layout that the downloaded ``flux1-dev.safetensors`` /
``chroma*.safetensors``, ComfyUI's UNet loader and kohya use.

The map follows diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` and
``convert_chroma_transformer_checkpoint_to_diffusers`` (loaders/single_file_utils.py), in both directions; it is
written here because those functions split the single blocks' fused ``linear1`` with a hard-coded width of 3072
(any other size loads wrong), and diffusers has no diffusers → BFL direction at all (needed to save fine-tunes as
the single file people use). Sizes are read from the tensors. Differences of layout: BFL fuses q/k/v
(``img_attn.qkv``, ``txt_attn.qkv``; in single blocks q/k/v and the MLP input in ``linear1``), and its final
AdaLayerNorm stores (shift, scale) where diffusers stores (scale, shift). Chroma has no per-block modulation, no
final modulation and no time/vector/guidance embedders: its ``distilled_guidance_layer`` (an approximator MLP)
gives every block its modulation; entries a model does not have are skipped both ways.
"""

from __future__ import annotations

from typing import Dict

import torch

# one-to-one renames, BFL -> diffusers (weights and biases alike unless noted)
_TOP = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_GUIDANCE = {"in_layer": "linear_1", "out_layer": "linear_2"}  # Chroma's distilled_guidance_layer.layers.N
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
_FUSED = {  # BFL fused weight -> the diffusers parts it holds, in order
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def strip_prefix(state: Dict[str, "object"]) -> Dict[str, "object"]:
    """Keys without a ComfyUI/original checkpoint prefix (``model.diffusion_model.``)."""
    out = {}
    for k, v in state.items():
        for p in PREFIXES:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def _swap_halves(t):
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def block_count(state, kind: str) -> int:
    return 1 + max((int(k.split(".")[1]) for k in state if k.startswith(kind + ".")), default=-1)


def bfl_to_diffusers(state: Dict[str, "object"]) -> Dict[str, "object"]:
    """A BFL-layout Flux/Chroma transformer state dict as diffusers keys."""
    state = strip_prefix(dict(state))
    out: Dict[str, object] = {}
    for bfl, ours in _TOP.items():
        for suffix in ("weight", "bias"):
            if f"{bfl}.{suffix}" in state:
                out[f"{ours}.{suffix}"] = state[f"{bfl}.{suffix}"]
    for suffix in ("weight", "bias"):
        if f"final_layer.adaLN_modulation.1.{suffix}" in state:  # Chroma has none
            out[f"norm_out.linear.{suffix}"] = _swap_halves(state[f"final_layer.adaLN_modulation.1.{suffix}"])
    for k, v in state.items():  # Chroma's approximator: in_proj/out_proj as they are, layers renamed, norms' scale
        if k.startswith("distilled_guidance_layer."):
            for bfl, ours in _GUIDANCE.items():
                k = k.replace(f".{bfl}.", f".{ours}.")
            out[k[:-len(".scale")] + ".weight" if k.endswith(".scale") else k] = v
    for i in range(block_count(state, "double_blocks")):
        src, dst = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for bfl, ours in _DOUBLE.items():
            for suffix in ("weight", "bias"):
                if f"{src}{bfl}.{suffix}" in state:  # Chroma: no img_mod/txt_mod
                    out[f"{dst}{ours}.{suffix}"] = state[f"{src}{bfl}.{suffix}"]
        for bfl, ours in _DOUBLE_NORMS.items():
            out[dst + ours] = state[src + bfl]
        for bfl, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                for name, chunk in zip(parts, state[f"{src}{bfl}.{suffix}"].chunk(3, dim=0)):
                    out[f"{dst}{name}.{suffix}"] = chunk
    for i in range(block_count(state, "single_blocks")):
        src, dst = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        for bfl, ours in _SINGLE.items():
            for suffix in ("weight", "bias"):
                if f"{src}{bfl}.{suffix}" in state:  # Chroma: no modulation
                    out[f"{dst}{ours}.{suffix}"] = state[f"{src}{bfl}.{suffix}"]
        for bfl, ours in _SINGLE_NORMS.items():
            out[dst + ours] = state[src + bfl]
        inner = state[f"{src}linear2.weight"].shape[0]  # linear2 maps [attn ‖ mlp] back to the width
        for suffix in ("weight", "bias"):
            fused = state[f"{src}linear1.{suffix}"]
            q, k, v, mlp = fused.split([inner, inner, inner, fused.shape[0] - 3 * inner], dim=0)
            for name, part in (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v), ("proj_mlp", mlp)):
                out[f"{dst}{name}.{suffix}"] = part
    return out


def diffusers_to_bfl(state: Dict[str, "object"]) -> Dict[str, "object"]:
    """Flux/Chroma transformer weights in the original BFL layout (the inverse of :func:`bfl_to_diffusers`)."""
    out: Dict[str, object] = {}
    for bfl, ours in _TOP.items():
        for suffix in ("weight", "bias"):
            if f"{ours}.{suffix}" in state:
                out[f"{bfl}.{suffix}"] = state[f"{ours}.{suffix}"]
    for suffix in ("weight", "bias"):
        if f"norm_out.linear.{suffix}" in state:
            out[f"final_layer.adaLN_modulation.1.{suffix}"] = _swap_halves(state[f"norm_out.linear.{suffix}"])
    for k, v in state.items():
        if k.startswith("distilled_guidance_layer."):
            for bfl, ours in _GUIDANCE.items():
                k = k.replace(f".{ours}.", f".{bfl}.")
            out[k[:-len(".weight")] + ".scale" if ".norms." in k else k] = v
    n_double = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")), default=-1)
    for i in range(n_double):
        src, dst = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for bfl, ours in _DOUBLE.items():
            for suffix in ("weight", "bias"):
                if f"{src}{ours}.{suffix}" in state:
                    out[f"{dst}{bfl}.{suffix}"] = state[f"{src}{ours}.{suffix}"]
        for bfl, ours in _DOUBLE_NORMS.items():
            out[dst + bfl] = state[src + ours]
        for bfl, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                out[f"{dst}{bfl}.{suffix}"] = torch.cat([state[f"{src}{p}.{suffix}"] for p in parts], dim=0)
    n_single = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")),
                       default=-1)
    for i in range(n_single):
        src, dst = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for bfl, ours in _SINGLE.items():
            for suffix in ("weight", "bias"):
                if f"{src}{ours}.{suffix}" in state:
                    out[f"{dst}{bfl}.{suffix}"] = state[f"{src}{ours}.{suffix}"]
        for bfl, ours in _SINGLE_NORMS.items():
            out[dst + bfl] = state[src + ours]
        for suffix in ("weight", "bias"):
            out[f"{dst}linear1.{suffix}"] = torch.cat(
                [state[f"{src}{p}.{suffix}"] for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")], dim=0)
    return out
