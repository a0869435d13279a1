"""Full fine-tune: the chosen components train entirely; saved as a single file or a diffusers folder."""

from __future__ import annotations

from typing import Any, Dict


class FinetuneMethod:
    name = "finetune"

    def __init__(self, model, cfg):
        import torch
        self.model = model
        self.cfg = cfg
        t = cfg.training
        self.modules: Dict[str, Any] = {}
        if t.train_unet:
            model.unet.requires_grad_(True)
            self.modules["unet"] = model.unet
        if t.train_text_encoder:
            model.text_encoder.requires_grad_(True)
            self.modules["text_encoder"] = model.text_encoder
        for m in self.modules.values():
            if next(m.parameters()).dtype == torch.float16:
                m.to(dtype=torch.float32)  # fp16 master weights lose updates; autocast does the rest

    def result_suffix(self, fmt: str) -> str:
        return {"auto": ".safetensors", "safetensors": ".safetensors", "ckpt": ".ckpt", "diffusers": ""}[fmt]

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        from trainer.export import save_diffusers_folder, save_single_file_sd
        m = self.model
        if str(path).endswith((".safetensors", ".ckpt")):
            save_single_file_sd(path, m.unet, m.vae, m.text_encoder, family=m.family, dtype=dtype,
                                metadata=metadata)
        else:
            save_diffusers_folder(path, m.pipeline("ddim"), dtype)


def make_method(model, cfg):
    if cfg.training.method == "lora":
        from trainer.methods.lora import LoraMethod
        return LoraMethod(model, cfg)
    return FinetuneMethod(model, cfg)
