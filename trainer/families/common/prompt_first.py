"""Edit and reference pipelines (``FluxKontextPipeline``, ``Flux2KleinPipeline``, ``QwenImageEditPipeline`` …) take
the image first and the prompt second; the trainer's samples and tools call every family's pipeline with the prompt
first. :class:`PromptFirst` passes it by name; anything else (``load_lora_weights`` …) reaches the pipeline."""

from __future__ import annotations

from typing import Any


class PromptFirst:
    """``pipe`` called as ``sampler(prompt, **kwargs)``; every attribute is the pipeline's."""

    def __init__(self, pipe: Any):
        self.pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, prompt: Any = None, **kwargs: Any) -> Any:
        return self.pipe(prompt=prompt, **kwargs)
