"""What every training method offers the loop besides ``modules``, ``result_suffix`` and ``save``:
text expansion (an embedding's placeholder) and data warnings. LoRA and fine-tune runs may train an
embedding alongside (``embedding.train_alongside``); this base class holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from trainer.methods.placeholder import PlaceholderEmbedding, file_safe, step_from

Text = Union[str, Sequence[str]]


class MethodBase:
    embedding: Any = None  # a trainer.methods.placeholder.PlaceholderEmbedding, when one trains

    def _add_alongside_embedding(self, model, cfg) -> None:
        """With ``embedding.train_alongside``: add the placeholder and its ``embedding`` group."""
        if cfg.embedding.train_alongside:
            self.embedding = PlaceholderEmbedding.from_config(model, cfg.embedding)
            self.modules["embedding"] = self.embedding.holder

    def expand_text(self, text: Text) -> Text:
        """Captions and prompts as the tokenizer must see them (placeholder → its tokens)."""
        return text if self.embedding is None else self.embedding.expand(text)

    def data_warnings(self, items) -> List[str]:
        return [] if self.embedding is None else self.embedding.data_warnings(items)

    def prepare_data(self, data, warn) -> None:
        """Before the data is prepared: register the placeholder with the caption processor (so
        tag dropout never drops it and cached captions are final) and warn when no caption has it.
        The loop still expands text before tokenizing; expanding is idempotent."""
        if self.embedding is None:
            return
        if hasattr(data, "set_placeholder"):
            data.set_placeholder(self.embedding.placeholder, self.embedding.expand(self.embedding.placeholder))
        for message in self.data_warnings(getattr(data, "items", [])):
            warn(message)

    def _save_alongside_embedding(self, result: Path, dtype: str, metadata: Dict[str, str]) -> Optional[List[Path]]:
        """``<result stem>-<placeholder>.safetensors`` beside the result (A1111/ComfyUI prompt word:
        that file name; diffusers: ``load_textual_inversion(path, token=<placeholder>)``)."""
        if self.embedding is None:
            return None
        result = Path(result)
        stem = result.name[: -len(result.suffix)] if result.suffix else result.name
        path = result.with_name(f"{stem}-{file_safe(self.embedding.placeholder)}.safetensors")
        return self.embedding.save(path, dtype, metadata, also_pt=bool(self.cfg.embedding.save_pt),
                                   step=step_from(metadata))
