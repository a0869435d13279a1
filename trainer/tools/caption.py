"""``caption``: write a caption file next to every image of a folder, with a captioning or tagging model.

Two kinds of captioner, told apart by the model's ``config.json``:

* natural language: BLIP (``model_type: blip``) and Florence-2 (``florence2``, the transformers-native
  checkpoints such as ``florence-community/Florence-2-base``; the original ``microsoft/Florence-2-*`` repos
  need remote code and are refused with a pointer to those);
* booru-style tags: an image classifier whose labels are tags (a WD-tagger exported to transformers:
  ViT/ConvNeXt/SwinV2 ``…ForImageClassification`` with ``id2label``). Every tag scoring above
  ``--threshold`` is kept, best first, underscores written as spaces (kaomoji such as ``^_^`` kept) as
  kohya's tagger writes them; the four WD rating labels (general/sensitive/questionable/explicit) are left out.

The images and caption files are those training reads (``trainer.data.concepts``: the same image
extensions, ``<image stem><caption extension>`` next to each image, masks and hidden files ignored).
An existing caption file is never replaced unless ``--overwrite``; an image that does not open the way
training would open it is named and skipped. Written files are replaced atomically (:mod:`trainer.io`).

This module also holds what ``mask`` shares with it: listing a folder's images, choosing the device and
loading a transformers model from a hub id or a local folder with one clear message when it cannot.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from trainer.data.captions import caption_ext
from trainer.data.concepts import IMAGE_EXTENSIONS, find_images
from trainer.data.images import open_rgb
from trainer.data.probe import probe_image
from trainer.errors import DataError
from trainer.io import atomic_write_bytes, write_failure
from trainer.tools import ToolError

DEFAULT_CAPTION_MODEL = "Salesforce/blip-image-captioning-base"
KNOWN_TAGGER = "SmilingWolf/wd-vit-tagger-v3"
DEFAULT_THRESHOLD = 0.35
LIST_LIMIT = 20  # written files printed one a line before the rest is summed up
FLORENCE_TASKS = {"caption": "<CAPTION>", "detailed": "<DETAILED_CAPTION>",
                  "more-detailed": "<MORE_DETAILED_CAPTION>"}
DEFAULT_MAX_TOKENS = {"blip": 40, "florence2": 256}
# The WD taggers' rating labels: a rating, not something in the picture.
RATING_TAGS = ("general", "sensitive", "questionable", "explicit")
# Tags whose underscores are part of the face they draw (kohya's list): written as they are.
KAOMOJIS = {"0_0", "(o)_(o)", "+_+", "+_-", "._.", "<o>_<o>", "<|>_<|>", "=_=", ">_<", "3_3", "6_9", ">_o", "@_@",
            "^_^", "o_o", "u_u", "x_x", "|_|", "||_||"}


# --------------------------------------------------------------------------------------------------
# shared with ``mask``: images, device, models
# --------------------------------------------------------------------------------------------------

def folder_images(folder: str, recursive: bool) -> Tuple[Path, List[Path]]:
    """The folder and its training images (the trainer's rules), or ToolError naming the folder."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise ToolError(f"FOLDER '{folder}' does not exist; give the folder that holds the images.")
    if not path.is_dir():
        raise ToolError(f"FOLDER '{folder}' is a file; give the folder that holds the images.")
    images = find_images(path, recursive)
    if not images:
        hint = " Its sub-folders do hold images: add --recursive." if not recursive and find_images(path, True) else ""
        raise ToolError(f"FOLDER '{folder}' has no images ({' '.join(IMAGE_EXTENSIONS)}).{hint}")
    return path, images


def unique_outputs(images: Sequence[Path], output: Callable[[Path], Path],
                   note: Callable[[str], None]) -> List[Tuple[Path, Path]]:
    """(image, output file) pairs; two images with one stem (``a.png``, ``a.jpg``) share one output file,
    as training reads it for both: the first one makes it, the other is named."""
    seen: Dict[Path, Path] = {}
    pairs: List[Tuple[Path, Path]] = []
    for image in images:
        out = output(image)
        if out in seen:
            note(f"note: '{image}' shares '{out.name}' with '{seen[out].name}' (same name); it is made once, "
                 "from the first.")
            continue
        seen[out] = image
        pairs.append((image, out))
    return pairs


def pick_device(name: str) -> str:
    """``auto`` → cuda, else mps, else cpu; ToolError for a device that is not there."""
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    mps = getattr(torch.backends, "mps", None)
    has_mps = mps is not None and mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ToolError("--device cuda, but PyTorch sees no CUDA GPU (a CPU-only build or a driver problem); "
                        "use --device cpu or auto.")
    if name == "mps" and not has_mps:
        raise ToolError("--device mps, but MPS is not available here; use --device cpu or auto.")
    return name


def model_dtype(device: str) -> Any:
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    return torch.float16 if device == "cuda" else torch.float32


@dataclass
class ModelSource:
    """Where ``--model`` points: a local folder, or a hub id (downloaded on first use, then cached)."""
    spec: str
    path: str
    local: bool

    def kwargs(self) -> Dict[str, Any]:
        return {"local_files_only": True} if self.local else {}


def model_source(spec: str) -> ModelSource:
    """``--model`` as a local folder or a hub id; ToolError for a path that is not a model folder."""
    spec = str(spec or "").strip()
    if not spec:
        raise ToolError("--model is empty; give a hub id or a local model folder.")
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ToolError(f"--model '{spec}' is a file; give the model's folder (saved with save_pretrained: "
                            "config.json, the weights and the processor's files).")
        if not (path / "config.json").is_file():
            raise ToolError(f"--model '{spec}' has no config.json; give a folder saved with save_pretrained "
                            "(config.json, the weights and the processor's files) or a hub id.")
        return ModelSource(spec, str(path), True)
    looks_local = spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1 or \
        (len(spec) > 1 and spec[1] == ":")
    if looks_local:
        raise ToolError(f"--model '{spec}': no such folder. Give a local model folder or a hub id (owner/name).")
    return ModelSource(spec, spec, False)


def _chain(exc: BaseException) -> List[BaseException]:
    out: List[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def load_problem(src: ModelSource, exc: BaseException, what: str = "") -> str:
    """One line for a model that did not load: offline, no such repo, gated, or the library's own words."""
    names = {type(e).__name__ for e in _chain(exc)}
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if not src.local:
        fetch = (f"On a machine that is online run `hf download {src.spec} --local-dir FOLDER`, copy FOLDER here "
                 "and pass --model FOLDER.")
        if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or "couldn't connect" in first.lower():
            return (f"--model '{src.spec}' is not downloaded yet and the hub cannot be reached (offline, or "
                    f"HF_HUB_OFFLINE is set). {fetch}")
        if "GatedRepoError" in names:
            return (f"--model '{src.spec}' is gated on the hub: accept its terms on its page and log in "
                    f"(`hf auth login`), or give a local folder. {fetch}")
        if names & {"RepositoryNotFoundError", "HFValidationError"}:
            return (f"--model '{src.spec}' is not a model on the hub (or it is private); check the id, or give a "
                    "local model folder.")
    as_what = f" as {what}" if what else ""
    return f"--model '{src.spec}' could not be loaded{as_what} ({type(exc).__name__}: {first})"


def config_dict(src: ModelSource) -> Dict[str, Any]:
    """The model's config.json as a dict (downloaded for a hub id), or ToolError saying why not."""
    # inside: --help and the UI import this module for its defaults, without torch
    from transformers import PretrainedConfig
    try:
        return dict(PretrainedConfig.get_config_dict(src.path, **src.kwargs())[0])
    except Exception as exc:  # offline, no such repo, broken JSON
        raise ToolError(load_problem(src, exc)) from None


def timm_or_onnx(src: ModelSource, cfg: Dict[str, Any]) -> bool:
    """A timm/ONNX model (the WD taggers as published): config.json with ``architecture`` and no ``model_type``."""
    if "model_type" in cfg:
        return False
    if "architecture" in cfg or "pretrained_cfg" in cfg:
        return True
    return src.local and any(Path(src.path).glob("*.onnx"))


def load_pretrained(src: ModelSource, loader: Callable[..., Any], what: str, **kwargs: Any) -> Any:
    """``loader(path, **kwargs)`` (a ``from_pretrained``) with the load problems as one ToolError line. A local
    folder loads without progress bars; a hub id keeps the download's."""
    if src.local:
        # inside: --help and the UI import this module for its defaults, without torch
        import transformers.utils.logging as tlog
        tlog.disable_progress_bar()
    try:
        return loader(src.path, **src.kwargs(), **kwargs)
    except ToolError:
        raise
    except Exception as exc:
        raise ToolError(load_problem(src, exc, what)) from None


def open_image(path: Path) -> Tuple[Optional[Any], Optional[str]]:
    """(RGB image the right way up, None) or (None, why it cannot be used): the trainer's checks and decoding."""
    _, problem = probe_image(path)
    if problem:
        return None, problem
    try:
        return open_rgb(path), None
    except DataError as exc:
        return None, str(exc)


def open_batch(batch: List[Tuple[Path, Path]], skipped: List[Tuple[Path, str]]) -> List[Tuple[Path, Path, Any]]:
    """(image, output, opened image) for each image that opens; the others are named and added to ``skipped``."""
    ready: List[Tuple[Path, Path, Any]] = []
    for image, out in batch:
        img, problem = open_image(image)
        if img is None:
            skipped.append((image, problem or "unreadable"))
            say(f"skipped '{image}': {problem}")
        else:
            ready.append((image, out, img))
    return ready


def say(text: str) -> None:
    """Progress and notes: on stderr, at once (stdout holds what was written)."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    """``<verb> K/N`` lines: after the first batch, then at most every 2 seconds, and at the end."""

    def __init__(self, verb: str, total: int):
        self.verb, self.total, self.done, self.last = verb, total, 0, 0.0

    def step(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= 2.0:
            self.last = now
            say(f"{self.verb} {self.done}/{self.total}")


class Written:
    """Prints ``wrote PATH`` for the first :data:`LIST_LIMIT` files, then counts."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, path: Path) -> None:
        self.count += 1
        if self.count <= LIST_LIMIT:
            print(f"wrote {path}", flush=True)

    def rest(self, what: str) -> None:
        if self.count > LIST_LIMIT:
            print(f"… and {self.count - LIST_LIMIT} more {what}", flush=True)


# --------------------------------------------------------------------------------------------------
# captioners
# --------------------------------------------------------------------------------------------------

def tag_text(label: str) -> str:
    """A tag as kohya's tagger writes it: underscores as spaces, except in kaomoji."""
    label = str(label).strip()
    return label if label in KAOMOJIS else label.replace("_", " ")


def pick_tags(scores: Sequence[float], labels: Dict[int, str], threshold: float, limit: int = 0,
              skip: Sequence[str] = ()) -> List[str]:
    """Tags scoring above ``threshold``, best first (ties: label order), at most ``limit`` (0: all)."""
    chosen = [(float(s), i) for i, s in enumerate(scores) if float(s) > threshold and labels.get(i) not in skip]
    chosen.sort(key=lambda t: (-t[0], t[1]))
    if limit > 0:
        chosen = chosen[:limit]
    return [tag_text(labels[i]) for _, i in chosen]


def compose(caption: str, prefix: str = "", suffix: str = "") -> str:
    """``prefix, caption, suffix`` on one line (training reads each line as its own caption), joined with ", ";
    a prefix that ends with punctuation (``,;:.-``) is joined with a space, a suffix that starts with
    punctuation (``,;:.``) as it is."""
    text = " ".join(str(caption).split())
    prefix, suffix = " ".join(str(prefix or "").split()), " ".join(str(suffix or "").split())
    if prefix:
        text = prefix + ("" if not text else " " if prefix[-1] in ",;:.-" else ", ") + text
    if suffix:
        text = text + ("" if not text or suffix[0] in ",;:." else ", ") + suffix
    return text.strip()


class Captioner:
    """One loaded model: ``kind`` (blip, florence2, tagger) and :meth:`caption` of a batch of RGB images."""

    kind = ""

    def caption(self, images: List[Any]) -> List[str]:  # pragma: no cover - overridden
        raise NotImplementedError


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

    def __init__(self, model: Any, processor: Any, device: str, threshold: float, limit: int):
        self.model, self.processor, self.device = model, processor, device
        self.threshold, self.limit = threshold, limit
        self.labels = {int(k): str(v) for k, v in model.config.id2label.items()}
        names = set(self.labels.values())
        self.skip = RATING_TAGS if all(r in names for r in RATING_TAGS) else ()

    @staticmethod
    def square(image: Any) -> Any:
        side = max(image.size)
        if image.size == (side, side):
            return image
        canvas = Image.new("RGB", (side, side), (255, 255, 255))
        canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return canvas

    def scores(self, images: List[Any]) -> Any:
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        inputs = self.processor(images=[self.square(im) for im in images], return_tensors="pt")
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


def load_captioner(spec: str, device: str, *, max_tokens: Optional[int], task: Optional[str],
                   threshold: float, tag_limit: int) -> Captioner:
    """The captioner ``--model`` names, chosen from its config; ToolError when it is of no kind handled."""
    src = model_source(spec)
    cfg = config_dict(src)
    kind = str(cfg.get("model_type") or "")
    auto_map = cfg.get("auto_map") or {}
    if timm_or_onnx(src, cfg):
        raise ToolError(f"--model '{spec}' is a timm/ONNX model (as {KNOWN_TAGGER} is published), which caption "
                        "does not run: it needs a transformers image-classification export of the tagger (a folder "
                        "or hub repo with a config.json that has model_type and id2label, saved with "
                        "save_pretrained).")
    if auto_map and (not kind or kind == "florence2"):
        raise ToolError(f"--model '{spec}' needs the repository's own code (trust_remote_code), which Atelier does "
                        "not run. For Florence-2 use a transformers-native checkpoint such as "
                        "florence-community/Florence-2-base.")
    if kind in ("blip", "florence2"):
        family = kind
    elif kind and _is_classifier(cfg):
        family = "tagger"
        labels = cfg.get("id2label") or {}
        if len(labels) < 3:
            raise ToolError(f"--model '{spec}' is an image classifier with {len(labels)} labels, not a tagger; give a "
                            "tagger whose id2label holds the tags.")
    else:
        raise ToolError(f"--model '{spec}' is a {kind or 'unknown'} model; caption runs BLIP and Florence-2 "
                        "(natural language) and image classifiers whose labels are tags (WD-tagger-like, "
                        "exported to transformers).")
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


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------

def caption_path(image: Path, extension: str) -> Path:
    """Where training reads the caption of ``image`` (``<stem><extension>`` next to it)."""
    return image.with_name(image.stem + caption_ext(extension))


def _check_args(args: Any) -> None:
    if args.batch < 1:
        raise ToolError(f"--batch {args.batch}: give at least 1.")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ToolError(f"--max-tokens {args.max_tokens}: give at least 1.")
    if not 0.0 <= args.threshold < 1.0:
        raise ToolError(f"--threshold {args.threshold:g}: give a score between 0 and 1, e.g. 0.35.")
    if args.tag_limit < 0:
        raise ToolError(f"--tag-limit {args.tag_limit}: give 0 (no limit) or more.")
    ext = str(args.extension or "").strip()
    if not ext or "/" in ext or "\\" in ext or ext.lower().lstrip(".") in ("png", "jpg", "jpeg", "webp", "bmp"):
        raise ToolError(f"--extension '{args.extension}': give a caption file extension such as .txt or .caption.")


def run(args: Any) -> int:
    _check_args(args)
    folder, images = folder_images(args.folder, args.recursive)
    pairs = unique_outputs(images, lambda im: caption_path(im, args.extension), say)
    todo = [(im, cap) for im, cap in pairs if args.overwrite or not (cap.exists() or cap.is_symlink())]
    kept = len(pairs) - len(todo)
    if not todo:
        print(f"all {len(pairs)} images in {folder} already have captions; nothing to do "
              "(--overwrite replaces them).")
        return 0
    if kept:
        say(f"{kept} of {len(pairs)} images already have captions and are left as they are "
            "(--overwrite replaces them).")
    device = pick_device(args.device)
    captioner = load_captioner(args.model, device, max_tokens=args.max_tokens, task=args.task,
                               threshold=args.threshold, tag_limit=args.tag_limit)

    progress, written = Progress("captioned", len(todo)), Written()
    skipped: List[Tuple[Path, str]] = []
    empty: List[Path] = []
    for start in range(0, len(todo), args.batch):
        batch = todo[start:start + args.batch]
        ready = open_batch(batch, skipped)
        texts = captioner.caption([r[2] for r in ready]) if ready else []
        for (image, cap, _), text in zip(ready, texts):
            line = compose(text, args.prefix, args.suffix)
            if not line:
                empty.append(image)
                say(f"no caption for '{image}': the model gave none"
                    + (f" (no tag scored above --threshold {args.threshold:g})" if captioner.kind == "tagger" else "")
                    + "; nothing written.")
                continue
            if not args.overwrite and (cap.exists() or cap.is_symlink()):  # written meanwhile by someone else
                continue
            try:
                atomic_write_bytes(cap, (line + "\n").encode("utf-8"))
            except OSError as exc:
                say(f"Error: {write_failure(exc, cap.parent, 'a caption')}")
                return 1
            written.add(cap)
        progress.step(len(batch))
    written.rest("caption files")
    parts = [f"captioned {written.count} of {len(pairs)} images in {folder}"]
    if kept:
        parts.append(f"{kept} already had captions")
    if skipped:
        parts.append(f"{len(skipped)} skipped (would not open: "
                     f"{', '.join(p.name for p, _ in skipped[:5])}{' …' if len(skipped) > 5 else ''})")
    if empty:
        parts.append(f"{len(empty)} without a caption from the model")
    say("; ".join(parts))
    if written.count == 0 and skipped and len(skipped) == len(todo):
        raise ToolError(f"none of the {len(todo)} images to caption in '{folder}' would open "
                        f"(e.g. {skipped[0][0].name}: {skipped[0][1]}).")
    return 0
