"""The training method a config asks for (LoRA and its variants, a fine-tune, an embedding), made for a loaded
model. Not in ``trainer/methods/__init__.py``: ``trainer.methods.rules`` is read by ``validate`` without torch, and
the methods import torch."""

from __future__ import annotations

from trainer.errors import ConfigError
from trainer.families import embedding_families
from trainer.methods.embedding import EmbeddingMethod
from trainer.methods.finetune import FinetuneMethod
from trainer.methods.lora import LoraMethod


def make_method(model, cfg):
    """The training method ``training.method`` names, set up on the loaded ``model``."""
    if (cfg.training.method == "embedding" or cfg.embedding.train_alongside) and not model.info.embeddings:
        key = "training.method" if cfg.training.method == "embedding" else "embedding.train_alongside"
        raise ConfigError(f"{key}: textual-inversion embeddings are trained for {embedding_families()}; this is a "
                          f"{model.info.label} model. Train a LoRA or a fine-tune instead.", key=key)
    if cfg.training.method == "lora":
        return LoraMethod(model, cfg)
    if cfg.training.method == "embedding":
        return EmbeddingMethod(model, cfg)
    return FinetuneMethod(model, cfg)
