"""The tools' command-line parsers and dispatch (torch-free to import)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainer.tools import DTYPES

COMMANDS = ("convert", "merge", "resize", "sample")


def add_parsers(sub: Any) -> None:
    """Add ``convert``, ``merge``, ``resize`` and ``sample`` to the trainer's subcommand parser."""
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
    s.add_argument("--steps", type=int, default=20, help="Denoising steps (default 20).")
    s.add_argument("--cfg", type=float, default=7.0, help="Classifier-free guidance scale (default 7).")
    s.add_argument("--seed", type=int, default=42, help="Seed of the first image; image i uses seed + i.")
    s.add_argument("--width", type=int, default=None, help="Width in pixels (default: the model's size).")
    s.add_argument("--height", type=int, default=None, help="Height in pixels (default: the model's size).")
    s.add_argument("--count", type=int, default=1, help="Images to draw (default 1).")
    s.add_argument("--sampler", choices=("ddim", "euler", "euler_a", "dpmpp_2m"), default=None,
                   help="Sampler (default: the config's sampling.scheduler, else the model's own).")
    s.add_argument("--device", default="auto", help="cuda, cpu, mps or auto (default).")
    common(s, "Folder for the images (default: <workspace>/samples/<date-time>).")
    workspace(s)


def run(args: argparse.Namespace) -> int:
    """Run one tool; bad input prints one line and returns 2."""
    from trainer.config import ConfigError
    from trainer.tools import ToolError
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    if args.command == "convert":
        from trainer.tools.convert import run as tool
    elif args.command == "merge":
        from trainer.tools.merge import run as tool
    elif args.command == "resize":
        from trainer.tools.resize import run as tool
    else:
        from trainer.tools.sample import run as tool
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
