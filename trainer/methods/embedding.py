"""``training.method = embedding``: textual inversion, where only a placeholder's new token vectors train
(how they live in the model: :mod:`trainer.methods.placeholder`)."""

from __future__ import annotations

from typing import Any, Dict

from trainer.methods.base import MethodBase
from trainer.methods.placeholder import DualPlaceholderEmbedding, PlaceholderEmbedding, step_from


class EmbeddingMethod(MethodBase):
    """``training.method = embedding``: only the placeholder's vectors train (text expansion and data
    warnings come from :class:`~trainer.methods.base.MethodBase`)."""

    name = "embedding"

    def __init__(self, model, cfg):
        self.model = model
        self.cfg = cfg
        self.embedding = PlaceholderEmbedding.from_config(model, cfg.embedding)
        self.modules: Dict[str, Any] = {"embedding": self.embedding.holder}

    def result_suffix(self, fmt: str) -> str:
        if fmt in ("auto", "safetensors"):
            return ".safetensors"
        if fmt == "ckpt" and isinstance(self.embedding, DualPlaceholderEmbedding):
            raise ValueError("output.format = ckpt: SDXL embeddings (clip_l + clip_g) have no A1111 .pt form; "
                             "use safetensors.")
        if fmt == "ckpt":
            return ".pt"  # A1111's legacy embedding format
        raise ValueError(f"output.format = {fmt} is not available for embeddings; use safetensors (or ckpt "
                         "for an A1111 .pt file).")

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        self.embedding.save(path, dtype, metadata, also_pt=bool(self.cfg.embedding.save_pt),
                            step=step_from(metadata))
