"""What Qwen2.5-VL sees of an edit example, as diffusers' edit pipelines build it, without torchvision.

The processor. ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` run a ``Qwen2VLProcessor`` (the model's
``processor/`` folder) over the template and the control images. In transformers 5.23 that class cannot be built
here: ``Qwen2VLProcessor`` requires a video processor, and the only one, ``Qwen2VLVideoProcessor``, imports
torchvision (``from_pretrained`` raises "requires the Torchvision library"; PyPI's torchvision does not import beside
this torch), while its image processor ``Qwen2VLImageProcessor`` falls back by itself to the PIL/numpy
``Qwen2VLImageProcessorPil``. The pipelines never pass videos, so :class:`ImageTextProcessor` is
``Qwen2VLProcessor`` with the two parts they use — the PIL image processor and the tokenizer — and its own
``__call__`` (one ``<|image_pad|>`` per 2×2-merged 14 px patch). Its pixel values are the PIL backend's: with
torchvision installed, the default backend resizes with torchvision's bicubic and may differ in the last bits. The
image processor's settings come from the model's ``processor/preprocessor_config.json`` when it can be read, else
from :data:`PROCESSOR_CONFIG` (Qwen/Qwen-Image-Edit's, the same in -2509 and -2511); the tokenizer is the
pipeline's own (the same Qwen2.5-VL vocabulary with its vision tokens; checked against the text encoder's
``image_token_id`` when the model loads).

The images. Each control image is opened the right way up as 8-bit RGB and resized, with its own aspect ratio, to
the pipeline's area (``calculate_dimensions``: sides rounded to 32) with the pipeline's ``VaeImageProcessor.resize``
(Lanczos): Qwen-Image-Edit 1024² (the same image it encodes with the VAE), -2509/-2511 384²
(``CONDITION_IMAGE_SIZE``); the processor then fits each to 28 px multiples. musubi-tuner gives the VL encoder
384² for Edit too; ai-toolkit and ComfyUI's TextEncodeQwenImageEdit use 1024² for Edit as the pipeline does (ComfyUI
resizes with "area" and does not round to 32). Atelier follows the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
from PIL import Image
from transformers import Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from trainer.data.images import open_rgb

#: Qwen/Qwen-Image-Edit processor/preprocessor_config.json (Qwen2.5-VL's image settings)
PROCESSOR_CONFIG: Dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "resample": 3, "rescale_factor": 0.00392156862745098}
#: the area of the image each edit model's VL encoder sees (QwenImageEditPipeline: the 1024² VAE image itself)
VL_AREA = {"qwen-image-edit": 1024 * 1024, "qwen-image-edit-2509": CONDITION_IMAGE_SIZE,
           "qwen-image-edit-2511": CONDITION_IMAGE_SIZE}
#: QwenImageEditPlusPipeline._get_qwen_prompt_embeds: one per reference, before the instruction
PLUS_IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"


class ImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with its image processor and tokenizer and no video processor (see the module
    docstring): the same text expansion and image inputs for text and images."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Optional[str] = None,
                 **kwargs: Any):
        self.image_token, self.video_token = IMAGE_TOKEN, "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def build_processor(tokenizer: Any, config: Optional[Dict[str, Any]] = None) -> ImageTextProcessor:
    """The edit pipelines' processor from the pipeline's tokenizer and the image processor's settings."""
    return ImageTextProcessor(Qwen2VLImageProcessorPil.from_dict(dict(config or PROCESSOR_CONFIG)), tokenizer)


def local_processor_config(folder: Any) -> Optional[Dict[str, Any]]:
    """``<folder>/processor/preprocessor_config.json`` as a dict, or None when the folder has none."""
    path = Path(str(folder)) / "processor" / "preprocessor_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def vl_image(image: Image.Image, area: int, resizer: Any) -> Image.Image:
    """``image`` as the pipeline hands it to the processor: its aspect ratio at ``area`` pixels, sides rounded to 32,
    resized by ``resizer`` (the pipeline's ``VaeImageProcessor``)."""
    width, height = calculate_dimensions(area, image.size[0] / image.size[1])
    return resizer.resize(image, height, width)


def open_control(path: Any) -> Image.Image:
    """A control image file as 8-bit RGB, the right way up (as the data pipeline reads it)."""
    return open_rgb(Path(str(path)).expanduser())


def prompt_text(template: str, caption: str, images: int, plus: bool) -> str:
    """The text the processor gets: Edit's template holds its one image; Plus lists ``Picture i: …`` per image."""
    prefix = "".join(PLUS_IMAGE_PROMPT.format(i + 1) for i in range(images)) if plus else ""
    return template.format(prefix + caption)
