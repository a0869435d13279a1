"""Claim Wan 2.1 text-to-video, Wan 2.2 TI2V-5B and Wan 2.2 T2V A14B weights: the original single file
(``patch_embedding``, ``blocks.N.self_attn``, ``head.modulation``; bare or under ComfyUI's ``model.diffusion_model.``;
the 5B by its 48 latent channels; an A14B expert's file has Wan 2.1 14B's keys, so model.family says what it is), a
diffusers ``WanPipeline`` folder or hub repo (the 5B by ``expand_timesteps``, A14B by its ``transformer_2`` and
``boundary_ratio``). Image-to-video and VACE/Animate weights are recognised and refused by name (not trained yet)."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

T2V_CHANNELS = 16  # latent channels of Wan 2.1 T2V (36 for I2V: noise ‖ mask ‖ first-frame latents; 48: Wan 2.2 5B)


def _refuse(ev: Evidence, what: str) -> None:
    raise ValueError(f"{ev.where} is {what}, which Atelier does not train yet: it trains Wan 2.1 text-to-video "
                     "(1.3B and 14B), Wan 2.2 TI2V-5B and Wan 2.2 T2V A14B. Point model.path at one of those (e.g. "
                     "Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")


def _by_channels(ev: Evidence, channels: int, image: bool) -> str:
    if channels == T2V_CHANNELS and not image:
        return "wan21-t2v"
    if channels == 48 and not image:
        return "wan22-ti2v-5b"
    _refuse(ev, "a Wan image-to-video model")
    return ""


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
        patch = shapes.get("patch_embedding.weight")
        if patch is None or len(patch) != 5 or "head.modulation" not in shapes \
                or "blocks.0.self_attn.q.weight" not in shapes:
            return None
        if any(k.startswith("vace_") or k.startswith("motion_encoder.") for k in shapes):
            _refuse(ev, "a Wan VACE or Animate model")
        return _by_channels(ev, int(patch[1]), "img_emb.proj.1.weight" in shapes)
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    transformer = ev.json("transformer/config.json")
    if name.startswith("Wan") and name != "WanPipeline":
        _refuse(ev, f"a {name}")
    if name == "WanPipeline" or (transformer and transformer.get("_class_name") == "WanTransformer3DModel"):
        if index.get("transformer_2") not in (None, [None, None]) or index.get("boundary_ratio") is not None:
            if transformer is not None and (int(transformer.get("in_channels", T2V_CHANNELS)) != T2V_CHANNELS
                                            or transformer.get("image_dim") is not None):
                _refuse(ev, "Wan 2.2 I2V A14B")
            return "wan22-t2v-a14b"  # two experts, switched at the pipeline's boundary_ratio
        if transformer is None:  # a hub repo whose configs cannot be read now: the folder check runs at load
            return "wan22-ti2v-5b" if index.get("expand_timesteps") else "wan21-t2v"
        return _by_channels(ev, int(transformer.get("in_channels", T2V_CHANNELS)),
                            transformer.get("image_dim") is not None)
    return None
