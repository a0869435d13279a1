"""Whole-model files: a state dict cast to a dtype, a ``.safetensors``/``.ckpt`` checkpoint, a diffusers folder.

The families' single-file writers (the SD kit's original-layout maps, the transformer families' key maps) build
the state dict; this module casts and writes it. Every write goes through :mod:`trainer.io` (temp file, then
rename), so an interrupted save never replaces a good file with a broken one.

torch and safetensors are imported inside the functions that use them, as in the other ``trainer.formats``
modules: the writers' callers (methods, families, tools) import these modules at their top.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from trainer.io import atomic_dir, atomic_path, save_safetensors_atomic

DTYPES = ("fp32", "fp16", "bf16")


def dtype_from_name(name: str) -> "torch.dtype":
    """The torch dtype of an ``output.dtype`` name (fp32, fp16, bf16)."""

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {DTYPES}")
    return table[name]


def cast_state_dict(tensors: Mapping[str, "torch.Tensor"], dtype: str) -> dict[str, "torch.Tensor"]:
    """Detached CPU copies, floating tensors cast to ``dtype`` (integer buffers left alone)."""
    target = dtype_from_name(dtype)
    out = {}
    for key, value in tensors.items():
        value = value.detach().to("cpu")
        out[key] = value.to(target) if value.is_floating_point() else value
    return out


def write_checkpoint(path: Path, state_dict: dict[str, "torch.Tensor"],
                     metadata: Mapping[str, Any] | None) -> None:
    """``.safetensors`` (with metadata) or ``.ckpt``/``.pt`` (``{"state_dict": ...}``), atomically."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        save_safetensors_atomic(state_dict, path, metadata)
    elif suffix in (".ckpt", ".pt", ".pth"):
        with atomic_path(path) as tmp:
            torch.save({"state_dict": {k: v.contiguous() for k, v in state_dict.items()}}, tmp)
    else:
        raise ValueError(f"cannot tell the file format from {path.name!r}: use .safetensors or .ckpt")


def reject_adapter_layers(name: str, state_dict: Mapping[str, Any]) -> None:
    """A peft-wrapped model's state dict has ``base_layer``/``lora_`` keys no original layout knows."""
    bad = [k for k in state_dict if ".base_layer." in k or ".lora_" in k]
    if bad:
        raise ValueError(
            f"the {name} still carries LoRA adapter layers ({bad[0]!r}, …). Merge them first "
            "(e.g. peft's merge_and_unload / diffusers' fuse_lora + unload_lora_weights), or export "
            "the adapter on its own with save_lora_kohya.")


# --------------------------------------------------------------------------------------------
# diffusers folders
# --------------------------------------------------------------------------------------------

def _cast_saved_folder(folder: Path, dtype: str) -> None:
    """Rewrite every saved ``*.safetensors`` under ``folder`` in ``dtype`` and note it in configs.

    Why here and not on the models: casting a training model to fp16 and back would destroy its
    fp32 weights, and a cast copy of a big UNet doubles memory. Files are converted one at a time.
    """

    target = dtype_from_name(dtype)
    for file in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if all(t.dtype == target or not t.is_floating_point() for t in tensors.values()):
            continue
        # atomically, and readable as the umask says (safetensors' save_file alone leaves 0600 files)
        save_safetensors_atomic(cast_state_dict(tensors, dtype), file, metadata=meta)
    torch_name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]
    for config in folder.rglob("config.json"):  # transformers configs record the weights' dtype
        data = json.loads(config.read_text(encoding="utf-8"))
        changed = False
        for field in ("dtype", "torch_dtype"):
            if field in data and data[field] != torch_name:
                data[field] = torch_name
                changed = True
        if changed:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_diffusers_folder(folder: str | os.PathLike, pipeline_or_components: Any, dtype: str) -> None:
    """Save a pipeline (or a ``{name: component}`` mapping) as a diffusers folder, atomically.

    ``save_pretrained`` writes into a temporary sibling folder, weights are converted to ``dtype``
    on disk, and only then does the folder take ``folder``'s place. A mapping is written one
    sub-folder per component without ``model_index.json`` (use it to replace, e.g., only the UNet).
    """
    dtype_from_name(dtype)
    with atomic_dir(folder) as tmp:
        if isinstance(pipeline_or_components, Mapping):
            for name, component in pipeline_or_components.items():
                if component is None:
                    continue
                if not hasattr(component, "save_pretrained"):
                    raise TypeError(f"component {name!r} ({type(component).__name__}) cannot be saved")
                kwargs = {"safe_serialization": True} if _takes_safe_serialization(component) else {}
                component.save_pretrained(tmp / name, **kwargs)
        else:
            pipeline_or_components.save_pretrained(tmp, safe_serialization=True)
        _cast_saved_folder(Path(tmp), dtype)


def _takes_safe_serialization(component: Any) -> bool:
    try:
        return "safe_serialization" in inspect.signature(component.save_pretrained).parameters
    except (TypeError, ValueError):
        return False
