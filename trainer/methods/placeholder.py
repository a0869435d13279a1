"""Textual-inversion embeddings: new tokens whose vectors train while everything else stays frozen.

How the new tokens live in the model, and why:

- The placeholder (``<sks>``) becomes ``num_vectors`` added tokenizer tokens ``<sks>_0 <sks>_1 …``;
  captions and sample prompts are expanded to them before tokenizing (:meth:`PlaceholderEmbedding.expand`).
  The ``_i`` names also make diffusers' own multi-vector prompt rewriting a no-op in our pipelines.
- The text encoder's ``nn.Embedding`` is *not* resized. It is replaced by an ``nn.Embedding``
  subclass that shares the original weight ``Parameter`` (same state-dict key and shape, so
  fine-tune export and backups are unchanged) and looks the new ids up in a separate
  ``[num_vectors, dim]`` fp32 parameter. Only that parameter is in the optimizer, so no other token
  row can change: nothing to restore after a step, no gradient mask, and weight decay touches only
  the new vectors. The parameter lives in a small module (:class:`TokenVectors`) that is *not* a
  submodule of the text encoder, so a text encoder trained alongside (LoRA or fine-tune) never
  puts it in two optimizer groups.
- Results are written in A1111's format (``emb_params``), which A1111, ComfyUI and diffusers'
  ``load_textual_inversion`` read; the prompt word there is the file name (A1111/ComfyUI) or the
  ``token=`` argument (diffusers).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
from safetensors.torch import load_file
from torch import nn

from trainer.errors import ConfigError
from trainer.formats.embeddings import load_embedding_a1111, save_embedding_a1111
from trainer.methods.rules import placeholder_pattern

Text = Union[str, Sequence[str]]


class TokenVectors(nn.Module):
    """The trained vectors of one placeholder: the ``embedding`` optimizer group and backup entry."""

    def __init__(self, vectors: torch.Tensor, text_encoder: nn.Module):
        super().__init__()
        self.vectors = nn.Parameter(vectors.detach().float().clone())
        self.__dict__["_text_encoder"] = text_encoder  # not a submodule: its weights are not ours

    def gradient_checkpointing_enable(self) -> None:
        """The loop asks each trained module; gradients of the vectors flow through the text encoder."""
        te = self.__dict__["_text_encoder"]
        if hasattr(te, "gradient_checkpointing_enable"):
            te.gradient_checkpointing_enable()


class _EmbeddingWithNewTokens(nn.Embedding):
    """The text encoder's token embedding plus looked-up rows for the added token ids."""

    def __init__(self, base: nn.Embedding, holder: TokenVectors, token_ids: List[int]):
        nn.Module.__init__(self)
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, attr, getattr(base, attr))
        self.weight = base.weight  # the same Parameter: same key, same trainability
        self.__dict__["_holder"] = holder
        slot = torch.full((max(token_ids) + 1,), -1, dtype=torch.long)
        slot[torch.tensor(token_ids)] = torch.arange(len(token_ids))
        self.register_buffer("_slot", slot.to(base.weight.device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        slot = self._slot
        inside = input_ids < slot.numel()
        position = torch.where(inside, slot[input_ids.clamp(0, slot.numel() - 1)], -1)
        is_new = position >= 0
        base_ids = torch.where(is_new | (input_ids >= self.num_embeddings), 0, input_ids)
        out = super().forward(base_ids)
        vectors = self.__dict__["_holder"].vectors.to(device=out.device, dtype=out.dtype)
        # always through the vectors (zero gradient where unused), so a batch without the
        # placeholder still has a graph to backpropagate
        return torch.where(is_new.unsqueeze(-1), vectors[position.clamp(min=0)], out)


class PlaceholderEmbedding:
    """One placeholder's tokens in a tokenizer + CLIP text encoder, and their trainable vectors."""

    def __init__(self, tokenizer, text_encoder: nn.Module, placeholder: str, num_vectors: int,
                 initial_text: str = "*", init_vectors: Optional[torch.Tensor] = None):
        if not placeholder or any(c.isspace() for c in placeholder):
            raise ConfigError(f"embedding.placeholder = {placeholder!r}: give one word without spaces (e.g. <sks>).",
                              key="embedding.placeholder", value=placeholder)
        self.placeholder = placeholder
        self.tokens = [f"{placeholder.lower()}_{i}" for i in range(num_vectors)]
        vocab = tokenizer.get_vocab()
        taken = [t for t in self.tokens if t in vocab]
        if taken:
            raise ConfigError(f"embedding.placeholder = {placeholder!r}: the tokenizer already has the token "
                              f"{taken[0]!r}. Pick another placeholder.", key="embedding.placeholder",
                              value=placeholder)
        self.original_tokenizer = copy.deepcopy(tokenizer)
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.base: nn.Embedding = text_encoder.get_input_embeddings()
        tokenizer.add_tokens(self.tokens)
        self.token_ids = tokenizer.convert_tokens_to_ids(self.tokens)
        if init_vectors is None:
            init_vectors = self._initial_vectors(initial_text, num_vectors)
        elif tuple(init_vectors.shape) != (num_vectors, self.base.embedding_dim):
            raise ConfigError(f"embedding.init_weights holds vectors of shape {tuple(init_vectors.shape)}; this "
                              f"run needs ({num_vectors}, {self.base.embedding_dim}) (embedding.num_vectors, "
                              "text-encoder width).", key="embedding.init_weights")
        self.holder = TokenVectors(init_vectors.to(self.base.weight.device), text_encoder)
        self.module = _EmbeddingWithNewTokens(self.base, self.holder, self.token_ids)
        text_encoder.set_input_embeddings(self.module)
        self._pattern = placeholder_pattern(placeholder)
        self._replacement = " ".join(self.tokens)

    @classmethod
    def from_config(cls, model, ecfg) -> "Union[PlaceholderEmbedding, DualPlaceholderEmbedding]":
        """The placeholder for ``model``: in its one text encoder (SD 1.x/2.x), or in both of SDXL's
        (a :class:`DualPlaceholderEmbedding`)."""
        if getattr(model, "text_encoder_2", None) is not None:
            return DualPlaceholderEmbedding.from_config(model, ecfg)
        init = None
        if ecfg.init_weights:
            try:
                init = load_embedding_a1111(ecfg.init_weights)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ConfigError(f"embedding.init_weights '{ecfg.init_weights}' could not be read: {exc}",
                                  key="embedding.init_weights", value=ecfg.init_weights) from None
        return cls(model.tokenizer, model.text_encoder, ecfg.placeholder, int(ecfg.num_vectors),
                   ecfg.initial_text, init)

    def _initial_vectors(self, text: str, n: int) -> torch.Tensor:
        """Rows of the initial text's tokens, repeated or cut to ``n``; zeros without initial text."""
        ids = self.original_tokenizer(text, add_special_tokens=False).input_ids if text.strip() else []
        weight = self.base.weight.detach().float()
        if not ids:
            return torch.zeros(n, weight.shape[1], device=weight.device)
        return weight[[ids[i % len(ids)] for i in range(n)]].clone()

    # --- text --------------------------------------------------------------------------------
    def expand(self, text: Text) -> Text:
        """``a photo of <sks>`` → ``a photo of <sks>_0 <sks>_1`` (idempotent; lists map item by item)."""
        if isinstance(text, str):
            return self._pattern.sub(self._replacement, text)
        return [self._pattern.sub(self._replacement, t) for t in text]

    def contains(self, text: str) -> bool:
        return bool(self._pattern.search(text or ""))

    def data_warnings(self, items) -> List[str]:
        captions = [c for it in items for c in getattr(it, "captions", [])]
        hits = sum(1 for it in items if any(self.contains(c) for c in getattr(it, "captions", [])))
        if captions and hits == 0:
            return [f"No caption contains the embedding placeholder {self.placeholder!r}: the embedding gets no "
                    f"training signal. Write it into the captions (e.g. 'a photo of {self.placeholder}')."]
        return []

    # --- results -----------------------------------------------------------------------------
    def vectors(self) -> torch.Tensor:
        return self.holder.vectors.detach().float().cpu().clone()

    @contextlib.contextmanager
    def detached(self, model=None) -> Iterator[None]:
        """The text encoder (and ``model.tokenizer``) as they were before the placeholder was added,
        for exports of the whole model (a fine-tune's single file or diffusers folder)."""
        self.text_encoder.set_input_embeddings(self.base)
        if model is not None:
            model.tokenizer = self.original_tokenizer
        try:
            yield
        finally:
            self.text_encoder.set_input_embeddings(self.module)
            if model is not None:
                model.tokenizer = self.tokenizer

    def save(self, path: Union[str, Path], dtype: str, metadata: Optional[Dict[str, str]] = None,
             also_pt: bool = False, step: Optional[int] = None) -> List[Path]:
        """A1111 ``.safetensors`` (``emb_params``) or ``.pt``; with ``also_pt`` a ``.pt`` beside it."""
        path = Path(path)
        meta = {"atelier_placeholder": self.placeholder, "atelier_num_vectors": str(len(self.tokens)),
                **(metadata or {})}
        written = [path]
        save_embedding_a1111(path, self.vectors(), name=path.stem, step=step, metadata=meta, dtype=dtype)
        if also_pt and path.suffix.lower() != ".pt":
            written.append(path.with_suffix(".pt"))
            save_embedding_a1111(written[-1], self.vectors(), name=path.stem, step=step, dtype=dtype)
        return written


class _BothVectors(nn.Module):
    """SDXL: the CLIP-L and OpenCLIP-G vectors of one placeholder as one ``embedding`` module
    (one optimizer group; backup keys ``embedding.clip_l.vectors`` / ``embedding.clip_g.vectors``)."""

    def __init__(self, parts: Dict[str, TokenVectors]):
        super().__init__()
        for name, holder in parts.items():
            self.add_module(name, holder)

    def gradient_checkpointing_enable(self) -> None:
        for holder in self.children():
            holder.gradient_checkpointing_enable()


SDXL_PARTS = (("clip_l", "tokenizer", "text_encoder"), ("clip_g", "tokenizer_2", "text_encoder_2"))


class DualPlaceholderEmbedding:
    """One placeholder in both SDXL text encoders: the same added tokens ``<sks>_0 …`` in both
    tokenizers (so one expansion serves both), vectors for CLIP-L (768 wide) and OpenCLIP-G (1280).

    Saved as ``{"clip_l": T[n, 768], "clip_g": T[n, 1280]}`` — the SDXL embedding format of A1111,
    ComfyUI and diffusers (two ``load_textual_inversion`` calls: ``text_encoder``/``tokenizer`` with
    ``clip_l``, then ``text_encoder_2``/``tokenizer_2`` with ``clip_g``)."""

    def __init__(self, model, placeholder: str, num_vectors: int, initial_text: str = "*",
                 init_vectors: Optional[Dict[str, torch.Tensor]] = None):
        self.parts: Dict[str, PlaceholderEmbedding] = {}
        for key, tok_attr, te_attr in SDXL_PARTS:
            self.parts[key] = PlaceholderEmbedding(getattr(model, tok_attr), getattr(model, te_attr), placeholder,
                                                   num_vectors, initial_text,
                                                   None if init_vectors is None else init_vectors[key])
        first = self.parts["clip_l"]
        self.placeholder, self.tokens = first.placeholder, first.tokens
        self.holder = _BothVectors({k: p.holder for k, p in self.parts.items()})

    @classmethod
    def from_config(cls, model, ecfg) -> "DualPlaceholderEmbedding":
        init = None
        if ecfg.init_weights:
            init = load_embedding_sdxl(ecfg.init_weights)
        return cls(model, ecfg.placeholder, int(ecfg.num_vectors), ecfg.initial_text, init)

    # --- text (the same tokens in both tokenizers) -------------------------------------------------
    def expand(self, text: Text) -> Text:
        return self.parts["clip_l"].expand(text)

    def contains(self, text: str) -> bool:
        return self.parts["clip_l"].contains(text)

    def data_warnings(self, items) -> List[str]:
        return self.parts["clip_l"].data_warnings(items)

    # --- results ----------------------------------------------------------------------------------
    def vectors(self) -> Dict[str, torch.Tensor]:
        return {k: p.vectors() for k, p in self.parts.items()}

    @contextlib.contextmanager
    def detached(self, model=None) -> Iterator[None]:
        """Both encoders and tokenizers as they were before the placeholder was added."""
        for key, tok_attr, _ in SDXL_PARTS:
            part = self.parts[key]
            part.text_encoder.set_input_embeddings(part.base)
            if model is not None:
                setattr(model, tok_attr, part.original_tokenizer)
        try:
            yield
        finally:
            for key, tok_attr, _ in SDXL_PARTS:
                part = self.parts[key]
                part.text_encoder.set_input_embeddings(part.module)
                if model is not None:
                    setattr(model, tok_attr, part.tokenizer)

    def save(self, path: Union[str, Path], dtype: str, metadata: Optional[Dict[str, str]] = None,
             also_pt: bool = False, step: Optional[int] = None) -> List[Path]:
        """``{"clip_l", "clip_g"}`` ``.safetensors``. A1111's ``.pt`` holds one tensor, so there is no
        SDXL ``.pt``: ``also_pt`` is skipped with a log line."""

        path = Path(path)
        if path.suffix.lower() != ".safetensors":
            raise ValueError(f"SDXL embeddings are saved as .safetensors (clip_l + clip_g); got {path.name!r}")
        if also_pt:
            logging.getLogger("atelier").warning("embedding.save_pt: SDXL embeddings have no A1111 .pt form; "
                                                 "only %s is written", path.name)
        meta = {"atelier_placeholder": self.placeholder, "atelier_num_vectors": str(len(self.tokens)),
                **(metadata or {})}
        save_embedding_a1111(path, self.vectors(), name=path.stem, step=step, metadata=meta, dtype=dtype)
        return [path]


def load_embedding_sdxl(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """``{"clip_l": T[n, 768], "clip_g": T[n, 1280]}`` from an SDXL embedding ``.safetensors``."""
    try:
        data = load_file(str(path))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"embedding.init_weights '{path}' could not be read: {exc}", key="embedding.init_weights",
                          value=str(path)) from None
    if not {"clip_l", "clip_g"} <= set(data):
        raise ConfigError(f"embedding.init_weights '{path}' is not an SDXL embedding (keys {sorted(data)[:5]}; "
                          "expected clip_l and clip_g). SD 1.x/2.x embeddings do not fit SDXL's encoders.",
                          key="embedding.init_weights", value=str(path))
    return {k: data[k].detach().reshape(-1, data[k].shape[-1]).float() for k in ("clip_l", "clip_g")}


def file_safe(name: str) -> str:
    """A placeholder as part of a file name (``<sks>`` → ``sks``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "", name).strip(".") or "embedding"


def step_from(metadata: Dict[str, str]) -> Optional[int]:
    try:
        return int(metadata.get("atelier_step", ""))
    except ValueError:
        return None
