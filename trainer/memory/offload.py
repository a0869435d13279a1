"""Text encoders out of VRAM while they have nothing to do (``data.offload_text_encoders``).

With every caption's encoder outputs cached and no text-side module training, the text encoders are only
needed to fill the text cache and to encode sample prompts. Each one gets accelerate's
``cpu_offload_with_hook``: its weights live in CPU RAM and move to the training device when it is called.
The denoiser and the encoders then take turns on the device: an encoder's call first sends the denoiser
(with its adapters) to CPU RAM, the denoiser's next call sends the encoders back and itself in. So the text
cache and the samples' prompt encoding never hold the encoders and the denoiser together (Flux.1: T5-XXL
~9 GiB and the fp8 transformer ~16 GiB do not fit a 24 GB card together). diffusers'
``enable_model_cpu_offload`` does this for a whole pipeline; here only these parts move, and only around
text encoding, never between an optimizer step's parts (the encoders run in no training step)."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch
from accelerate import cpu_offload_with_hook

log = logging.getLogger("atelier")

TEXT_SLOTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


def text_frozen(method: Any) -> bool:
    """True when no text-side module (a text encoder, an embedding) trains: cached text outputs stay valid."""
    return not {"text_encoder", "text_encoder_2", "embedding"} & set(method.modules)


class TextEncoderOffload:
    """The hooks of one run; ``slots``: the text encoders moved to CPU RAM."""

    def __init__(self, model: Any, device: Any):
        self.model = model
        self.device = torch.device(device)
        self.swaps = self.device.type != "cpu"  # on a CPU run everything already lives in RAM
        self.hooks: List[Any] = []
        self.slots: List[str] = []
        for slot in TEXT_SLOTS:
            module = model.part(slot) if model.info.part(slot) is not None else None
            if module is None:
                continue
            module.register_forward_pre_hook(lambda _m, _a: self.denoiser_out())  # runs before accelerate's move
            _, hook = cpu_offload_with_hook(module, execution_device=self.device)
            self.hooks.append((module, hook))
            self.slots.append(slot)
        model.denoiser.register_forward_pre_hook(lambda _m, _a: self.encoders_out())
        self._empty_cache()

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def denoiser_out(self) -> None:
        """Before a text encoder runs: the denoiser to CPU RAM (when it is on the device)."""
        den = self.model.denoiser
        if self.swaps and next(den.parameters()).device.type != "cpu":
            self._move(den, "cpu")
            self._empty_cache()

    def encoders_out(self) -> None:
        """Before the denoiser runs: the text encoders to CPU RAM, the denoiser back on the device."""
        moved = False
        for module, hook in self.hooks:
            if next(module.parameters()).device.type != "cpu":
                hook.offload()
                moved = True
        den = self.model.denoiser
        if self.swaps and next(den.parameters()).device != self.device:
            if moved:
                self._empty_cache()
            self._move(den, self.device)

    def _move(self, den: Any, device: Any) -> None:
        swap = getattr(self.model, "block_swap", None)  # swapped blocks' weights stay in RAM (trainer.memory.block_swap)
        if swap is not None:
            swap.place(den, device)
        else:
            den.to(device)


def plan_offload(cfg: Any, cacheable: bool, frozen_text: bool,
                 warn: Optional[Callable[[str], None]] = None) -> bool:
    """Whether ``data.offload_text_encoders`` applies to this run (it needs every caption cached and the text
    side frozen); warns naming why not when it was asked for and cannot."""
    if not cfg.data.get("offload_text_encoders", False):
        return False
    why = None
    if not frozen_text:
        why = "a text encoder (or an embedding) trains, so the encoders run every step"
    elif not cfg.data.cache_text:
        why = "data.cache_text is off, so the encoders run every step"
    elif not cacheable:
        why = "tag shuffling or tag dropout makes captions vary, so they are not cached and the encoders run every step"
    if why is not None:
        if warn is not None:
            warn(f"data.offload_text_encoders is on but has no effect: {why}. Turn data.cache_text on (and tag "
                 "shuffling/dropout off) with frozen text encoders, or turn data.offload_text_encoders off.")
        return False
    return True


__all__ = ["TEXT_SLOTS", "TextEncoderOffload", "plan_offload", "text_frozen"]
