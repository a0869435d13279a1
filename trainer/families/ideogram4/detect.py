"""Claim Ideogram 4 weights: the original single file of the conditional transformer (a fused ``attention.qkv``,
``embed_image_indicator``, tanh-gated ``adaln_modulation`` in every block; with or without a prefix, in full
precision or as Ideogram's fp8 release with its ``.weight_scale`` tensors: names and shapes only, whatever the
dtype), a file with diffusers' key names, a diffusers ``Ideogram4Pipeline`` folder or hub repo. A file holding only
the ``unconditional_transformer.`` (the pipeline's guidance branch, the same class) is refused by name: it is not the
model a LoRA is for."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence
from trainer.families.ideogram4.keys import OTHER_PARTS, strip_prefix

PIPELINES = ("Ideogram4Pipeline",)


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        keys = {strip_prefix(k) for k in ev.shapes if not k.startswith(OTHER_PARTS)}
        if not keys and "unconditional_transformer.embed_image_indicator.weight" in ev.shapes:
            raise ValueError(f"{ev.where} is Ideogram 4's unconditional transformer (the guidance branch); train the "
                             "conditional transformer (the release's transformer/ folder or its single file)")
        if not all(k in keys for k in ("embed_image_indicator.weight", "layers.0.adaln_modulation.weight",
                                       "final_layer.adaln_modulation.weight", "input_proj.weight")):
            return None
        if not any(k in keys for k in ("layers.0.attention.qkv.weight", "layers.0.attention.to_q.weight")):
            return None
        return "ideogram4"
    index = ev.json("model_index.json") or {}
    if str(index.get("_class_name", "") or "") in PIPELINES:
        return "ideogram4"
    transformer = ev.json("transformer/config.json")
    return "ideogram4" if transformer and transformer.get("_class_name") == "Ideogram4Transformer2DModel" else None
