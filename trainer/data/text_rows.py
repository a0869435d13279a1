"""A batch's cached text entries: stacked, padded, and each row's real tokens known on the host."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


def prefix_lengths(mask: torch.Tensor) -> Optional[List[int]]:
    """The number of real tokens of each row of a host-side text mask ``[B, L]`` whose real tokens come first (a
    plain list, which stays on the host when the batch moves: a family that cuts features to their lengths reads them
    there instead of from the device), or None when a row's tokens are not a prefix. On the host only: the batch's
    stacked mask and a cached caption's (a device mask would be read back here)."""
    if mask.dim() != 2:
        return None
    real = mask > 0.5
    counts = real.sum(dim=-1)
    if not bool((real == (torch.arange(real.shape[-1]) < counts[:, None])).all()):
        return None
    return [int(n) for n in counts]


# the families' names of a text mask whose rows' real tokens a cached batch counts on the host, and the name of the
# counts: Z-Image/Qwen-Image …, Chroma/PixArt, and HunyuanImage's glyph (ByT5) mask
MASK_LENGTHS = {"prompt_mask": "prompt_lengths", "prompt_attention_mask": "prompt_lengths",
                "glyph_mask": "glyph_lengths"}


def stack_texts(texts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Cached text entries of a batch's rows, stacked (padded), with each row's real tokens (``prompt_lengths``,
    ``glyph_lengths``) where the masks say them."""
    out = {key: stack_padded([t[key] for t in texts]) for key in texts[0]}
    for mask_key, lengths_key in MASK_LENGTHS.items():
        lengths = prefix_lengths(out[mask_key]) if mask_key in out else None
        if lengths is not None:
            out[lengths_key] = lengths
    return out


def stack_padded(tensors: List[Any]) -> Any:
    """Stacked; entries of different lengths (text features with image tokens) zero-padded at the end of dim 0 to
    the longest (a padded mask entry is 0: not a token)."""
    longest = max(t.shape[0] for t in tensors) if tensors[0].dim() else 0
    if all(t.dim() == 0 or t.shape[0] == longest for t in tensors):
        return torch.stack(tensors)
    return torch.stack([torch.cat([t, t.new_zeros(longest - t.shape[0], *t.shape[1:])]) for t in tensors])


__all__ = ["MASK_LENGTHS", "prefix_lengths", "stack_padded", "stack_texts"]
