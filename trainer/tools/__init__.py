"""Model tools: ``python -m trainer convert|merge|resize|sample …``.

Each tool loads models through the same code training uses (:func:`trainer.families.sources.load_model`),
writes through :mod:`trainer.io` (a temporary name in the output's folder, then a rename), never
replaces an existing output unless asked to (``--overwrite``), prints the path it wrote, and refuses bad
input with one :class:`ToolError` naming the file or argument and what to do (exit code 2).

This package imports nothing heavy at module level: the CLI's parser lives in :mod:`trainer.tools.cli`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

from trainer.config.preflight import model_path_problem

DTYPES = ("fp32", "fp16", "bf16")
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")


class ToolError(Exception):
    """Bad input to a tool: the message names the file or argument and says what to do."""


def split_weight(spec: str, what: str = "--lora") -> Tuple[str, float]:
    """``FILE[:WEIGHT]`` → (file, weight); 1.0 when no weight is given. A colon that is part of the path
    (``C:\\loras\\a.safetensors``) stays in it: only a trailing ``:<number>`` is a weight."""
    if Path(spec).expanduser().is_file():  # a file whose name has a colon in it
        return str(spec), 1.0
    head, sep, tail = str(spec).rpartition(":")
    if sep and head and "/" not in tail and "\\" not in tail:
        try:
            return head, float(tail)
        except ValueError:
            raise ToolError(f"{what} '{spec}': the weight after ':' must be a number, e.g. "
                            f"{head}:0.8") from None
    return str(spec), 1.0


def check_out(out: Path, overwrite: bool, *, folder: bool, inputs: Optional[List[Path]] = None,
              what: str = "--out") -> Path:
    """Refuse an output that exists (unless ``overwrite``), that is of the other kind (file vs folder),
    that is one of the ``inputs``, or whose parent is a file."""
    out = Path(out).expanduser()
    for src in inputs or []:
        try:
            same = out.resolve() == Path(src).expanduser().resolve()
        except OSError:
            same = False
        if same:
            raise ToolError(f"{what} {out} is the input itself; write the result to another path.")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ToolError(f"{what} {out} already exists; pass --overwrite to replace it, or choose another path.")
        if out.is_dir() != folder:
            kind = "a folder" if out.is_dir() else "a file"
            raise ToolError(f"{what} {out} is {kind}, but the output is {'a folder' if folder else 'a file'}; "
                            "remove it or choose another path.")
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ToolError(f"{what} {out} cannot be created: {probe} is a file, not a folder.")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ToolError(f"{what} {out}: the folder {probe} is not writable; choose another path.")
    return out


def model_problem(path: str) -> Optional[str]:
    """Why MODEL cannot be loaded, when it can be told without loading it (missing path, wrong file type)."""
    problem = model_path_problem(path)
    return problem.replace("model.path", "MODEL", 1) if problem else None
