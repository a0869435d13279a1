"""Claim Wan 2.x weights: the original single file (``patch_embedding``, ``blocks.N.self_attn``, ``head.modulation``;
bare or under ComfyUI's ``model.diffusion_model.``) and a diffusers folder or hub repo.

- Text-to-video: 16 input channels (Wan 2.1 T2V 1.3B/14B; an A14B expert's file has Wan 2.1 14B's keys, so
  model.family says what it is), 48 (Wan 2.2 TI2V-5B; in a folder ``expand_timesteps``), two experts in a folder
  (``transformer_2``, ``boundary_ratio``: Wan 2.2 T2V A14B).
- Image-to-video: 36 input channels (noise ‖ 4 mask channels ‖ the first frame's 16 latent channels). With CLIP image
  features (``img_emb.*`` in the file, ``image_dim`` and an ``image_encoder`` in a folder): Wan 2.1 I2V 14B; without
  them: an expert of Wan 2.2 I2V A14B (its folder: ``WanImageToVideoPipeline`` with ``transformer_2`` and
  ``boundary_ratio``, no image encoder).
- Refused by name (not trained yet): first-last-frame (FLF2V: a position embedding of the image tokens), VACE and
  Animate weights, other Wan pipelines."""

from __future__ import annotations

from typing import Any, Optional

from trainer.families import Evidence

T2V_CHANNELS = 16  # latent channels of Wan 2.1 T2V (36 for I2V: noise ‖ mask ‖ first-frame latents; 48: Wan 2.2 5B)
I2V_CHANNELS = 36
PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")


def _refuse(ev: Evidence, what: str) -> None:
    raise ValueError(f"{ev.where} is {what}, which Atelier does not train yet: it trains Wan 2.1 text-to-video "
                     "(1.3B and 14B), Wan 2.1 I2V 14B, Wan 2.2 TI2V-5B and Wan 2.2 T2V/I2V A14B. Point model.path at "
                     "one of those (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")


def _by_channels(ev: Evidence, channels: int, image: bool) -> str:
    if channels == T2V_CHANNELS and not image:
        return "wan21-t2v"
    if channels == 48 and not image:
        return "wan22-ti2v-5b"
    if channels == I2V_CHANNELS:
        return "wan21-i2v" if image else "wan22-i2v-a14b"
    _refuse(ev, f"a Wan model with {channels} input channels")
    return ""


def _two_experts(index: dict) -> bool:
    return index.get("transformer_2") not in (None, [None, None]) or index.get("boundary_ratio") is not None


def _folder(ev: Evidence, index: dict, transformer: Optional[dict[str, Any]]) -> str:
    name = str(index.get("_class_name", "") or "")
    if transformer is not None and transformer.get("pos_embed_seq_len"):
        _refuse(ev, "a Wan first-last-frame (FLF2V) model")
    if name == "WanImageToVideoPipeline" or (transformer is not None
                                            and int(transformer.get("in_channels", 0)) == I2V_CHANNELS):
        if transformer is None:  # a hub repo whose configs cannot be read now: the folder check runs at load
            return "wan22-i2v-a14b" if _two_experts(index) else "wan21-i2v"
        image = transformer.get("image_dim") is not None
        if _two_experts(index) and image:
            _refuse(ev, "a two-expert Wan image-to-video model with CLIP image features")
        if not _two_experts(index) and not image:
            _refuse(ev, "a Wan image-to-video model without CLIP image features or a second expert")
        return _by_channels(ev, int(transformer.get("in_channels", I2V_CHANNELS)), image)
    if _two_experts(index):
        if transformer is not None and (int(transformer.get("in_channels", T2V_CHANNELS)) != T2V_CHANNELS
                                        or transformer.get("image_dim") is not None):
            _refuse(ev, f"a two-expert Wan model with {transformer.get('in_channels')} input channels")
        return "wan22-t2v-a14b"  # two experts, switched at the pipeline's boundary_ratio
    if transformer is None:  # a hub repo whose configs cannot be read now: the folder check runs at load
        return "wan22-ti2v-5b" if index.get("expand_timesteps") else "wan21-t2v"
    return _by_channels(ev, int(transformer.get("in_channels", T2V_CHANNELS)), transformer.get("image_dim") is not None)


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
        patch = shapes.get("patch_embedding.weight")
        if patch is None or len(patch) != 5 or "head.modulation" not in shapes \
                or "blocks.0.self_attn.q.weight" not in shapes:
            return None
        if any(k.startswith("vace_") or k.startswith("motion_encoder.") for k in shapes):
            _refuse(ev, "a Wan VACE or Animate model")
        if "img_emb.emb_pos" in shapes:
            _refuse(ev, "a Wan first-last-frame (FLF2V) model")
        return _by_channels(ev, int(patch[1]), "img_emb.proj.1.weight" in shapes)
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    transformer = ev.json("transformer/config.json")
    if name.startswith("Wan") and name not in PIPELINES:
        _refuse(ev, f"a {name}")
    if name in PIPELINES or (transformer and transformer.get("_class_name") == "WanTransformer3DModel"):
        return _folder(ev, index, transformer)
    return None
