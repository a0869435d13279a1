"""Full fine-tune: the chosen components train entirely; saved as a single file or a diffusers folder."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict

import torch

from trainer.formats.checkpoint import save_diffusers_folder
from trainer.methods.base import MethodBase
from trainer.methods.lora import chosen_parts


class FinetuneMethod(MethodBase):
    name = "finetune"

    def __init__(self, model, cfg):
        self.model = model
        self.cfg = cfg
        self.modules: Dict[str, Any] = {}
        for slot, module in chosen_parts(model, cfg).items():
            module.requires_grad_(True)
            self.modules[slot] = module
        for m in self.modules.values():
            if next(m.parameters()).dtype == torch.float16:
                m.to(dtype=torch.float32)  # fp16 master weights lose updates; autocast does the rest
        self._add_alongside_embedding(model, cfg)

    def result_suffix(self, fmt: str) -> str:
        return {"auto": ".safetensors", "safetensors": ".safetensors", "ckpt": ".ckpt", "diffusers": ""}[fmt]

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        m = self.model
        # the model as users load it: no placeholder tokens in tokenizer or text encoder
        with self.embedding.detached(m) if self.embedding is not None else nullcontext():
            if str(path).endswith((".safetensors", ".ckpt")):
                m.save_single_file(path, dtype=dtype, metadata=metadata)
            else:  # a diffusers folder carries the model's own sampler (DDIM for SD, Euler for SDXL)
                save_diffusers_folder(path, m.pipeline(getattr(m, "folder_sampler", None)), dtype)
        self._save_alongside_embedding(Path(path), dtype, metadata)
