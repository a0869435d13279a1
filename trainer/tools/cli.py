"""The tools' command-line parsers and dispatch (torch-free to import)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainer.errors import ConfigError
from trainer.tools import DTYPES, ToolError
from trainer.tools.caption import run as run_caption
from trainer.tools.captioners.classic import DEFAULT_CAPTION_MODEL, FLORENCE_TASKS, KNOWN_TAGGER
from trainer.tools.captioners.tags import DEFAULT_THRESHOLD
from trainer.tools.captioners.vlm import STYLES, VLM_CLASSES
from trainer.tools.mask import (
    DEFAULT_MASK_MODEL,
    DEFAULT_MASK_THRESHOLD,
    DEFAULT_SUBJECT_MODEL,
    METHODS,
    run as run_mask,
)

COMMANDS = ("convert", "merge", "resize", "sample", "caption", "mask")


def add_parsers(sub: Any) -> None:
    """Add ``convert``, ``merge``, ``resize``, ``sample``, ``caption`` and ``mask`` to the trainer's subcommand
    parser."""
    def common(sp, out_help: str):
        sp.add_argument("--out", help=out_help)
        sp.add_argument("--overwrite", action="store_true", help="Replace --out when it exists.")

    def workspace(sp):
        sp.add_argument("--workspace", default=None,
                        help="Workspace whose models/ holds the builtin: models (default: workspace).")
        sp.add_argument("--config-path", default=None, metavar="FOLDER",
                        help="For a single-file model that is not the standard size: a diffusers folder whose "
                             "configs describe it (as model.config_path).")

    c = sub.add_parser("convert", help="Convert a model: diffusers folder <-> one original-layout .safetensors.")
    c.add_argument("model", help="A diffusers folder, a .safetensors/.ckpt file, a hub id or builtin:tiny-sd.")
    c.add_argument("--to", required=True, choices=("single-file", "diffusers"), help="The output format.")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="Weights' dtype (default: the model's own).")
    common(c, "Output file (.safetensors/.ckpt) or folder (default: next to the model).")
    workspace(c)

    m = sub.add_parser("merge", help="Merge kohya LoRA files into a model's weights.")
    m.add_argument("base", help="The model the LoRAs were trained on (folder, file, hub id, builtin:).")
    m.add_argument("loras", nargs="*", metavar="LORA[:WEIGHT]", help="LoRA files, each with an optional weight "
                   "(default 1): W' = W + weight * alpha/rank * up @ down.")
    m.add_argument("--format", choices=("single-file", "diffusers"), default=None,
                   help="Output format (default: from --out; a .safetensors/.ckpt name is a single file).")
    m.add_argument("--dtype", choices=DTYPES, default=None, help="Weights' dtype (default: the base model's own).")
    m.add_argument("--out", required=True, help="Output file or folder.")
    m.add_argument("--overwrite", action="store_true", help="Replace --out when it exists.")
    workspace(m)

    r = sub.add_parser("resize", help="Lower a kohya LoRA's rank (SVD; keeps the best approximation).")
    r.add_argument("lora", help="The LoRA .safetensors file.")
    r.add_argument("--rank", type=int, required=True, help="The new rank (1 .. the LoRA's rank).")
    common(r, "Output file (default: <lora>-r<RANK>.safetensors next to it).")

    s = sub.add_parser("sample", help="Draw images from a model (with LoRAs), or a run config's sample prompts.")
    s.add_argument("model", nargs="?",
                   help="A diffusers folder, a .safetensors/.ckpt file, a hub id or builtin:tiny-sd.")
    s.add_argument("--config", help="Take the model and sampling.prompts of this run config instead.")
    s.add_argument("--lora", action="append", default=[], metavar="FILE[:WEIGHT]",
                   help="Apply a kohya LoRA at a weight (default 1); repeatable.")
    s.add_argument("--prompt", help="The prompt (with --config: replaces its sampling.prompts).")
    s.add_argument("--negative", default="", help="Negative prompt.")
    s.add_argument("--image", default="", help="Image-to-video models (Wan I2V): the start image of the video.")
    s.add_argument("--steps", type=int, default=None, help="Denoising steps (default: the model's own, e.g. 20 for SD, "
                   "28 for Flux.1 [dev]).")
    s.add_argument("--cfg", type=float, default=None, help="Guidance scale (default: the model's own, e.g. 7 for SD, "
                   "3.5 for Flux.1 [dev]).")
    s.add_argument("--seed", type=int, default=42, help="Seed of the first image; image i uses seed + i.")
    s.add_argument("--width", type=int, default=None, help="Width in pixels (default: the model's size).")
    s.add_argument("--height", type=int, default=None, help="Height in pixels (default: the model's size).")
    s.add_argument("--count", type=int, default=1, help="Images to draw (default 1).")
    s.add_argument("--sampler", choices=("ddim", "euler", "euler_a", "dpmpp_2m"), default=None,
                   help="Sampler of SD, SDXL and PixArt (default: the config's sampling.scheduler, else the "
                        "model's own default).")
    s.add_argument("--device", default="auto", help="cuda, cpu, mps or auto (default).")
    common(s, "Folder for the images (default: <workspace>/samples/<date-time>).")
    workspace(s)
    add_dataset_parsers(sub)


def add_dataset_parsers(sub: Any) -> None:
    """``caption`` and ``mask``: files next to a dataset's images, written by a model."""

    def images(sp, what: str):
        sp.add_argument("folder", help=f"The folder of images; {what} next to each image.")
        sp.add_argument("--recursive", action="store_true", help="Also the images in its sub-folders.")

    def run_on(sp):
        sp.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="Where the model runs (default auto: a CUDA GPU when there is one).")
        sp.add_argument("--batch", type=int, default=4, metavar="N", help="Images per model call (default 4).")

    c = sub.add_parser("caption", help="Write <image>.txt captions with a tagger, a vision-language model or a "
                                       "captioning model.",
                       description="Write a caption file next to every image (the names training reads), with a WD "
                                   "tagger (booru tags, ONNX), a vision-language model (Qwen2.5-VL, Qwen3-VL, "
                                   "JoyCaption) or BLIP/Florence-2. Images that have a caption are skipped unless "
                                   "--overwrite or --append, so running it again resumes a stopped run.")
    images(c, "writes <image name>.txt")
    c.add_argument("--model", default=DEFAULT_CAPTION_MODEL,
                   help=f"Hub id (downloaded on first use, then cached) or a local folder (default "
                        f"{DEFAULT_CAPTION_MODEL}). WD taggers as published: {KNOWN_TAGGER}, "
                        "SmilingWolf/wd-eva02-large-tagger-v3 … or a folder with model.onnx + selected_tags.csv. "
                        f"Vision-language models ({', '.join(VLM_CLASSES)}): Qwen/Qwen2.5-VL-7B-Instruct, "
                        "Qwen/Qwen3-VL-8B-Instruct, fancyfeast/llama-joycaption-beta-one-hf-llava. Also BLIP, "
                        "Florence-2 (florence-community/Florence-2-base) and taggers exported to transformers image "
                        "classification. Offline: give a folder.")
    c.add_argument("--prefix", default="", help="Text before every caption, e.g. the trigger word "
                   "(joined with ', ').")
    c.add_argument("--suffix", default="", help="Text after every caption (joined with ', ').")
    keep = c.add_mutually_exclusive_group()
    keep.add_argument("--overwrite", action="store_true", help="Replace existing caption files.")
    keep.add_argument("--append", action="store_true",
                      help="Add to existing caption files: tags merged into theirs (the new ones after), a "
                           "sentence as one more line (training picks one line per step).")
    keep.add_argument("--only-missing", dest="overwrite", action="store_false",
                      help="Caption only the images without a caption file (the default; a stopped run resumes).")
    c.add_argument("--extension", default=".txt",
                   help="Caption file extension, as the concept's caption_extension (default .txt).")
    c.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=None, metavar="N",
                   help="Longest caption in tokens (default 40 for BLIP, 256 for Florence-2; vision-language models: "
                        "64 short, 320 detailed, 160 booru, 96 edit).")
    c.add_argument("--task", choices=tuple(FLORENCE_TASKS), default=None,
                   help="Florence-2 only: how long a description (default detailed).")
    tags = c.add_argument_group("taggers")
    tags.add_argument("--threshold", "--general-threshold", dest="threshold", type=float, default=DEFAULT_THRESHOLD,
                      help=f"Keep the (general) tags scoring at least this (default {DEFAULT_THRESHOLD}).")
    tags.add_argument("--character-threshold", type=float, default=None,
                      help="WD taggers: the same for character tags (default: --threshold).")
    tags.add_argument("--use-mcut", action="store_true",
                      help="WD taggers: thresholds from each image's scores (MCut: the widest gap; characters at "
                           "least 0.15) instead of the fixed ones.")
    tags.add_argument("--rating-tags", action="store_true",
                      help="WD taggers: the best rating tag (general, sensitive, questionable, explicit) first.")
    tags.add_argument("--character-tags-first", action="store_true",
                      help="WD taggers: character tags before the general ones (default: after, as listed).")
    tags.add_argument("--keep-underscores", action="store_true",
                      help="WD taggers: write long_hair, not long hair (kaomoji such as ^_^ always keep theirs).")
    tags.add_argument("--escape-brackets", action="store_true",
                      help="WD taggers: write \\( \\) for brackets, as prompt syntax reads them as plain text.")
    tags.add_argument("--exclude-tags", default="", metavar="TAGS",
                      help="WD taggers: tags never written, separated by commas (e.g. 'solo, simple background').")
    tags.add_argument("--replace-tag", action="append", default=[], metavar="OLD=NEW",
                      help="WD taggers: write NEW for OLD (as listed or as written); repeatable.")
    tags.add_argument("--tag-limit", type=int, default=0, metavar="N",
                      help="At most N tags, the best scoring (default 0: no limit).")
    vlm = c.add_argument_group("vision-language models")
    vlm.add_argument("--style", choices=tuple(STYLES), default=None,
                     help="What to write (default detailed): short (one sentence), detailed (a paragraph), booru "
                          "(tags), edit (the change from the --control image to the image).")
    vlm.add_argument("--prompt", default="", help="Your own instruction instead of the style's.")
    vlm.add_argument("--control", default=None, metavar="FOLDER",
                     help="With --style edit: the folder of the images before the edit, paired by name.")
    bits = vlm.add_mutually_exclusive_group()
    bits.add_argument("--load-in-4bit", action="store_true", help="4-bit weights (bitsandbytes NF4; CUDA only).")
    bits.add_argument("--load-in-8bit", action="store_true", help="8-bit weights (bitsandbytes; CUDA only).")
    vlm.add_argument("--yes", action="store_true",
                     help="Start a large model on the CPU after its time estimate, without asking.")
    run_on(c)

    m = sub.add_parser("mask", help="Write <image>-masklabel.png training masks from a text prompt (CLIPSeg) or "
                                    "around the subject (SAM, background removal).",
                       description="Write a mask next to every image (<image name>-masklabel.png, what data.masks "
                                   "reads): white where --prompt is (clipseg) or on the thing at the image's centre "
                                   "(subject), trained; black elsewhere. Existing masks are kept unless --overwrite.")
    images(m, "writes <image name>-masklabel.png")
    m.add_argument("--method", choices=METHODS, default="clipseg",
                   help="clipseg: what --prompt names (CLIPSeg); subject: background removal, the thing at the "
                        "centre of each image, whole (Segment Anything), no --prompt.")
    m.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="What to cover, e.g. 'a person'; repeat it to cover several things.")
    m.add_argument("--model", default="",
                   help=f"Hub id or local folder (default {DEFAULT_MASK_MODEL} for clipseg, {DEFAULT_SUBJECT_MODEL} "
                        "for subject). Offline: give a folder.")
    m.add_argument("--threshold", type=float, default=DEFAULT_MASK_THRESHOLD,
                   help=f"Probability above which a pixel is white (default {DEFAULT_MASK_THRESHOLD}).")
    m.add_argument("--invert", action="store_true", help="White everywhere except the prompt's thing.")
    m.add_argument("--expand", type=int, default=0, metavar="PIXELS",
                   help="Grow the white area by PIXELS in every direction (negative: shrink; default 0).")
    m.add_argument("--overwrite", action="store_true", help="Replace existing masks.")
    run_on(m)


def run(args: argparse.Namespace) -> int:
    """Run one tool; bad input prints one line and returns 2."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    if args.command == "caption":
        tool = run_caption
    elif args.command == "mask":
        tool = run_mask
    # the model tools import torch at the top: imported when they run, so --help and the other commands stay torch-free
    elif args.command == "convert":
        from trainer.tools.convert import run as tool  # torch
    elif args.command == "merge":
        from trainer.tools.merge import run as tool  # torch
    elif args.command == "resize":
        from trainer.tools.resize import run as tool  # torch
    else:
        from trainer.tools.sample import run as tool  # torch
    try:
        return tool(args)
    except ToolError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"Config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, no permission: nothing was replaced (writes are atomic)
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"Error: writing{where} failed: {exc.strerror or exc}. Free some space or choose another --out.",
              file=sys.stderr)
        return 1
