"""``caption``: write a caption file next to every image of a folder, with a captioning or tagging model.

The captioner is told apart by what ``--model`` holds:

* a WD tagger as SmilingWolf publishes it (``model.onnx`` + ``selected_tags.csv``, a folder or a hub id such as
  ``SmilingWolf/wd-eva02-large-tagger-v3``): booru tags as kohya's tagger writes them
  (:mod:`trainer.tools.captioners.wd`, :mod:`~trainer.tools.captioners.tags`);
* a vision-language model (Qwen2.5-VL, Qwen3-VL, JoyCaption's LLaVA): natural language in a chosen style, or
  the change between an edit pair's two images (:mod:`trainer.tools.captioners.vlm`);
* BLIP, Florence-2 and taggers exported to transformers image classification
  (:mod:`trainer.tools.captioners.classic`).

The images and caption files are those training reads (``trainer.data.concepts``: the same image extensions,
``<image stem><caption extension>`` next to each image, masks and hidden files ignored). An image that has a caption
file is skipped unless ``--overwrite`` (replace) or ``--append`` (tags merged into the file's, a sentence added as
one more line: training picks one line per step), so a stopped run resumes where it stopped when started again.
Each file is written whole or not at all (:mod:`trainer.io`: a temporary name, then a rename); an image that does
not open the way training would open it is named and skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Tuple

from trainer.data.captions import caption_ext
from trainer.data.concepts import pair_listing
from trainer.io import atomic_write_bytes, write_failure
from trainer.tools import ToolError
from trainer.tools.captioners.classic import KNOWN_TAGGER, classic_family, load_classic
from trainer.tools.captioners.shared import (
    Captioner,
    Progress,
    Written,
    config_dict,
    folder_images,
    model_source,
    open_image,
    pick_device,
    say,
    timm_or_onnx,
    unique_outputs,
)
from trainer.tools.captioners.tags import TagOptions, compose, merge_tags
from trainer.tools.captioners.vlm import STYLES, VLM_CLASSES, VLM_NAMES, load_vlm
from trainer.tools.captioners.wd import load_wd_tagger

def caption_path(image: Path, extension: str) -> Path:
    """Where training reads the caption of ``image`` (``<stem><extension>`` next to it)."""
    return image.with_name(image.stem + caption_ext(extension))


def tag_options(args: Any) -> TagOptions:
    """The WD tagger's options from the command's arguments."""
    replace = {}
    for spec in args.replace_tag or []:
        old, sep, new = str(spec).partition("=")
        if not sep or not old.strip():
            raise ToolError(f"--replace-tag '{spec}': write it as OLD=NEW, e.g. 1girl=one girl.")
        replace[old.strip()] = new.strip()
    exclude = tuple(t.strip() for t in str(args.exclude_tags or "").split(",") if t.strip())
    general = args.threshold
    return TagOptions(general_threshold=general, character_threshold=(
        args.character_threshold if args.character_threshold is not None else general), use_mcut=args.use_mcut,
        ratings=args.rating_tags, character_first=args.character_tags_first, keep_underscores=args.keep_underscores,
        escape_brackets=args.escape_brackets, exclude=exclude, replace=replace, limit=args.tag_limit)


def load_captioner(args: Any, images: int) -> Captioner:
    """The captioner ``--model`` names, chosen from what it holds, on ``--device``; ToolError when it is of no kind
    handled. A WD tagger runs without torch (onnxruntime picks its own device)."""
    spec = args.model
    src = model_source(spec)
    wd_folder = src.local and not (Path(src.path) / "config.json").is_file()  # model.onnx/selected_tags.csv
    cfg = {} if wd_folder else config_dict(src)
    kind = str(cfg.get("model_type") or "")
    if kind not in VLM_CLASSES:
        used = [f for f, v in (("--style", args.style), ("--prompt", args.prompt), ("--control", args.control),
                               ("--load-in-4bit", args.load_in_4bit), ("--load-in-8bit", args.load_in_8bit)) if v]
        if used:
            raise ToolError(f"{used[0]} applies to the vision-language models ({', '.join(VLM_CLASSES)}); --model "
                            f"'{spec}' is {'a WD tagger' if wd_folder or timm_or_onnx(src, cfg) else f'a {kind} model'}.")
    if wd_folder or timm_or_onnx(src, cfg):
        return load_wd_tagger(src, args.device, tag_options(args))
    device = pick_device(args.device)
    if kind in VLM_CLASSES:
        if args.task:
            raise ToolError(f"--task applies to Florence-2 models; --model '{spec}' is {VLM_NAMES[kind]}: use --style.")
        bits = 4 if args.load_in_4bit else 8 if args.load_in_8bit else 0
        return load_vlm(src, kind, device, style=args.style or "detailed", prompt=args.prompt or "",
                        max_new_tokens=args.max_tokens, bits=bits, images=images, yes=args.yes)
    if cfg.get("auto_map") and (not kind or kind == "florence2"):
        raise ToolError(f"--model '{spec}' needs the repository's own code (trust_remote_code), which Atelier does "
                        "not run. For Florence-2 use a transformers-native checkpoint such as "
                        "florence-community/Florence-2-base.")
    family = classic_family(cfg)
    if not family:
        raise ToolError(f"--model '{spec}' is a {kind or 'unknown'} model; caption runs BLIP and Florence-2 "
                        f"(natural language), the vision-language models {', '.join(VLM_CLASSES)} (model_type) and "
                        f"taggers: the WD taggers as published ({KNOWN_TAGGER}: model.onnx + selected_tags.csv) or "
                        "image classifiers exported to transformers.")
    return load_classic(src, cfg, family, device, max_tokens=args.max_tokens, task=args.task,
                        threshold=args.threshold, tag_limit=args.tag_limit)


def _check_args(args: Any) -> None:
    if args.batch < 1:
        raise ToolError(f"--batch {args.batch}: give at least 1.")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ToolError(f"--max-tokens {args.max_tokens}: give at least 1.")
    for flag, value in (("--threshold", args.threshold), ("--character-threshold", args.character_threshold)):
        if value is not None and not 0.0 <= value < 1.0:
            raise ToolError(f"{flag} {value:g}: give a score between 0 and 1, e.g. 0.35.")
    if args.tag_limit < 0:
        raise ToolError(f"--tag-limit {args.tag_limit}: give 0 (no limit) or more.")
    ext = str(args.extension or "").strip()
    if not ext or "/" in ext or "\\" in ext or ext.lower().lstrip(".") in ("png", "jpg", "jpeg", "webp", "bmp"):
        raise ToolError(f"--extension '{args.extension}': give a caption file extension such as .txt or .caption.")
    if args.style == "edit" and not args.control:
        raise ToolError("--style edit captions edit pairs: give --control FOLDER, the folder of the images before "
                        "the edit (paired with FOLDER's images by name, as a concept's control_paths).")
    if args.control and args.style != "edit":
        raise ToolError("--control gives the before images of edit pairs; it goes with --style edit.")
    if args.style and args.style not in STYLES:
        raise ToolError(f"--style {args.style}: choose one of {', '.join(STYLES)}.")


def edit_pairs(folder: Path, images: List[Path], control: str, recursive: bool) -> Tuple[List[Path], dict]:
    """The images of ``folder`` that have a before image in ``control`` (by name, as training pairs them) and the
    before image of each; ToolError when there is no pair at all."""
    ctrl = Path(control).expanduser()
    if not ctrl.is_dir():
        raise ToolError(f"--control '{control}' is not a folder; give the folder of the images before the edit.")
    listing = pair_listing(folder, images, [ctrl], recursive)
    paired = listing.pairs()
    if not paired:
        raise ToolError(f"no edit pairs: none of the {len(listing.targets)} images in '{folder}' has an image of the "
                        f"same name in '{ctrl}' (pairs match by name: cat_01.png ↔ {ctrl.name}/cat_01.jpg).")
    missing = listing.targets_without(0)
    if missing:
        say(f"note: {len(missing)} images have no before image in '{ctrl}' and are left out: "
            f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    return [t for t, _ in paired], {t: c[0] for t, c in paired}


def open_items(batch: List[Tuple[Path, Path]], before: dict, skipped: List[Tuple[Path, str]]) -> List[tuple]:
    """(image, caption file, what the captioner takes) for each image that opens (with its before image for edit
    pairs); each one that does not is named and added to ``skipped``."""
    ready = []
    for image, cap in batch:
        sources = ([before[image]] if image in before else []) + [image]
        opened = []
        for path in sources:
            img, problem = open_image(path)
            if img is None:
                skipped.append((path, problem or "unreadable"))
                say(f"skipped '{path}': {problem}")
                break
            opened.append(img)
        else:
            ready.append((image, cap, tuple(opened) if before else opened[0]))
    return ready


def new_text(cap: Path, line: str, captioner: Captioner, append: bool) -> str:
    """What the caption file will hold: the line, or with ``append`` the file's text and the line (tags merged)."""
    if not append or not cap.is_file():
        return line + "\n"
    old = cap.read_text(encoding="utf-8", errors="replace").strip("\n")
    if not old.strip():
        return line + "\n"
    if captioner.tags:
        return merge_tags(old, [t.strip() for t in line.split(",") if t.strip()]) + "\n"
    return old + "\n" + line + "\n"


def run(args: Any) -> int:
    _check_args(args)
    folder, images = folder_images(args.folder, args.recursive)
    before: dict = {}
    if args.control:
        images, before = edit_pairs(folder, images, args.control, args.recursive)
    pairs = unique_outputs(images, lambda im: caption_path(im, args.extension), say)
    keep_existing = not (args.overwrite or args.append)
    todo = [(im, cap) for im, cap in pairs if not keep_existing or not (cap.exists() or cap.is_symlink())]
    kept = len(pairs) - len(todo)
    if not todo:
        print(f"all {len(pairs)} images in {folder} already have captions; nothing to do "
              "(--overwrite replaces them, --append adds to them).")
        return 0
    if kept:
        say(f"{kept} of {len(pairs)} images already have captions and are left as they are "
            "(--overwrite replaces them, --append adds to them).")
    captioner = load_captioner(args, len(todo))

    progress, written = Progress("captioned", len(todo)), Written()
    skipped: List[Tuple[Path, str]] = []
    empty: List[Path] = []
    for start in range(0, len(todo), args.batch):
        batch = todo[start:start + args.batch]
        ready = open_items(batch, before, skipped)
        texts = captioner.caption([r[2] for r in ready]) if ready else []
        for (image, cap, _), text in zip(ready, texts):
            line = compose(text, args.prefix, args.suffix)
            if not line:
                empty.append(image)
                say(f"no caption for '{image}': the model gave none"
                    + (f" (no tag scored above --threshold {args.threshold:g})" if captioner.tags else "")
                    + "; nothing written.")
                continue
            if keep_existing and (cap.exists() or cap.is_symlink()):  # written meanwhile by someone else
                continue
            try:
                atomic_write_bytes(cap, new_text(cap, line, captioner, args.append).encode("utf-8"))
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
