"""Full fine-tune: the chosen components train entirely; saved as a single file or a diffusers folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from trainer.methods.base import MethodBase


class FinetuneMethod(MethodBase):
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
        if t.train_text_encoder_2:
            if getattr(model, "text_encoder_2", None) is None:
                from trainer.config import ConfigError
                raise ConfigError(f"training.train_text_encoder_2 is on, but this {model.family} model has one "
                                  "text encoder.", key="training.train_text_encoder_2")
            model.text_encoder_2.requires_grad_(True)
            self.modules["text_encoder_2"] = model.text_encoder_2
        for m in self.modules.values():
            if next(m.parameters()).dtype == torch.float16:
                m.to(dtype=torch.float32)  # fp16 master weights lose updates; autocast does the rest
        self._add_alongside_embedding(model, cfg)

    def result_suffix(self, fmt: str) -> str:
        return {"auto": ".safetensors", "safetensors": ".safetensors", "ckpt": ".ckpt", "diffusers": ""}[fmt]

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        from contextlib import nullcontext

        from trainer.export import save_diffusers_folder, save_single_file_sd
        m = self.model
        # the model as users load it: no placeholder tokens in tokenizer or text encoder
        with self.embedding.detached(m) if self.embedding is not None else nullcontext():
            if str(path).endswith((".safetensors", ".ckpt")):
                extra = {"text_encoder_2": m.text_encoder_2} if getattr(m, "text_encoder_2", None) else {}
                save_single_file_sd(path, m.unet, m.vae, m.text_encoder, family=m.family, dtype=dtype,
                                    metadata=metadata, **extra)
            else:  # a diffusers folder carries the model's own sampler (DDIM for SD, Euler for SDXL)
                save_diffusers_folder(path, m.pipeline("ddim" if m.family != "sdxl" else None), dtype)
        self._save_alongside_embedding(Path(path), dtype, metadata)


def make_method(model, cfg):
    if cfg.training.method == "lora":
        from trainer.methods.lora import LoraMethod
        return LoraMethod(model, cfg)
    if cfg.training.method == "embedding":
        from trainer.methods.embedding import EmbeddingMethod
        return EmbeddingMethod(model, cfg)
    return FinetuneMethod(model, cfg)
