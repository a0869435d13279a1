"""HunyuanImage 2.1's two text streams joined without reading the masks back.

diffusers' ``HunyuanImageTransformer2DModel.forward`` (0.42.1) joins the refined Qwen tokens and the projected ByT5
glyph tokens per row with boolean indexes — ``cat([text_2[m2], text[m], text_2[~m2], text[~m]])`` for the features
and again for the masks — eight device reads a row at every forward (each indexing waits for the GPU to say how
many tokens are real), before the first block runs.

The same order is a stable sort of the joined ``[ByT5 ‖ Qwen]`` tokens by "not real": real ByT5 tokens, real Qwen
tokens, then ByT5's padding and Qwen's, each in its own order. :func:`join_order` sorts on the device and the
tokens are gathered in that order (plain copies: the values are diffusers' bit for bit, the gradients too).

The transformer is left as diffusers has it. The step hands it a :class:`JoinedText` as ``encoder_hidden_states``
(the four tensors and the order), the joined mask as ``encoder_attention_mask`` and no second stream, so diffusers'
own loop is skipped; the forward of its ``context_embedder`` (the Qwen token refiner) is wrapped on the instance
(:func:`join_texts`: no module or weight renamed) to refine the Qwen tokens with their own mask, project the glyph
tokens with ``context_embedder_2`` and gather the two in order. Anything else (the pipeline's sampling) reaches the
refiner as before.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class JoinedText(NamedTuple):
    """The step's text for the transformer: Qwen features and mask, ByT5 features and mask, and the order
    (:func:`join_order`) of the joined ``[ByT5 ‖ Qwen]`` tokens."""

    embeds: torch.Tensor
    mask: torch.Tensor
    embeds_2: torch.Tensor
    mask_2: torch.Tensor
    order: torch.Tensor


def join_order(mask: torch.Tensor, mask_2: torch.Tensor) -> torch.Tensor:
    """Indices ``[B, L2 + L1]`` of the joined ``[ByT5 ‖ Qwen]`` tokens in diffusers' order (see the module
    docstring): a stable sort by "not real", made on the device."""
    padding = ~torch.cat([mask_2, mask], dim=1).bool()
    return torch.sort(padding.to(torch.int32), dim=1, stable=True).indices


def joined_mask(mask: torch.Tensor, mask_2: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The joined tokens' mask, in ``order``."""
    return torch.gather(torch.cat([mask_2, mask], dim=1).bool(), 1, order)


def join(embeds, mask, embeds_2, mask_2) -> "tuple[JoinedText, torch.Tensor]":
    """What the step hands the transformer: ``(encoder_hidden_states, encoder_attention_mask)``."""
    order = join_order(mask, mask_2)
    return JoinedText(embeds, mask, embeds_2, mask_2, order), joined_mask(mask, mask_2, order)


def join_texts(transformer: Any) -> bool:
    """Wrap the forward of ``transformer.context_embedder`` so that a :class:`JoinedText` is refined, projected
    and joined there (module docstring); False where the transformer has no glyph stream."""
    refiner, glyphs = transformer.context_embedder, getattr(transformer, "context_embedder_2", None)
    if glyphs is None or getattr(refiner, "joins_texts", False):
        return glyphs is not None
    plain = refiner.forward

    def forward(encoder_hidden_states, timestep, attention_mask=None):
        if not isinstance(encoder_hidden_states, JoinedText):
            return plain(encoder_hidden_states, timestep, attention_mask)
        text = encoder_hidden_states
        refined = plain(text.embeds, timestep, text.mask.bool())
        both = torch.cat([glyphs(text.embeds_2), refined], dim=1)
        return torch.gather(both, 1, text.order[..., None].expand(-1, -1, both.shape[-1]))

    refiner.forward = forward
    refiner.joins_texts = True
    return True


__all__ = ["JoinedText", "join", "join_order", "join_texts", "joined_mask"]
