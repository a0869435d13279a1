"""Natural-language captions from vision-language models, through transformers' own classes (no repository code):
Qwen2.5-VL (``qwen2_5_vl``), Qwen3-VL (``qwen3_vl``) and JoyCaption (its LLaVA checkpoint, ``llava``).

A style picks the instruction (``--style``: short, detailed, booru-like tags, or for edit pairs "describe the
change from the first image to the second", the before image from ``--control``); ``--prompt`` replaces it. The
instruction and the image(s) go through the checkpoint's own chat template and processor; decoding is greedy, so a
model captions an image the same way every time. ``--load-in-4bit``/``--load-in-8bit`` load the weights with
bitsandbytes (CUDA only) for small cards. On the CPU a model of a billion parameters or more is not started before
the user has seen how long it would take (``--yes``).

Torch-free to import: torch and transformers are imported inside the functions that load and run a model.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Optional, Sequence

from PIL import Image

from trainer.tools import ToolError
from trainer.tools.captioners.shared import Captioner, ModelSource, format_duration, load_pretrained, say

# model_type → the transformers class that runs it
VLM_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
               "llava": "LlavaForConditionalGeneration"}
DEFAULT_VLM = "Qwen/Qwen2.5-VL-7B-Instruct"
VLM_NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "llava": "JoyCaption (LLaVA)"}
STYLES = {
    "short": "Write a short caption for this image: one sentence naming the subject, what it does and the setting.",
    "detailed": "Write a detailed description of this image in one paragraph: the subject and its appearance, pose "
                "and expression, the setting, the lighting, the colours, the composition and the medium or style. "
                "Describe only what is visible. Do not start with 'The image'.",
    "booru": "Write Danbooru-style tags for this image: lowercase tags separated by commas, the most important "
             "first, with no other text.",
    "edit": "The first image is the original and the second is the edited version. Describe the change from the "
            "first image to the second as one short editing instruction, as someone asking for that edit would "
            "write it. Mention only what changed.",
}
DEFAULT_NEW_TOKENS = {"short": 64, "detailed": 320, "booru": 160, "edit": 96}
JOYCAPTION_SYSTEM = "You are a helpful image captioner."
MAX_PIXELS = 1024 * 1024  # images are shrunk to this area first: a caption needs no more, and tokens cost time
# the CPU: a model this large waits for --yes after the estimate
CPU_CONFIRM_PARAMS = 1_000_000_000
CPU_FLOPS = 1e11            # fp32 matrix throughput a desktop CPU reaches in practice
CPU_BYTES_PER_S = 2e10      # memory bandwidth: each new token reads every weight once
PROMPT_TOKENS = 1000        # an image of MAX_PIXELS and the instruction, in tokens


def cpu_seconds_per_image(params: int, new_tokens: int) -> float:
    """A rough time per image on the CPU in fp32: the prompt's matrix work, then one pass over the weights per
    new token (memory-bound)."""
    return 2 * params * PROMPT_TOKENS / CPU_FLOPS + new_tokens * params * 4 / CPU_BYTES_PER_S


def shrink(image: Image.Image, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The image at most ``max_pixels`` in area, its shape kept."""
    area = image.width * image.height
    if area <= max_pixels:
        return image
    scale = (max_pixels / area) ** 0.5
    return image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))),
                        Image.Resampling.LANCZOS)


class VlmCaptioner(Captioner):
    """A chat VLM: (image or (before, after) pair) + instruction → text, greedy."""

    kind = "vlm"

    def __init__(self, model_type: str, model: Any, processor: Any, device: str, instruction: str,
                 max_new_tokens: int, pairs: bool):
        self.model_type, self.model, self.processor, self.device = model_type, model, processor, device
        self.instruction, self.max_new_tokens, self.pairs = instruction, max_new_tokens, pairs

    def messages(self, n_images: int, as_text: str = "") -> List[Dict[str, Any]]:
        """The chat: image parts then the instruction (``as_text``: the user turn as one string instead)."""
        content: Any = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": self.instruction}]
        turns: List[Dict[str, Any]] = []
        if self.model_type == "llava":  # JoyCaption is trained with this system turn
            turns.append({"role": "system", "content": JOYCAPTION_SYSTEM})
        return turns + [{"role": "user", "content": as_text or content}]

    def prompt(self, n_images: int) -> str:
        """The prompt through the checkpoint's chat template, with one image token per image: templates that take
        image parts (Qwen's) get them; one that takes the user turn as a string (JoyCaption's Llama template) gets
        the instruction, after the image tokens when the template does not place them itself."""
        render = self.processor.apply_chat_template
        token = getattr(self.processor, "image_token", None)
        try:
            text = render(self.messages(n_images), tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that reads the turn as a string
            text = None
        if text is not None and (not token or text.count(token) == n_images):
            return text
        text = render(self.messages(n_images, self.instruction), tokenize=False, add_generation_prompt=True)
        if token and text.count(token) < n_images:
            text = render(self.messages(n_images, token * n_images + "\n" + self.instruction), tokenize=False,
                          add_generation_prompt=True)
        return text

    def caption(self, images: List[Any]) -> List[str]:
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        groups: List[Sequence[Any]] = [tuple(im) if self.pairs else (im,) for im in images]
        prompt = self.prompt(len(groups[0]))
        flat = [shrink(im) for group in groups for im in group]
        inputs = self.processor(text=[prompt] * len(groups), images=flat, padding=True, return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        inputs = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items() if hasattr(v, "to")}
        tok = getattr(self.processor, "tokenizer", self.processor)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.inference_mode():
            ids = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=pad)
        new = ids[:, inputs["input_ids"].shape[1]:]
        return [" ".join(t.split()) for t in self.processor.batch_decode(new, skip_special_tokens=True)]


PROCESSOR_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def image_only_processor_class(model_type: str) -> Any:
    """The Qwen processor class without its video processor. Captions never pass videos, and the only video
    processor (``Qwen2VLVideoProcessor``) imports torchvision, which this install does not have: the class keeps
    the image processor (its PIL backend when torchvision is missing) and the tokenizer, and saves and loads under
    the original class name (``processor_config.json`` stays as the checkpoints have it)."""
    # inside: --help and the UI import this module for its defaults, without torch
    import transformers
    from transformers.processing_utils import ProcessorMixin
    base = getattr(transformers, PROCESSOR_CLASSES[model_type])

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        for name, default in (("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
                              ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>")):
            token = getattr(tokenizer, f"{name}_token", None) or default
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id", None)
                    or tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


def load_processor(src: ModelSource, model_type: str, name: str) -> Any:
    """The checkpoint's processor (chat template, image processor, tokenizer); the Qwen ones without their video
    processor when that cannot be built (no torchvision)."""
    # inside: --help and the UI import this module for its defaults, without torch
    from transformers import AutoProcessor
    if model_type not in PROCESSOR_CLASSES:
        return load_pretrained(src, AutoProcessor.from_pretrained, f"a {name} processor")
    try:
        return AutoProcessor.from_pretrained(src.path, **src.kwargs())
    except Exception:  # no torchvision for the video processor, or a processor_config naming it: images only
        return load_pretrained(src, image_only_processor_class(model_type).from_pretrained, f"a {name} processor")


def model_class(model_type: str) -> Any:
    # inside: --help and the UI import this module for its defaults, without torch
    import transformers
    cls = getattr(transformers, VLM_CLASSES[model_type], None)
    if cls is None:
        raise ToolError(f"this transformers ({transformers.__version__}) has no {VLM_CLASSES[model_type]}; "
                        "update transformers to run this model.")
    return cls


def parameter_count(src: ModelSource, model_type: str) -> int:
    """The model's parameters, counted on a weightless (meta) copy built from its config."""
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    from transformers import AutoConfig  # inside: as torch
    config = load_pretrained(src, AutoConfig.from_pretrained, "a model config")
    with torch.device("meta"):
        model = model_class(model_type)._from_config(config)
    return sum(p.numel() for p in model.parameters())


def quantization(bits: int, device: str) -> Any:
    """bitsandbytes' config for 4-bit (NF4) or 8-bit weights; ToolError off CUDA or without bitsandbytes."""
    flag = f"--load-in-{bits}bit"
    if device != "cuda":
        raise ToolError(f"{flag} needs a CUDA GPU (bitsandbytes' kernels); this run is on the {device}. Drop {flag}, "
                        "or run on a machine with an NVIDIA GPU.")
    if importlib.util.find_spec("bitsandbytes") is None:  # transformers imports it when it loads the weights
        raise ToolError(f"{flag} needs the bitsandbytes package: pip install bitsandbytes")
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    from transformers import BitsAndBytesConfig  # inside: as torch
    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


def load_vlm(src: ModelSource, model_type: str, device: str, *, style: str, prompt: str,
             max_new_tokens: Optional[int], bits: int, images: int, yes: bool) -> VlmCaptioner:
    """The VLM ``--model`` names, on ``device``; on the CPU a large one only with ``yes`` (after the estimate)."""
    name = VLM_NAMES[model_type]
    if style == "edit" and model_type == "llava":
        raise ToolError(f"--style edit needs a model that reads two images in one prompt (Qwen2.5-VL, Qwen3-VL); "
                        f"{name} reads one.")
    new_tokens = max_new_tokens or DEFAULT_NEW_TOKENS[style]
    quant = quantization(bits, device) if bits else None
    if device == "cpu":
        params = parameter_count(src, model_type)
        if params >= CPU_CONFIRM_PARAMS:
            each = cpu_seconds_per_image(params, new_tokens)
            line = (f"{src.spec} has {params / 1e9:.1f}B parameters: on the CPU that is about {format_duration(each)} "
                    f"per image, {format_duration(each * images)} for the {images} images")
            if not yes:
                raise ToolError(f"{line}. Pass --yes to start anyway, or caption on a CUDA GPU (--load-in-4bit fits "
                                "a 7B model on an 8 GB card).")
            say(f"{line}; starting (--yes).")
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    dtype = torch.float32 if device != "cuda" else (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    say(f"loading {src.spec} ({name}) on {device}{f' in {bits}-bit' if bits else ''} …")
    processor = load_processor(src, model_type, name)
    if not (getattr(processor, "chat_template", None) or getattr(getattr(processor, "tokenizer", None),
                                                                    "chat_template", None)):
        raise ToolError(f"--model '{src.spec}' has no chat template (chat_template.json or the tokenizer's); caption "
                        "needs it to put the images and the instruction together the way the model was trained.")
    tok = getattr(processor, "tokenizer", None)
    if tok is not None:
        tok.padding_side = "left"  # generation continues each prompt from its last token
    kwargs: Dict[str, Any] = {"dtype": dtype}
    if quant is not None:
        kwargs.update(quantization_config=quant, device_map={"": 0})
    model = load_pretrained(src, model_class(model_type).from_pretrained, f"a {name} model", **kwargs)
    if quant is None:
        model.to(device)
    model.eval()
    captioner = VlmCaptioner(model_type, model, processor, device, prompt.strip() or STYLES[style], new_tokens,
                             pairs=style == "edit")
    captioner.tags = style == "booru"  # --append merges tags into a file's tags
    return captioner
