"""Everything ``train`` would reject about files and folders, checked before a model loads.

``validate`` (and the UI's "Check settings") run these through :func:`trainer.config.checks.cross_field_warnings`,
so a missing model file, concept folder, caption file, LoRA to continue from, sample image or an
unwritable workspace is named at its field in a second, not after minutes of model loading.
Torch-free: a directory listing and ``os.access``, no image decoding (the data check does that).

Relative paths are read from the folder Atelier was started in, as the trainer reads them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional

from trainer.data.concepts import concept_caption_file, concept_controls, concept_folder
from trainer.data.frames import concept_extensions, video_spec
from trainer.data.order import concept_repeats
from trainer.errors import DataError
from trainer.families import tiny_models
from trainer.families.checks import read_safetensors_header, read_safetensors_shapes
from trainer.families.common.fp8_files import fp8_kind

CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


def _local(path: str, base: Path) -> Path:
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else base / p


def looks_like_hub_id(path: str) -> bool:
    """``org/name``: one slash, no backslash, drive letter, leading dot or tilde, no checkpoint suffix."""
    return (path.count("/") == 1 and not path.startswith((".", "/", "~")) and "\\" not in path
            and ":" not in path and not path.lower().endswith(CHECKPOINT_SUFFIXES)
            and all(part.strip() for part in path.split("/")))


def model_path_problem(path: str, base: Optional[Path] = None) -> Optional[str]:
    """Why ``model.path`` cannot be loaded, when that can be told without loading it; None for an
    existing folder or checkpoint file, a known ``builtin:`` name, or something shaped like a hub id."""
    base = base or Path.cwd()
    path = str(path or "").strip()
    if not path:
        return ("model.path is empty: give a diffusers folder, a hub id (org/name), a .safetensors/.ckpt file, "
                "or builtin:tiny-sd.")
    if path.startswith("builtin:"):
        if path.split(":", 1)[1] not in tiny_models():
            return (f"model.path '{path}': unknown built-in model; choose from "
                    + ", ".join(f"builtin:{n}" for n in tiny_models()) + ".")
        return None
    p = _local(path, base)
    if p.is_dir():
        if not (p / "model_index.json").exists() and not (p / "unet").is_dir() \
                and not (p / "transformer").is_dir():
            return (f"model.path '{path}' is a folder but not a diffusers model (no model_index.json). Point it "
                    "at the model's top folder, or at a .safetensors file.")
        return None
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return (f"model.path '{path}' is a GGUF file: weights quantised for inference (ComfyUI-GGUF, "
                    "stable-diffusion.cpp), which cannot be trained from. Use the model's .safetensors release (bf16 or "
                    "fp16) or its diffusers folder; to save memory while training, store the base in fp8 "
                    "(parts.denoiser.fp8) instead.")
        if p.suffix.lower() not in CHECKPOINT_SUFFIXES:
            return (f"model.path '{path}' is a {p.suffix or 'extension-less'} file; expected a .safetensors or "
                    ".ckpt checkpoint.")
        return None
    if looks_like_hub_id(path):
        return None  # read from the hub (or its cache) when the model loads
    return (f"model.path '{path}' does not exist. Check the path (it is read relative to the folder you "
            f"started from: {base}).")


def fp8_file_kind(path: str, base: Optional[Path] = None) -> str:
    """``"fp8"``/``"scaled fp8"`` for a local .safetensors file of float8 weights (common/fp8_files.py), else ``""``."""
    p = _local(str(path or "").strip(), base or Path.cwd())
    if p.suffix.lower() != ".safetensors" or not p.is_file():
        return ""
    try:
        return fp8_kind(read_safetensors_header(p))
    except (OSError, ValueError):
        return ""  # unreadable: the loader says so


def _fp8_base_problem(cfg: Any, base: Path) -> Optional[str]:
    """An fp8 single file is a LoRA's (or an embedding's) frozen base; a fine-tune of it is refused."""
    if cfg.training.method != "finetune":
        return None
    kind = fp8_file_kind(str(cfg.model.path or ""), base)
    if not kind:
        return None
    return (f"model.path '{cfg.model.path}' holds {kind} weights (float8, 3 bits of mantissa): a fine-tune trains and "
            "saves every weight, and would start from the rounded ones. Train a LoRA on it (training.method = lora), "
            "or fine-tune the model's bf16/fp16 release.")


def _adapter_problem(value: str, base: Path) -> Optional[str]:
    """``model.training_adapter``: a local .safetensors file, or a hub file (org/repo/file.safetensors)."""
    if not value:
        return None
    p = _local(value, base)
    if p.is_file():
        if p.suffix.lower() != ".safetensors":
            return (f"model.training_adapter '{value}' is a {p.suffix or 'extension-less'} file; a training adapter "
                    "is a LoRA .safetensors file.")
        return None
    if value.count("/") >= 2 and not value.startswith((".", "/", "~")) and "\\" not in value and ":" not in value:
        return None  # a hub file, read from the hub (or its cache) when the run starts
    return (f"model.training_adapter '{value}' does not exist. Give the adapter's .safetensors file, or a hub file "
            "as org/repo/file.safetensors.")


def _writable_problem(key: str, value: str, base: Path) -> Optional[str]:
    """A folder Atelier must create or write: it must be a folder (or not exist yet) under a writable one."""
    p = _local(value, base)
    if p.exists() and not p.is_dir():
        return f"{key} = '{value}' is a file; it must be a folder Atelier can write to."
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{key} = '{value}' cannot be created: '{probe}' is a file, not a folder."
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        return (f"{key} = '{value}': '{probe}' is not writable for this user. Pick a folder you can write to, "
                "or fix its permissions.")
    return None


def path_problems(cfg: Any, base: Optional[Path] = None) -> List[tuple]:
    """(key, message) for every file or folder of ``cfg`` that ``train`` would reject."""
    base = base or Path.cwd()
    out: List[tuple] = []

    def add(key: str, message: Optional[str]) -> None:
        if message:
            out.append((key, message))

    add("model.path", model_path_problem(str(cfg.model.path or ""), base) or _fp8_base_problem(cfg, base))
    add("model.training_adapter", _adapter_problem(str(cfg.model.get("training_adapter", "") or "").strip(), base))
    config_path = str(cfg.model.get("config_path", "") or "").strip()
    if config_path and not _local(config_path, base).is_dir():
        add("model.config_path", f"model.config_path '{config_path}' is not a folder. Give a diffusers model "
                                 "folder whose configs describe the single file, or leave it empty.")
    per_epoch, readable, roles = 0.0, True, []
    extensions = concept_extensions(video_spec(cfg))  # a video family's concepts hold clips too
    for i, concept in enumerate(cfg.data.concepts or []):
        if not concept.enabled:
            continue
        roles.append(str(getattr(concept, "role", "train") or "train"))
        try:
            folder, files = concept_folder(i, concept, base, extensions=extensions)
            if concept.caption_source == "concept_file":
                concept_caption_file(i, concept, folder, base)
            concept_controls(i, concept, folder, files, base)  # every image with its controls, every control paired
        except DataError as exc:
            add(exc.key or f"data.concepts.{i}.path", str(exc))
            readable = False
            continue
        if roles[-1] != "validation":
            per_epoch += len(files) * concept_repeats(concept, len(files))
    if roles and all(r == "validation" for r in roles):
        add("data.concepts", "Every enabled concept is a validation concept (role: validation): nothing would train. "
                             "Give at least one concept role train.")
    elif readable and roles:
        add("training.batch_size", _batch_problem(cfg, per_epoch))
    method = cfg.training.method
    for key, used in (("lora.init_weights", method == "lora"), ("embedding.init_weights", method == "embedding")):
        value = str(_get(cfg, key) or "").strip()
        if used and value and not _local(value, base).is_file():
            add(key, f"{key} '{value}' does not exist. Give the file to continue from, or leave it empty to "
                     "start fresh.")
        elif used and value and key == "lora.init_weights":
            local = _local(value, base)
            try:
                read_safetensors_shapes(local)
            except (OSError, ValueError) as exc:
                why = str(exc).replace(f"{local}: ", "")
                add(key, f"{key} '{value}' is not a LoRA .safetensors file ({why}). Give a LoRA saved by Atelier, "
                         "kohya or another trainer, or leave it empty to start fresh.")
    for i, prompt in enumerate(cfg.sampling.prompts or []):
        for field in ("image", "mask"):
            value = str(prompt.get(field, "") or "").strip()
            if value and not _local(value, base).is_file():
                add(f"sampling.prompts.{i}.{field}", f"sampling.prompts.{i}.{field} '{value}' does not exist. "
                                                     "Fix the path or leave it empty.")
        for k, value in enumerate(prompt.get("control_images", None) or []):
            value = str(value or "").strip()
            if not value or not _local(value, base).is_file():
                add(f"sampling.prompts.{i}.control_images.{k}", f"sampling.prompts.{i}.control_images.{k} "
                    f"'{value}' is not an image file. Give the image the sample edits (or refers to).")
    for key in ("general.workspace", "data.cache_dir", "output.path"):
        value = str(_get(cfg, key) or "").strip()
        if value:
            add(key, _writable_problem(key, value, base))
    return out


def _batch_problem(cfg: Any, per_epoch: float) -> Optional[str]:
    """A global micro-batch larger than the images an epoch holds: no batch would ever fill (train refuses after
    loading the model). Aspect buckets can still leave each bucket short; the data report lists those."""
    t = cfg.training
    processes = int(cfg.general.get("num_processes", 1) or 1)
    batch = int(t.batch_size) * processes
    if per_epoch >= batch:
        return None
    many = f"training.batch_size = {t.batch_size}" + (f" x {processes} processes" if processes > 1 else "")
    return (f"{many} is more than the {per_epoch:g} images an epoch holds (the training concepts' images x "
            "repeats, or their samples): no batch would fill and nothing would train. Lower training.batch_size or "
            "raise the concepts' repeats or samples.")


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        if node is None:
            return None
    return node
