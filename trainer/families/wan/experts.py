"""Wan 2.2 A14B with both experts training in one run (``model.wan_expert: both``): the two transformers as one
module whose forward sends each sample to the expert of its timestep, as ``WanPipeline`` switches them (t ≥
``boundary_ratio``·1000: the high-noise ``transformer``), so a batch may feed both. Its LoRA layers live under
``high.`` and ``low.``; the run's result is two files in the original layout, one per expert (:func:`split_experts`)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

LOW_FILE_PREFIX = "low_noise."  # the low expert's keys inside one state dict, before the result is split in two
LOW_SUFFIX = "_low_noise"  # the low expert's result file: <result stem>_low_noise.safetensors


class TwoExperts(nn.Module):
    """``high`` and ``low`` WanTransformer3DModels behind the call the family makes; ``boundary``: the timestep
    (0–1000) from which the high-noise expert runs."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, float(boundary)

    @property
    def config(self) -> Any:
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    @property
    def blocks(self) -> list:
        """Both experts' blocks (block swapping: ``Wan.swap_blocks``); a step runs those of one or both."""
        return list(self.high.blocks) + list(self.low.blocks)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func: Any = None) -> None:
        self.high.enable_gradient_checkpointing(gradient_checkpointing_func)
        self.low.enable_gradient_checkpointing(gradient_checkpointing_func)

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict: bool = False, **kwargs: Any):
        high = timestep.view(timestep.shape[0], -1)[:, 0] >= self.boundary
        parts, order = [], []
        for expert, rows in ((self.high, high), (self.low, ~high)):
            index = rows.nonzero().flatten()
            if index.numel():
                parts.append(expert(hidden_states=hidden_states[index], timestep=timestep[index],
                                    encoder_hidden_states=encoder_hidden_states[index], return_dict=False,
                                    **kwargs)[0])
                order.append(index)
        out = torch.cat(parts)[torch.argsort(torch.cat(order))]  # back in the batch's order
        return (out,)


def split_experts(state: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """One state dict of both experts' LoRA → (the high expert's, {file suffix: the low expert's})."""
    high = {k: v for k, v in state.items() if not k.startswith(LOW_FILE_PREFIX)}
    low = {k[len(LOW_FILE_PREFIX):]: v for k, v in state.items() if k.startswith(LOW_FILE_PREFIX)}
    return high, {LOW_SUFFIX: low}
