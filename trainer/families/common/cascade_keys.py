"""Key maps of the Würstchen-lineage priors: Stable Cascade stage C (diffusers ``StableCascadeUNet``) and the
Würstchen 2 prior (diffusers ``WuerstchenPrior``). Importable without torch (only the converters import it).

Original layout vs diffusers
----------------------------
The original checkpoints (Stability-AI/StableCascade ``stage_c.safetensors`` / ``stage_c_lite.safetensors`` /
``stage_b*.safetensors``; dome272/wuerstchen ``model_v3_stage_c.pt`` ``ema_state_dict``) hold attention as
``nn.MultiheadAttention``: ``<block>.attention.attn.in_proj_weight`` / ``in_proj_bias`` (q, k, v stacked on dim 0)
and ``<block>.attention.attn.out_proj.weight`` / ``.bias``. diffusers splits that into ``<block>.attention.to_q`` /
``to_k`` / ``to_v`` and ``<block>.attention.to_out.0``; every other name is the same in both layouts, except that
the original stage B calls its pooled-text mapper ``clip_mapper`` where diffusers says ``clip_txt_pooled_mapper``
(diffusers ``loaders/single_file_utils.py`` ``convert_stable_cascade_unet_single_file_to_diffusers``: in_proj
``chunk(3, 0)``, out_proj → ``to_out.0``, and, when ``clip_txt_mapper.weight`` is absent, ``clip_mapper`` →
``clip_txt_pooled_mapper``). The Würstchen 2 prior takes the very same transform (diffusers
``scripts/convert_wuerstchen.py`` splits ``model_v3_stage_c.pt`` exactly like that and loads ``WuerstchenPrior``
strictly), so :func:`original_to_diffusers` / :func:`diffusers_to_original` serve both; the round trip is exact
(``torch.cat`` of the ``chunk`` pieces).

ComfyUI
-------
Module names (comfy/ldm/cascade ``stage_c.py`` ``StageC``, ``common.py``): the original ones, except that
``Attention2D.attn`` is an ``OptimizedAttention`` with ``to_q``, ``to_k``, ``to_v`` and ``out_proj`` Linears.
``supported_models.Stable_Cascade_C.process_unet_state_dict`` splits every ``…in_proj_weight`` /
``…in_proj_bias`` of a loaded file into thirds named ``….to_q`` / ``.to_k`` / ``.to_v`` under the same parent
(``…attention.attn.to_q.weight``); ``out_proj`` is kept. So the ComfyUI module of a diffusers path is
:func:`comfy_lora_name`: ``…attention.to_q|to_k|to_v`` → ``…attention.attn.to_q|to_k|to_v``,
``…attention.to_out.0`` → ``…attention.attn.out_proj``, everything else unchanged.

LoRA keys (comfy/lora.py):

- ``model_lora_keys_unet``: ``if isinstance(model, comfy.model_base.StableCascade_C)``, every model key
  ``diffusion_model.<module>.weight`` gets ``key_map["lora_prior_unet_" + <module with "." → "_">]``. (Older
  ComfyUI mapped ``lora_prior_unet_`` for every model; current ComfyUI for stage C only, so a stage B model gets no
  ``lora_prior_unet_`` keys.) ``<module>`` is a ComfyUI module name as above, so an Atelier key is
  ``lora_prior_unet_<comfy_lora_name(diffusers path) with "." → "_">.lora_down.weight`` (``lora_up`` / ``alpha``).
- ``model_lora_keys_clip``: for ``b in range(32)`` and ``c`` in ``LORA_CLIP_MAP`` (``mlp.fc1``, ``mlp.fc2``,
  ``self_attn.k_proj``, ``self_attn.q_proj``, ``self_attn.v_proj``, ``self_attn.out_proj``), when
  ``clip_g.transformer.text_model.encoder.layers.{b}.{c}.weight`` is in the CLIP model and no ``clip_l`` is (the
  Cascade CLIP model, ``sdxl_clip.StableCascadeClipModel``, has only ``clip_g``), it maps
  ``lora_prior_te_text_model_encoder_layers_{b}_{LORA_CLIP_MAP[c]}`` (= the transformers module path
  ``text_model.encoder.layers.{b}.{c}`` with "." → "_"); plus ``lora_prior_te_text_projection`` →
  ``clip_g.transformer.text_projection.weight``. No other text-encoder module (embeddings, layer norms) has a
  ``lora_prior_te_`` key. So a ``lora_prior_te_`` name is the transformers ``CLIPTextModelWithProjection`` module
  path unchanged, restricted to those modules.

Checkpoints ComfyUI loads: see :data:`COMFY_CHECKPOINT`.

Detection (comfy/model_detection.py ``detect_unet_config``): ``clf.1.weight`` present → Stable Cascade;
``clip_txt_mapper.weight`` present → stage C, its ``shape[0]`` 1536 → the lite config (c_cond 1536, c_hidden
[1536, 1536], nhead [24, 24], blocks [[4, 12], [12, 4]]), 2048 → the full default (``StageC`` defaults c_hidden
[2048, 2048], nhead [32, 32], blocks [[8, 24], [24, 8]]); else ``clip_mapper.weight`` → stage B (lite or full from
``down_blocks.1.0.channelwise.0.weight``'s last dim, 576 / 640). diffusers' ``infer_diffusers_model_type`` uses
the same ``clip_txt_mapper.weight`` widths (1536 → ``stable_cascade_stage_c_lite``, 2048 →
``stable_cascade_stage_c``).
ComfyUI has no Würstchen 2 model.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# --- the real configs -------------------------------------------------------------------------------------------
_CTA = ["SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"]

# stabilityai/stable-cascade-prior prior_lite/config.json (main, "_diffusers_version": "0.27.0.dev0"), verbatim.
CONFIG_LITE: Dict[str, Any] = {
    "_class_name": "StableCascadeUNet",
    "_diffusers_version": "0.27.0.dev0",
    "block_out_channels": [1536, 1536],
    "block_types_per_layer": [list(_CTA), list(_CTA)],
    "clip_image_in_channels": 768,
    "clip_seq": 4,
    "clip_text_in_channels": 1280,
    "clip_text_pooled_in_channels": 1280,
    "conditioning_dim": 1536,
    "down_blocks_repeat_mappers": [1, 1],
    "down_num_layers_per_block": [4, 12],
    "dropout": [0.1, 0.1],
    "effnet_in_channels": None,
    "in_channels": 16,
    "kernel_size": 3,
    "num_attention_heads": [24, 24],
    "out_channels": 16,
    "patch_size": 1,
    "pixel_mapper_in_channels": None,
    "self_attn": True,
    "switch_level": [False],
    "timestep_conditioning_type": ["sca", "crp"],
    "timestep_ratio_embedding_dim": 64,
    "up_blocks_repeat_mappers": [1, 1],
    "up_num_layers_per_block": [12, 4],
}

# stabilityai/stable-cascade-prior prior/config.json: the same keys with the full model's values. The values are
# the hub file's (its first revision, 9f3c6c8, in the pre-release names: c_hidden [2048, 2048], nhead [32, 32],
# blocks [[8, 24], [24, 8]], c_cond 2048, c_clip_text 1280, c_clip_text_pooled 1280, c_clip_img 768, c_clip_seq 4,
# c_r 64, dropout [0.1, 0.1], level_config CTA/CTA, t_conds sca/crp, switch_level [false]) in the current key names
# (the current file's text was not at hand; its "_diffusers_version" is taken to be the lite file's).
CONFIG_FULL: Dict[str, Any] = dict(
    CONFIG_LITE,
    block_out_channels=[2048, 2048],
    block_types_per_layer=[list(_CTA), list(_CTA)],
    conditioning_dim=2048,
    down_num_layers_per_block=[8, 24],
    num_attention_heads=[32, 32],
    up_num_layers_per_block=[24, 8],
)

# warp-ai/wuerstchen-prior prior/config.json, verbatim.
CONFIG_WUERSTCHEN: Dict[str, Any] = {
    "_class_name": "WuerstchenPrior",
    "_diffusers_version": "0.21.0.dev0",
    "c": 1536,
    "c_cond": 1280,
    "c_in": 16,
    "c_r": 64,
    "depth": 32,
    "dropout": 0.1,
    "nhead": 24,
}

# --- ComfyUI's checkpoint layout ----------------------------------------------------------------------------------
COMFY_CHECKPOINT: Dict[str, Any] = {
    # CheckpointLoaderSimple (comfy/sd.py load_checkpoint_guess_config → load_state_dict_guess_config):
    # model_detection.unet_prefix_from_state_dict picks "model.diffusion_model." (more than 5 keys with it); the
    # prior under it in the original layout (in_proj split by Stable_Cascade_C.process_unet_state_dict; ComfyUI's own
    # split names ".attention.attn.to_q/to_k/to_v" load too).
    "unet_prefix": "model.diffusion_model.",
    # Stable_Cascade_C.text_encoder_key_prefix = ["text_encoder."]; process_clip_state_dict strips it (filter_keys)
    # and loads the rest into StableCascadeClipModel, whose keys are "clip_g.transformer." + the transformers CLIP
    # text-model names ("text_model.encoder.layers.N.self_attn.q_proj.weight", ...).
    "text_encoder_prefix": "text_encoder.clip_g.transformer.",
    # The projection as comfyanonymous's stable_cascade_stage_c.safetensors stores it: the old ComfyUI
    # Parameter "clip_g.text_projection" (pooled @ P, so P = Linear weight transposed). process_clip_state_dict
    # turns it into "clip_g.transformer.text_projection.weight" with .transpose(0, 1). Written this way, old and
    # current ComfyUI both read it.
    "text_projection_key": "text_encoder.clip_g.text_projection",
    "text_projection_transposed": True,
    # Also in that file, passed through by comfy_checkpoint(extra=...): "vae." (Stable_Cascade_C.vae_key_prefix; the
    # StageC_coder, effnet encoder "vae.encoder.*" + previewer "vae.previewer.*") and "clip_l_vision."
    # (clip_vision_prefix, the CLIP-L vision model for image prompts). Without "vae." keys the checkpoint loader
    # warns "No VAE weights detected" and gives no VAE; the prior and text encoder still load.
    "vae_prefix": "vae.",
    "clip_vision_prefix": "clip_l_vision.",
    # UNETLoader (load_diffusion_model_state_dict): strips unet_prefix_from_state_dict's prefix when keys carry it
    # (so bare keys, as in Stability's stage_c.safetensors, and "model.diffusion_model." keys both work), then
    # model_config_from_unet(sd, "") must recognise it ("clf.1.weight" + "clip_txt_mapper.weight"). The weights must
    # be in the original (or ComfyUI's split) layout: diffusers' "attention.to_q" / "to_out.0" names are not read
    # (load_state_dict(strict=False) leaves those attention weights unset).
    "unet_loader_prefixes": ("", "model.diffusion_model."),
}

_ATTN_SPLIT = ("to_q", "to_k", "to_v")


# --- helpers ------------------------------------------------------------------------------------------------------
def _shape(v: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in (v.shape if hasattr(v, "shape") else v))


def _keyset(keys: Iterable[str]) -> set:
    return set(keys.keys() if isinstance(keys, Mapping) else keys)


def strip_prefix(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The keys under ``model.diffusion_model.`` (or ``diffusion_model.``) with it removed, the others dropped, when
    any key carries that prefix (as ComfyUI's ``state_dict_prefix_replace(..., filter_keys=True)``); else a copy.
    Works on a state dict or a key → shape mapping."""
    for p in PREFIXES:
        if any(k.startswith(p) for k in state):
            return {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
    return dict(state)


# --- original ↔ diffusers -----------------------------------------------------------------------------------------
def _renames_clip_mapper(state: Mapping[str, Any]) -> bool:
    """A stage B (no ``clip_txt_mapper``; diffusers' converter then renames ``clip_mapper``). Also asks for
    ``effnet_mapper.0.weight`` so that the Würstchen 2 decoder, whose ``clip_mapper`` keeps its name in diffusers,
    is left alone."""
    return "clip_txt_mapper.weight" not in state and "effnet_mapper.0.weight" in state


def original_to_diffusers(state: Mapping[str, Any]) -> Dict[str, Any]:
    """Original-layout tensors (stage C, stage B, Würstchen 2 prior) → diffusers names, as diffusers'
    ``convert_stable_cascade_unet_single_file_to_diffusers`` does. Also reads ComfyUI's split names
    (``…attention.attn.to_q.weight``). Strip a prefix first (:func:`strip_prefix`). The q/k/v tensors are views of
    ``in_proj`` (``chunk``); clone them before ``safetensors.torch.save_file``."""
    stage_b = _renames_clip_mapper(state)
    out: Dict[str, Any] = {}
    for k, v in state.items():
        head, _, leaf = k.rpartition(".")
        if head.endswith(".attn") and leaf in ("in_proj_weight", "in_proj_bias"):
            stem, kind = head[:-len(".attn")], leaf[len("in_proj_"):]
            for name, part in zip(_ATTN_SPLIT, v.chunk(3, 0)):
                out[f"{stem}.{name}.{kind}"] = part
        elif head.endswith(".attn.out_proj") and leaf in ("weight", "bias"):
            out[f"{head[:-len('.attn.out_proj')]}.to_out.0.{leaf}"] = v
        elif head.endswith(tuple(f".attn.{n}" for n in _ATTN_SPLIT)) and leaf in ("weight", "bias"):
            stem, name = head.rsplit(".", 2)[0], head.rsplit(".", 1)[1]
            out[f"{stem}.{name}.{leaf}"] = v
        elif stage_b and head == "clip_mapper":
            out[f"clip_txt_pooled_mapper.{leaf}"] = v
        else:
            out[k] = v
    return out


def diffusers_to_original(state: Mapping[str, Any]) -> Dict[str, Any]:
    """diffusers tensors (StableCascadeUNet stage C or B, WuerstchenPrior) → the original layout; the exact inverse
    of :func:`original_to_diffusers` and of diffusers' single-file converter."""
    import torch  # torch inside: detection (validate) reads this module without torch
    stage_b = _renames_clip_mapper(state)
    out: Dict[str, Any] = {}
    for k, v in state.items():
        head, _, leaf = k.rpartition(".")
        if head.endswith(".attention.to_q") and leaf in ("weight", "bias"):
            stem = head[:-len(".to_q")]
            parts = [state[f"{stem}.{n}.{leaf}"] for n in _ATTN_SPLIT]
            out[f"{stem}.attn.in_proj_{leaf}"] = torch.cat(parts, 0)
        elif head.endswith((".attention.to_k", ".attention.to_v")) and leaf in ("weight", "bias"):
            continue
        elif head.endswith(".attention.to_out.0") and leaf in ("weight", "bias"):
            out[f"{head[:-len('.to_out.0')]}.attn.out_proj.{leaf}"] = v
        elif stage_b and head == "clip_txt_pooled_mapper":
            out[f"clip_mapper.{leaf}"] = v
        else:
            out[k] = v
    return out


# --- LoRA names ---------------------------------------------------------------------------------------------------
def comfy_lora_name(diffusers_module_path: str) -> str:
    """ComfyUI's name of a diffusers ``StableCascadeUNet`` (stage C) module: ``…attention.to_q|to_k|to_v`` →
    ``…attention.attn.to_q|to_k|to_v``, ``…attention.to_out.0`` → ``…attention.attn.out_proj``, the rest as is.
    ``"lora_prior_unet_" + comfy_lora_name(p).replace(".", "_")`` is then a key ComfyUI maps."""
    p = diffusers_module_path
    for n in _ATTN_SPLIT:
        if p.endswith(f".attention.{n}"):
            return f"{p[:-len(n)]}attn.{n}"
    if p.endswith(".attention.to_out.0"):
        return f"{p[:-len('to_out.0')]}attn.out_proj"
    return p


def diffusers_lora_name(comfy_path: str) -> str:
    """The inverse of :func:`comfy_lora_name` (a dotted ComfyUI stage C module path → the diffusers one)."""
    p = comfy_path
    for n in _ATTN_SPLIT:
        if p.endswith(f".attention.attn.{n}"):
            return f"{p[:-len('attn.' + n)]}{n}"
    if p.endswith(".attention.attn.out_proj"):
        return f"{p[:-len('attn.out_proj')]}to_out.0"
    return p


# --- ComfyUI checkpoint -------------------------------------------------------------------------------------------
def comfy_checkpoint(prior_state_original: Mapping[str, Any], text_encoder_state: Optional[Mapping[str, Any]] = None,
                     extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A stage C checkpoint in the layout of comfyanonymous's ``stable_cascade_stage_c.safetensors``
    (:data:`COMFY_CHECKPOINT`): the prior (original layout; a diffusers-layout state is converted) under
    ``model.diffusion_model.``; the transformers ``CLIPTextModelWithProjection`` state (``text_model.*``,
    ``text_projection.weight``) as ``text_encoder.clip_g.transformer.text_model.*`` and
    ``text_encoder.clip_g.text_projection`` (transposed); ``extra`` (e.g. ``vae.*``, ``clip_l_vision.*``) as given."""
    prior = strip_prefix(prior_state_original)
    if any(k.endswith((".attention.to_q.weight", ".attention.to_out.0.weight")) for k in prior):
        prior = diffusers_to_original(prior)
    out = {COMFY_CHECKPOINT["unet_prefix"] + k: v for k, v in prior.items()}
    for k, v in (text_encoder_state or {}).items():
        if k == "text_projection.weight":
            out[COMFY_CHECKPOINT["text_projection_key"]] = v.transpose(0, 1).contiguous()
        elif k.startswith("text_model."):
            out[COMFY_CHECKPOINT["text_encoder_prefix"] + k] = v
        else:
            raise KeyError(f"{k}: not a CLIPTextModelWithProjection key")
    for k, v in (extra or {}).items():
        if k in out:
            raise KeyError(f"{k}: given twice")
        out[k] = v
    return out


def split_comfy_checkpoint(state: Mapping[str, Any]) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Read a stage C file back: ``(prior in the original layout without prefix, CLIPTextModelWithProjection state or
    None)``. Takes a ComfyUI checkpoint (prior under ``model.diffusion_model.``, text encoder under
    ``text_encoder.clip_g.transformer.``, the projection as ``text_encoder.clip_g.text_projection`` (transposed) or
    ``text_encoder.clip_g.transformer.text_projection.weight`` (as current ComfyUI saves it)), or a bare prior file.
    ComfyUI's split attention names are merged back into ``in_proj``; ``vae.*`` / ``clip_l_vision.*`` are dropped."""
    te_prefix = COMFY_CHECKPOINT["text_encoder_prefix"]
    text: Dict[str, Any] = {}
    for k, v in state.items():
        if k == COMFY_CHECKPOINT["text_projection_key"]:
            text["text_projection.weight"] = v.transpose(0, 1).contiguous()
        elif k.startswith(te_prefix):
            text[k[len(te_prefix):]] = v
    prefixed = any(k.startswith(PREFIXES) for k in state)
    if prefixed:
        prior = strip_prefix(state)
    else:
        skip = ("text_encoder.", COMFY_CHECKPOINT["vae_prefix"], COMFY_CHECKPOINT["clip_vision_prefix"])
        prior = {k: v for k, v in state.items() if not k.startswith(skip)}
    if any(k.endswith(".attn.to_q.weight") for k in prior):  # saved by ComfyUI: back to in_proj
        prior = diffusers_to_original(original_to_diffusers(prior))
    return prior, (text or None)


# --- what a file holds --------------------------------------------------------------------------------------------
def is_stage_c(keys: Iterable[str]) -> bool:
    """A Stable Cascade stage C prior (either layout), as ComfyUI tells it: ``clf.1.weight`` and
    ``clip_txt_mapper.weight``. Keys without a prefix (:func:`strip_prefix`)."""
    k = _keyset(keys)
    return "clf.1.weight" in k and "clip_txt_mapper.weight" in k


def is_stage_b(keys: Iterable[str]) -> bool:
    """A Stable Cascade stage B decoder: ``clf.1.weight``, no ``clip_txt_mapper``, and ``clip_mapper.weight`` (the
    original layout, ComfyUI's test) or ``effnet_mapper.0.weight`` (both layouts). The Würstchen 2 decoder
    (``effnet_mappers.N``, plural) is not one."""
    k = _keyset(keys)
    if "clf.1.weight" not in k or "clip_txt_mapper.weight" in k or any(x.startswith("effnet_mappers.") for x in k):
        return False
    return "clip_mapper.weight" in k or "effnet_mapper.0.weight" in k


def is_wuerstchen_prior(keys: Iterable[str]) -> bool:
    """A Würstchen 2 prior (either layout; ``WuerstchenPrior``: ``projection``, ``cond_mapper.0/2``, ``blocks.N``,
    ``out.1``; no ``clf``)."""
    k = _keyset(keys)
    need = ("projection.weight", "cond_mapper.0.weight", "cond_mapper.2.weight", "out.1.weight",
            "blocks.0.channelwise.0.weight")
    return all(n in k for n in need) and "clf.1.weight" not in k


def is_lite(shapes: Any) -> bool:
    """The lite (1B) stage C rather than the full (3.6B) one. With shapes (key → shape or tensor): the rule of
    ComfyUI's ``detect_unet_config`` and diffusers' ``infer_diffusers_model_type``, ``clip_txt_mapper.weight``'s
    out width 1536 (full: 2048), falling back to ``embedding.1.weight``'s. With bare keys: the first level's block
    count, 12 (4 layers × ResBlock/TimestepBlock/AttnBlock; full: 24)."""
    if isinstance(shapes, Mapping):
        for key in ("clip_txt_mapper.weight", "embedding.1.weight"):
            if key in shapes:
                return _shape(shapes[key])[0] == CONFIG_LITE["conditioning_dim"]
        return False
    k = _keyset(shapes)
    return _count(k, "down_blocks.0.") == CONFIG_LITE["down_num_layers_per_block"][0] * len(_CTA)


# --- configs from weights -----------------------------------------------------------------------------------------
def _count(keys: Iterable[str], prefix: str) -> int:
    """1 + the largest index right after ``prefix`` (0 when none)."""
    idx = [k[len(prefix):].split(".", 1)[0] for k in keys if k.startswith(prefix)]
    return 1 + max((int(i) for i in idx if i.isdigit()), default=-1)


def _heads(width: int, base_width: int, base_heads: int) -> int:
    """Heads for a level ``width`` wide: ``base_heads`` at the base width; else the base head width kept
    (64 in the real priors) when it divides ``width``; else the most heads up to ``base_heads`` that divide it
    (a guess: the weights do not tell, but the attention must split ``width`` evenly)."""
    if base_heads <= 0 or width == base_width:
        return base_heads
    if base_width % base_heads == 0 and width % (base_width // base_heads) == 0:
        return width // (base_width // base_heads)
    return next(h for h in range(min(base_heads, width), 0, -1) if width % h == 0)


def _block_type(keys: set, prefix: str) -> Optional[str]:
    if f"{prefix}depthwise.weight" in keys:
        return "SDCascadeResBlock"
    if f"{prefix}mapper.weight" in keys:
        return "SDCascadeTimestepBlock"
    if f"{prefix}kv_mapper.1.weight" in keys:
        return "SDCascadeAttnBlock"
    return None


def _layer_types(keys: set, level_prefix: str, n_blocks: int) -> Optional[list]:
    """The repeating block-type pattern of one level (e.g. Res, Timestep, Attn), when the blocks show one."""
    seq = [_block_type(keys, f"{level_prefix}{j}.") for j in range(n_blocks)]
    if not seq or None in seq:
        return None
    period = seq.index(seq[0], 1) if seq.count(seq[0]) > 1 else len(seq)
    pattern = seq[:period]
    if len(seq) % period or seq != pattern * (len(seq) // period):
        return None
    return pattern


def config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a StableCascadeUNet config) corrected by the weights (either layout, prefix allowed; tensors or
    shapes): level widths, block types and layer counts per level, repeat mappers, conditioning width, CLIP text /
    pooled / image channels, clip_seq, effnet / pixel mapper channels, in / out channels, timestep embedding width
    and extra conditions, kernel size, and whether the levels change scale (``switch_level`` None → stride-2 conv).
    Not in the weights, so kept from ``base``: patch_size, dropout, self_attn, the order of the timestep conditions,
    which ``switch_level`` levels interpolate; the attention heads keep ``base``'s head width (64 in both real
    priors). A Würstchen 2 prior goes to :func:`wuerstchen_config_from_state`."""
    st = strip_prefix(state)
    if is_wuerstchen_prior(st):
        return wuerstchen_config_from_state(st, base)
    shape = {k: _shape(v) for k, v in st.items()}
    keys = set(shape)
    cfg: Dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in base.items()}
    n = _count(keys, "down_blocks.") or len(cfg["block_out_channels"])

    def per_level(name: str, default: Any) -> list:
        v = cfg.get(name, default)
        v = list(v) if isinstance(v, (list, tuple)) else [v] * n
        return (v + [v[-1]] * n)[:n] if v else [default] * n

    types = [list(t) for t in per_level("block_types_per_layer", list(_CTA))]
    for i in range(n):
        found = _layer_types(keys, f"down_blocks.{i}.", _count(keys, f"down_blocks.{i}."))
        if found:
            types[i] = found
    cfg["block_types_per_layer"] = types

    base_widths, base_heads = per_level("block_out_channels", 0), per_level("num_attention_heads", 0)
    widths, heads = [], []
    for i in range(n):
        w = next((shape[k][0] for k in sorted(keys) if k.startswith(f"down_blocks.{i}.")
                  and k.endswith(".depthwise.weight")), base_widths[i])
        widths.append(w)
        if "SDCascadeAttnBlock" not in types[i]:
            heads.append(min(base_heads[i], 0))  # no attention at this level: 0 as in the decoder configs
        elif base_heads[i] <= 0:
            heads.append(w // 64 if w % 64 == 0 else 1)
        else:
            heads.append(_heads(w, base_widths[i], base_heads[i]))
    cfg["block_out_channels"], cfg["num_attention_heads"] = widths, heads

    cfg["down_num_layers_per_block"] = [_count(keys, f"down_blocks.{i}.") // len(types[i]) for i in range(n)]
    cfg["up_num_layers_per_block"] = [_count(keys, f"up_blocks.{k}.") // len(types[n - 1 - k]) for k in range(n)]
    cfg["down_blocks_repeat_mappers"] = [_count(keys, f"down_repeat_mappers.{i}.") + 1 for i in range(n)]
    cfg["up_blocks_repeat_mappers"] = [_count(keys, f"up_repeat_mappers.{k}.") + 1 for k in range(n)]
    cfg["dropout"] = per_level("dropout", 0.0)

    if "clip_txt_mapper.weight" in shape:
        cfg["conditioning_dim"], cfg["clip_text_in_channels"] = shape["clip_txt_mapper.weight"][:2]
    else:
        cfg["clip_text_in_channels"] = None
        kv = next((shape[k] for k in sorted(keys) if k.endswith(".kv_mapper.1.weight")), None)
        if kv is not None:
            cfg["conditioning_dim"] = kv[1]
    pooled = shape.get("clip_txt_pooled_mapper.weight", shape.get("clip_mapper.weight"))
    if pooled is not None:
        cfg["clip_text_pooled_in_channels"] = pooled[1]
        if pooled[0] % cfg["conditioning_dim"] == 0:
            cfg["clip_seq"] = pooled[0] // cfg["conditioning_dim"]
    cfg["clip_image_in_channels"] = shape["clip_img_mapper.weight"][1] if "clip_img_mapper.weight" in shape else None
    cfg["effnet_in_channels"] = shape["effnet_mapper.0.weight"][1] if "effnet_mapper.0.weight" in shape else None
    cfg["pixel_mapper_in_channels"] = (shape["pixels_mapper.0.weight"][1] if "pixels_mapper.0.weight" in shape
                                       else None)

    p2 = int(cfg.get("patch_size", 1)) ** 2
    if "embedding.1.weight" in shape:
        cfg["in_channels"] = shape["embedding.1.weight"][1] // p2
    if "clf.1.weight" in shape:
        cfg["out_channels"] = shape["clf.1.weight"][0] // p2
    ts = next((k[:-len("mapper.weight")] for k in sorted(keys) if k.endswith(".mapper.weight")), None)
    if ts is not None:
        cfg["timestep_ratio_embedding_dim"] = shape[f"{ts}mapper.weight"][1]
        conds = {k[len(ts) + len("mapper_"):-len(".weight")] for k in keys
                 if k.startswith(f"{ts}mapper_") and k.endswith(".weight")}
        old = [c for c in cfg.get("timestep_conditioning_type", []) if c in conds]
        cfg["timestep_conditioning_type"] = old + sorted(conds - set(old))
    dw = next((shape[k] for k in sorted(keys) if k.endswith(".depthwise.weight")), None)
    if dw is not None:
        cfg["kernel_size"] = dw[-1]
    if n > 1:
        if "down_downscalers.1.1.blocks.0.weight" in shape:  # UpDownBlock2d: switch_level given
            sl = cfg.get("switch_level") or [False]
            cfg["switch_level"] = (list(sl) + [sl[-1]] * n)[:n - 1]
        elif "down_downscalers.1.1.weight" in shape:  # stride-2 Conv2d
            cfg["switch_level"] = None
    return cfg


def wuerstchen_config_from_state(state: Mapping[str, Any], base: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` (a WuerstchenPrior config) corrected by the weights: c, c_in, c_cond, c_r, depth; nhead keeps
    ``base``'s head width (1536 / 24 = 64); dropout from ``base``."""
    st = strip_prefix(state)
    shape = {k: _shape(v) for k, v in st.items()}
    cfg = dict(base)
    if "projection.weight" in shape:
        c, c_in = shape["projection.weight"][:2]
        cfg.update(c=c, c_in=c_in, nhead=_heads(c, base["c"], base["nhead"]))
    if "cond_mapper.0.weight" in shape:
        cfg["c_cond"] = shape["cond_mapper.0.weight"][1]
    if "blocks.1.mapper.weight" in shape:
        cfg["c_r"] = shape["blocks.1.mapper.weight"][1]
    blocks = _count(set(shape), "blocks.")
    if blocks:
        cfg["depth"] = blocks // 3
    return cfg
