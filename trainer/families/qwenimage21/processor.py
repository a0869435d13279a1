"""The Qwen3-VL processor ``QwenImage21Pipeline`` prompts with, built without torchvision.

The pipeline's ``processor`` is a ``Qwen3VLProcessor``: the model's ``processor/`` folder (tokenizer files and the
image processor's settings). In transformers 5.x that class cannot be built here from the folder: its video processor
imports torchvision, which does not install beside this torch; the image processor falls back by itself to the
PIL/numpy ``Qwen2VLImageProcessorPil``. Text-to-image training and samples never pass videos (nor images), so
:class:`TextImageProcessor` is ``Qwen3VLProcessor`` with the image processor and the tokenizer only, and its own
``__call__``/``apply_chat_template`` unchanged: the pipeline's template, left padding and system-prefix length are
computed by the pipeline's own code on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from diffusers import QwenImage21Pipeline
from transformers import AutoTokenizer, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

#: Qwen/Qwen3-VL-8B-Instruct preprocessor_config.json (16 px patches, merged 2×2)
IMAGE_CONFIG: Dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "resample": 3, "rescale_factor": 0.00392156862745098}
#: the processor's chat template for system/user turns whose content is a string or a list of text parts
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is string "
    "%}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


class TextImageProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without its video processor (see the module docstring)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Optional[str] = None,
                 **kwargs: Any):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer,
                                chat_template=chat_template or getattr(tokenizer, "chat_template", None)
                                or CHAT_TEMPLATE)


def build_processor(tokenizer: Any, config: Optional[Dict[str, Any]] = None) -> TextImageProcessor:
    """The pipeline's processor from its tokenizer and the image processor's settings."""
    return TextImageProcessor(Qwen2VLImageProcessorPil.from_dict(dict(config or IMAGE_CONFIG)), tokenizer)


def load_processor(location: str, **hub: Any) -> TextImageProcessor:
    """The ``processor/`` of a diffusers Qwen-Image 2.1 folder or hub repo (``hub``: cache_dir, revision)."""
    if Path(str(location)).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(Path(str(location)) / "processor"))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(location), subfolder="processor", **hub)
    return build_processor(tokenizer)


class ProcessorAt(ProcessorMixin):
    """Where the processor is (a diffusers folder or hub repo): given to :class:`QwenImage21Loading` as its
    ``processor``, read when the pipeline is built. A ``ProcessorMixin`` only for diffusers' check of the type of a
    component passed to ``from_pretrained``; it is never used as one."""

    def __init__(self, location: str, **hub: Any):  # a placeholder: none of ProcessorMixin's state
        self.location, self.hub = location, hub

    def load(self) -> TextImageProcessor:
        return load_processor(self.location, **self.hub)


class QwenImage21Loading(QwenImage21Pipeline):
    """``QwenImage21Pipeline`` as Atelier loads it: its ``processor`` read through :class:`ProcessorAt` (the folder's
    ``processor/``), or built from a ``tokenizer`` component where a component loader reads one (the VRAM estimator's
    config folder, which has the tiny model's tokenizer beside its processor)."""

    _optional_components = [*QwenImage21Pipeline._optional_components, "tokenizer"]

    def __init__(self, scheduler: Any, vae: Any, text_encoder: Any, processor: Any, transformer: Any,
                 sample_sigmas: Optional[list] = None, tokenizer: Any = None):
        if tokenizer is not None and not isinstance(processor, TextImageProcessor):
            processor = build_processor(tokenizer)
        elif isinstance(processor, ProcessorAt):
            processor = processor.load()
        super().__init__(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                         transformer=transformer, sample_sigmas=sample_sigmas)
