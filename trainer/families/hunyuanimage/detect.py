"""Claim HunyuanImage 2.1 weights from configs and key names only.

- A diffusers folder or hub repo: ``model_index.json``'s ``HunyuanImagePipeline`` with a transformer that neither
  embeds a distilled guidance scale nor a mean-flow second time (the base model). The distilled model
  (``guidance_embeds``/``use_meanflow``), the refiner (``HunyuanImageRefinerPipeline``) and a lone
  ``HunyuanImageTransformer2DModel`` folder of either are refused by name.
- One file in Tencent's original layout (with or without ``model.diffusion_model.``): the ByT5 projection ``byt5_in``,
  the token refiner ``txt_in.individual_token_refiner`` and 2-D patches (``img_in.proj`` of rank 4: HunyuanVideo's
  are 3-D). ``time_r_in``/``guidance_in`` (the distilled model) are refused; a refiner file has no ``byt5_in``.
"""

from __future__ import annotations

from typing import Optional

from trainer.families import Evidence

PIPELINE = "HunyuanImagePipeline"
DISTILLED = ("HunyuanImage 2.1 Distilled (a mean-flow, guidance-distilled 8-step model) is not trained here: train a "
             "LoRA on the base HunyuanImage 2.1 (hunyuanvideo-community/HunyuanImage-2.1-Diffusers)")


def claim(ev: Evidence) -> Optional[str]:
    if ev.kind == "single_file":
        shapes = {k.split("diffusion_model.", 1)[-1]: v for k, v in ev.shapes.items()}
        patch = shapes.get("img_in.proj.weight")
        if "byt5_in.fc1.weight" in shapes and "txt_in.individual_token_refiner.blocks.0.norm1.weight" in shapes \
                and patch is not None and len(patch) == 4:
            if "time_r_in.mlp.0.weight" in shapes or "guidance_in.mlp.0.weight" in shapes:
                raise ValueError(f"{ev.where}: {DISTILLED}")
            return "hunyuan-image"
        return None
    index = ev.json("model_index.json") or {}
    name = str(index.get("_class_name", "") or "")
    transformer = ev.json("transformer/config.json") or {}
    if name == "HunyuanImageRefinerPipeline":
        raise ValueError(f"{ev.where} is the HunyuanImage 2.1 refiner (HunyuanImageRefinerPipeline), an "
                         "inference-only second stage; train the base HunyuanImage 2.1 (HunyuanImagePipeline)")
    if name == PIPELINE or (not name and transformer.get("_class_name") == "HunyuanImageTransformer2DModel"):
        if transformer.get("guidance_embeds") or transformer.get("use_meanflow"):
            raise ValueError(f"{ev.where}: {DISTILLED}")
        return "hunyuan-image"
    if name.startswith("HunyuanImage"):
        raise ValueError(f"{ev.where} is a {name}; Atelier trains HunyuanImage 2.1 text-to-image "
                         "(HunyuanImagePipeline)")
    return None
