"""Claim Sana / Sana 1.5 weights: the original single file (NVlabs' ``blocks.N.attn.qkv`` linear attention with
``blocks.N.cross_attn.kv_linear`` and a Mix-FFN ``blocks.N.mlp.inverted_conv``; with or without ComfyUI's
``model.diffusion_model.``), a diffusers transformer file passed alone, a ``SanaPipeline`` folder or hub repo.

PixArt shares the ``cross_attn.kv_linear`` keys but has an ``mlp.fc1`` MLP; Sana's Mix-FFN convolutions tell them
apart. The variants that are not this family's base are refused by name: Sana-Sprint (a guidance-embedding,
few-step distilled model: ``guidance_embeds``), Sana ControlNet, Sana PAG, Sana-Video and Sana-WM."""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINES = ("SanaPipeline",)
# pipeline / model classes of the Sana variants this family does not train as a base, with what to call them
OTHERS = {"SanaSprintPipeline": "Sana-Sprint (a few-step distilled model)",
          "SanaSprintImg2ImgPipeline": "Sana-Sprint (a few-step distilled model)",
          "SanaControlNetPipeline": "a Sana ControlNet", "SanaControlNetModel": "a Sana ControlNet",
          "SanaPAGPipeline": "Sana with PAG (a sampling variant of SanaPipeline)",
          "SanaVideoPipeline": "Sana-Video", "SanaImageToVideoPipeline": "Sana-Video (image-to-video)",
          "SanaVideoTransformer3DModel": "Sana-Video", "SanaWMPipeline": "Sana-WM (a world model)"}
TRAINED = "Sana and Sana 1.5 text-to-image models (SanaPipeline) are"


def _refuse(where: str, what: str) -> None:
    raise ValueError(f"{where} is {what}, which Atelier does not train; {TRAINED}")


def _single_file(ev: Evidence) -> Optional[str]:
    shapes = {k.split("diffusion_model.", 1)[-1]: s for k, s in ev.shapes.items()}
    original = ("blocks.0.attn.qkv.weight", "blocks.0.cross_attn.kv_linear.weight",
                "blocks.0.mlp.inverted_conv.conv.weight")
    diffusers = ("transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.0.attn2.to_k.weight",
                 "transformer_blocks.0.ff.conv_inverted.weight", "caption_norm.weight")
    if not (all(k in shapes for k in original) or all(k in shapes for k in diffusers)):
        return None
    # Sprint's guidance embedder: cfg_embedder.mlp.* in NVlabs' files, time_embed.guidance_embedder.* in diffusers'
    if any(k.startswith(("cfg_embedder.", "time_embed.guidance_embedder.")) for k in shapes):
        _refuse(ev.where, "Sana-Sprint (a few-step distilled model with a guidance embedding)")
    return "sana"


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        return _single_file(ev)
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    if name in OTHERS:
        _refuse(ev.where, OTHERS[name])
    transformer = ev.json("transformer/config.json") or {}
    cls = transformer.get("_class_name")
    if cls in OTHERS:
        _refuse(ev.where, OTHERS[cls])
    if name in PIPELINES or cls == "SanaTransformer2DModel":
        if transformer.get("guidance_embeds"):
            _refuse(ev.where, "Sana-Sprint (a few-step distilled model with a guidance embedding)")
        return "sana"
    return None
