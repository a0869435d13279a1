"""``convert``: a diffusers folder ↔ one original-layout checkpoint (SD 1.x/2.x, SDXL).

Loading is the trainer's (diffusers' ``from_pretrained`` / ``from_single_file`` with the shipped configs);
writing is the fine-tune writers' (the family's ``save_single_file``: for SD,
:func:`trainer.families.common.sd_kit.keys.save_single_file_sd`; :func:`trainer.formats.checkpoint.save_diffusers_folder`),
so a converted file is what a fine-tune of the same model would have been saved as."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from trainer.formats.checkpoint import save_diffusers_folder
from trainer.tools import CHECKPOINT_SUFFIXES, ToolError, check_out
from trainer.tools.common import load_family, source_dtype

FORMATS = ("single-file", "diffusers")


def default_out(model_path: str, fmt: str) -> Path:
    """Next to a local model, in the current folder for a hub id or ``builtin:`` name."""
    p = Path(model_path).expanduser()
    if model_path.startswith("builtin:") or not p.exists():
        p = Path(model_path.split(":", 1)[-1].replace("/", "--"))
    if p.suffix.lower() in CHECKPOINT_SUFFIXES:
        p = p.with_suffix("")
    return p.with_name(p.name + (".safetensors" if fmt == "single-file" else "-diffusers"))


def format_of(out: Path, fmt: Optional[str]) -> str:
    """The output format: ``fmt`` when given (checked against the path), else from the path's suffix."""
    single = out.suffix.lower() in CHECKPOINT_SUFFIXES
    if fmt is None:
        return "single-file" if single else "diffusers"
    if fmt == "single-file" and not single:
        raise ToolError(f"--out {out}: a single file needs a .safetensors (or .ckpt) name.")
    if fmt == "diffusers" and single:
        raise ToolError(f"--out {out}: a diffusers model is a folder; give a folder name without .safetensors/.ckpt.")
    return fmt


def save_model(model: Any, out: Path, fmt: str, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a loaded SD/SDXL family object as a single file or a diffusers folder (atomically)."""
    if fmt == "single-file":
        model.save_single_file(out, dtype=dtype, metadata=metadata)
    else:  # a diffusers folder carries the model's own sampler (DDIM for SD, Euler for SDXL), as fine-tunes do
        save_diffusers_folder(out, model.pipeline(getattr(model, "folder_sampler", None)), dtype)


def run(args: Any) -> int:
    out = Path(args.out).expanduser() if args.out else default_out(args.model, args.to)
    fmt = format_of(out, args.to)
    inputs = [Path(args.model)] if Path(args.model).expanduser().exists() else []
    check_out(out, args.overwrite, folder=fmt == "diffusers", inputs=inputs)
    model = load_family(args.model, args.workspace, config_path=args.config_path)
    dtype = args.dtype or source_dtype(model)
    meta = {"modelspec.title": out.stem, "atelier_converted_from": Path(str(args.model)).name}
    save_model(model, out, fmt, dtype, meta)
    print(f"wrote {out} ({fmt}, {dtype})")
    return 0
