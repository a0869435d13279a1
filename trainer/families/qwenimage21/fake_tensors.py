"""Qwen-Image 2.1 on the VRAM estimate's fake tensors (shapes and dtypes, no values: ``trainer/memory/estimate.py``).

These places of the real path read tensor values, which a fake tensor cannot give (DataDependentOutputException):

- the text: the processor checks its special tokens in the token ids it makes, so it tokenizes on real tensors here
  (:class:`PaddedProcessor`); ``QwenImage21Pipeline._extract_masked_hidden`` splits the features by each caption's
  token count (``mask.sum(1).tolist()``). On fake tensors every token is kept (the estimate session's ``nonzero``
  already keeps every masked element): :func:`masked_hidden` splits them in whole rows. And as the estimate's
  captions are short while the pipeline pads a batch to its longest caption only, :func:`longest_captions` has the
  processor pad them to ``max_sequence_length`` tokens after the dropped system prefix: Qwen3-VL runs, and the
  features come out, at the length of the longest caption the cache keeps.
- the denoiser's text length, cut back to the batch's longest caption by :meth:`QwenImage21.predict`: on fake
  tensors the longest there is, ``max_sequence_length``, with no padding mask.
- the transformer's own layout of the joint sequence, built from ``img_mask``'s values (``repeat_interleave`` by the
  image slots, a boolean scatter of the latents into them, the RoPE positions and the block-causal segments from
  ``.tolist()``). :func:`fake_forward` is ``QwenImage21Transformer2DModel.forward`` (diffusers 0.42.1) for the call
  :meth:`~QwenImage21.predict` makes (the text, then the target image; no condition images, no KV cache): the layout
  is computed by the transformer's own functions on real tensors of the known shape, and every module — the
  projections, the shared modulation, each block (through the transformer's gradient-checkpointing function when it is
  on), ``norm_out``, ``proj_out`` — runs as in the real forward. The joint sequence is the concatenation of the text
  and the image tokens, what the real forward's repeat and scatter lay out (one [B, L + h·w, D] tensor either way).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Iterator

import torch
from diffusers import QwenImage21Pipeline
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_qwenimage21 as qwen21
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

TOKENS_PER_SLOT = 4  # each image slot of img_mask stands for a 2×2 group of latent tokens


def masked_hidden(hidden_states: torch.Tensor, mask: torch.Tensor):
    """``QwenImage21Pipeline._extract_masked_hidden`` (it reads nothing of its pipeline); on fake tensors every token
    kept, each caption as long as the padded batch."""
    if not is_fake(hidden_states):
        return QwenImage21Pipeline._extract_masked_hidden(None, hidden_states, mask)
    selected = hidden_states[mask.bool()]  # the session's nonzero keeps every element: B·L rows
    return torch.split(selected, [mask.shape[1]] * mask.shape[0], dim=0)


class PaddedProcessor:
    """The pipeline's processor, its text padded to ``length`` tokens (``padding="max_length"``) whatever the call
    asks, on real tensors: the token ids are data (the processor checks its special tokens in them)."""

    def __init__(self, processor: Any, length: int):
        self.processor, self.length = processor, length

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)

    def __call__(self, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return self.processor(**{**kwargs, "padding": "max_length", "max_length": self.length})


def longest_captions(view: Any, length: int) -> Any:
    """What the pipeline's text function reads of its pipeline (``view``), its captions padded to ``length`` tokens
    after the system prefix it drops."""
    return types.SimpleNamespace(**{**vars(view), "processor": PaddedProcessor(view.processor,
                                                                               view._drop_idx + length)})


def fake_forward(self: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 timestep: torch.Tensor, img_shapes, img_mask: torch.Tensor, encoder_hidden_states_mask=None,
                 attention_kwargs=None, kv_cache=None, kv_cache_mode=None, return_dict: bool = True):
    """``QwenImage21Transformer2DModel.forward`` for the text-then-target call, with the layout from shapes (see the
    module docstring). ``self`` is the transformer."""
    if kv_cache is not None or len(img_shapes[0]) != 1 or encoder_hidden_states_mask is not None:
        raise ValueError("the VRAM estimate's Qwen-Image 2.1 forward takes the text and one target image, every text "
                         "token kept and no KV cache")
    batch_size, text_len = hidden_states.shape[0], encoder_hidden_states.shape[1]
    target_tokens = math.prod(img_shapes[0][-1])
    if img_mask.shape[1] != text_len + target_tokens // TOKENS_PER_SLOT:
        raise ValueError("img_mask is not the text slots followed by the target image's")
    with unset_fake_temporarily():  # the layout, on real tensors: the model's own functions
        image_pad_mask = torch.cat([torch.zeros(text_len, dtype=torch.bool),
                                    torch.ones(target_tokens, dtype=torch.bool)])
        image_ids, target_token_mask = self.build_token_metadata(image_pad_mask, img_shapes[0])
        prefix_len = int((~target_token_mask).sum())
        processors = [block.attn.processor for block in self.transformer_blocks]
        flex = [isinstance(p, qwen21.QwenImage21FlexAttnProcessor) for p in processors]
        attention_mask = (qwen21.build_qwenimage21_block_causal_mask(image_ids, None, batch_size, "cpu")
                          if any(flex) else None)
        segments = None if all(flex) else qwen21._qwenimage21_prefix_segments(image_ids, prefix_len)
        # the real freqs tables are fake (built with the model): indexed by real positions, they give fake ones
        rotary_emb = self.pos_embed(img_shapes[0], image_pad_mask, device=hidden_states.device)

    hidden_states = self.img_in(hidden_states)
    encoder_hidden_states = self.txt_in(encoder_hidden_states)
    joint_hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    timestep = timestep.to(hidden_states.dtype)
    if self.config.causal_condition:
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = target_token_mask
    else:
        modulation_mask = None
    temb = self.time_text_embed(timestep, hidden_states)
    modulation = self.modulation(temb)

    for block in self.transformer_blocks:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            joint_hidden_states = self._gradient_checkpointing_func(
                block, joint_hidden_states, modulation, rotary_emb, attention_mask, modulation_mask, None, None,
                None, segments, None)
        else:
            joint_hidden_states = block(hidden_states=joint_hidden_states, modulation=modulation,
                                        rotary_emb=rotary_emb, attention_mask=attention_mask,
                                        target_token_mask=modulation_mask, segments=segments)

    joint_hidden_states = self.norm_out(joint_hidden_states, temb, modulation_mask)
    output = self.proj_out(joint_hidden_states)
    return (output,) if not return_dict else Transformer2DModelOutput(sample=output)


@contextlib.contextmanager
def layout_from_shapes(transformer: Any, fake: bool) -> Iterator[None]:
    """While ``fake``: ``transformer``'s forward is :func:`fake_forward` (its module hooks still run: it is called as
    the module)."""
    if not fake:
        yield
        return
    own = transformer.__dict__.get("forward")  # a forward set on the instance (none on the transformer today)
    transformer.forward = types.MethodType(fake_forward, transformer)
    try:
        yield
    finally:
        if own is None:
            del transformer.forward
        else:
            transformer.forward = own
