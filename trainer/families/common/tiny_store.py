"""Write a built-in tiny model once, in both layouts people download: a diffusers pipeline folder and the
single file of its denoiser in the original layout (what ``builtin:<name>`` points at)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict

from safetensors.torch import save_file


def store_tiny(kind: str, root: str | os.PathLike, version: int, build: Callable[[Path], Any],
               original_layout: Callable[[Dict[str, Any]], Dict[str, Any]],
               denoiser: Callable[[Any], Any] = lambda pipe: pipe.transformer,
               extras: Callable[[Path], None] = lambda folder: None) -> Dict[str, Path]:
    """``build(tokenizer_folder) -> pipeline`` (run once, then reused while ``version`` matches);
    ``original_layout(denoiser(pipeline).state_dict()) -> single-file tensors``; ``extras(folder)`` writes
    files beside the pipeline's (an image encoder). Returns ``{"diffusers", "single_file"}``."""
    root = Path(root)
    folder, single = root / kind, root / f"{kind}.safetensors"
    stamp = folder / ".atelier-tiny"
    if stamp.exists() and stamp.read_text() == str(version) and single.exists():
        return {"diffusers": folder, "single_file": single}
    tmp = root / f".{kind}.building"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    pipe = build(tmp / ".tokenizers")
    pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(tmp / ".tokenizers")
    extras(tmp)
    state = {k: v.contiguous() for k, v in original_layout(denoiser(pipe).state_dict()).items()}
    save_file(state, str(root / f".{kind}.safetensors.tmp"))
    (tmp / ".atelier-tiny").write_text(str(version))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    os.replace(root / f".{kind}.safetensors.tmp", single)
    os.chmod(single, 0o644)
    return {"diffusers": folder, "single_file": single}
