"""The captioners Atelier had first, through transformers: BLIP (``model_type: blip``), Florence-2 (``florence2``,
the transformers-native checkpoints such as ``florence-community/Florence-2-base``) and taggers exported to
transformers image classification (ViT/ConvNeXt/SwinV2 ``…ForImageClassification`` whose ``id2label`` are the tags:
every tag scoring above ``--threshold`` kept, best first, the four WD rating labels left out).

Torch-free to import: torch and transformers are imported inside the functions that load and run a model.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from trainer.tools import ToolError
from trainer.tools.captioners.shared import Captioner, ModelSource, load_pretrained, model_dtype, say
from trainer.tools.captioners.tags import RATING_TAGS, pick_tags
from trainer.tools.captioners.wd import square_on_white

DEFAULT_CAPTION_MODEL = "Salesforce/blip-image-captioning-base"
KNOWN_TAGGER = "SmilingWolf/wd-vit-tagger-v3"
FLORENCE_TASKS = {"caption": "<CAPTION>", "detailed": "<DETAILED_CAPTION>",
                  "more-detailed": "<MORE_DETAILED_CAPTION>"}
DEFAULT_MAX_TOKENS = {"blip": 40, "florence2": 256}


class GenerativeCaptioner(Captioner):
    """BLIP and Florence-2: image (+ Florence-2's task prompt) → text, beam search (3 beams)."""

    def __init__(self, kind: str, model: Any, processor: Any, device: str, max_tokens: int, task: str = ""):
        self.kind, self.model, self.processor, self.device = kind, model, processor, device
        self.max_tokens, self.task = max_tokens, task

    def caption(self, images: List[Any]) -> List[str]:
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        if self.kind == "florence2":
            inputs = self.processor(text=[self.task] * len(images), images=images, return_tensors="pt")
        else:
            inputs = self.processor(images=images, return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        inputs = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items() if hasattr(v, "to")}
        with torch.inference_mode():
            ids = self.model.generate(**inputs, max_new_tokens=self.max_tokens, num_beams=3)
        # Florence-2's captioning tasks are "pure text": its post-processing only drops the special tokens
        return [t.strip() for t in self.processor.batch_decode(ids, skip_special_tokens=True)]


class TagCaptioner(Captioner):
    """A multi-label image classifier whose labels are tags: each image padded to a square on white (as the
    WD taggers were trained), scored with a sigmoid (softmax for a single-label model)."""

    kind = "tagger"
    tags = True

    def __init__(self, model: Any, processor: Any, device: str, threshold: float, limit: int):
        self.model, self.processor, self.device = model, processor, device
        self.threshold, self.limit = threshold, limit
        self.labels = {int(k): str(v) for k, v in model.config.id2label.items()}
        names = set(self.labels.values())
        self.skip = RATING_TAGS if all(r in names for r in RATING_TAGS) else ()

    def scores(self, images: List[Any]) -> Any:
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        inputs = self.processor(images=[square_on_white(im) for im in images], return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        pixels = inputs["pixel_values"].to(self.device, dtype)
        with torch.inference_mode():
            logits = self.model(pixel_values=pixels).logits.float()
        if getattr(self.model.config, "problem_type", None) == "single_label_classification":
            return logits.softmax(-1).cpu()
        return logits.sigmoid().cpu()

    def caption(self, images: List[Any]) -> List[str]:
        return [", ".join(pick_tags(row.tolist(), self.labels, self.threshold, self.limit, self.skip))
                for row in self.scores(images)]


def _is_classifier(cfg: Dict[str, Any]) -> bool:
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any(a.endswith("ForImageClassification") for a in archs):
        return True
    # inside: --help and the UI import this module for its defaults, without torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    return not archs and cfg.get("model_type") in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES


def classic_family(cfg: Dict[str, Any]) -> str:
    """``blip``, ``florence2`` or ``tagger`` (an image classifier whose labels are tags) for a transformers model's
    config; "" for any other."""
    kind = str(cfg.get("model_type") or "")
    if kind in ("blip", "florence2"):
        return kind
    if kind and _is_classifier(cfg):
        return "tagger"
    return ""


def load_classic(src: ModelSource, cfg: Dict[str, Any], family: str, device: str, *, max_tokens: Optional[int],
                 task: Optional[str], threshold: float, tag_limit: int) -> Captioner:
    """A BLIP, Florence-2 or transformers tagger ``family`` (:func:`classic_family`) loaded on ``device``."""
    spec, kind = src.spec, str(cfg.get("model_type") or "")
    if family == "tagger":
        labels = cfg.get("id2label") or {}
        if len(labels) < 3:
            raise ToolError(f"--model '{spec}' is an image classifier with {len(labels)} labels, not a tagger; give a "
                            "tagger whose id2label holds the tags.")
    if task and family != "florence2":
        raise ToolError(f"--task applies to Florence-2 models; --model '{spec}' is a {kind} model.")
    dtype = model_dtype(device)
    say(f"loading {spec} on {device} …")
    if family == "blip":
        # inside: --help and the UI import this module for its defaults, without torch
        from transformers import BlipForConditionalGeneration, BlipProcessor
        processor = load_pretrained(src, BlipProcessor.from_pretrained, "a BLIP processor")
        model = load_pretrained(src, BlipForConditionalGeneration.from_pretrained, "a BLIP captioner", dtype=dtype)
        captioner: Captioner = GenerativeCaptioner("blip", model, processor, device,
                                                   max_tokens or DEFAULT_MAX_TOKENS["blip"])
    elif family == "florence2":
        # inside: --help and the UI import this module for its defaults, without torch
        from transformers import AutoProcessor, Florence2ForConditionalGeneration
        processor = load_pretrained(src, AutoProcessor.from_pretrained, "a Florence-2 processor")
        model = load_pretrained(src, Florence2ForConditionalGeneration.from_pretrained, "a Florence-2 model",
                                dtype=dtype)
        captioner = GenerativeCaptioner("florence2", model, processor, device,
                                        max_tokens or DEFAULT_MAX_TOKENS["florence2"],
                                        FLORENCE_TASKS[task or "detailed"])
    else:
        # inside: --help and the UI import this module for its defaults, without torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification
        processor = load_pretrained(src, AutoImageProcessor.from_pretrained, "an image processor")
        model = load_pretrained(src, AutoModelForImageClassification.from_pretrained, "an image classifier",
                                dtype=dtype)
        captioner = TagCaptioner(model, processor, device, threshold, tag_limit)
    captioner.model.to(device).eval()  # type: ignore[attr-defined]
    return captioner
