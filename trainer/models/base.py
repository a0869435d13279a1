"""What every model family offers the training loop.

A family loads its components (from a diffusers folder, a hub id or a single file), turns captions
into conditioning, images into latents, builds the noisy input and the target for a timestep,
predicts, and makes a sampling pipeline. The loop only talks to this interface, so a new family
(SDXL, SD3, Flux …) is a new module, not a new loop. Families never import each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.config import ConfigError

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(name: str):
    import torch
    return getattr(torch, DTYPE_NAMES[name])


class ModelLoadError(ConfigError):
    """The base model could not be loaded; the message says why and what to do."""


@dataclass
class ModelSource:
    """Where the weights come from: kind is 'folder', 'single_file' or 'hub'."""
    kind: str
    location: str
    display: str


def classify_source(path: str, workspace: str | os.PathLike) -> ModelSource:
    """Turn ``model.path`` into a concrete source, building built-in tiny models on demand."""
    if not path:
        raise ModelLoadError("model.path is empty: give a diffusers folder, a hub id (org/name), a "
                             ".safetensors/.ckpt file, or builtin:tiny-sd.", key="model.path", value=path)
    if path.startswith("builtin:"):
        from trainer.models.tiny import TINY_NAMES, ensure_tiny_model
        name = path.split(":", 1)[1]
        if name not in TINY_NAMES:
            raise ModelLoadError(f"model.path '{path}': unknown built-in model; choose from "
                                 + ", ".join(f"builtin:{n}" for n in TINY_NAMES) + ".", key="model.path",
                                 value=path)
        paths = ensure_tiny_model(name, Path(workspace) / "models")
        return ModelSource("folder", str(paths["diffusers"]), path)
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "model_index.json").exists() and not (p / "unet").is_dir():
            raise ModelLoadError(f"model.path '{path}' is a folder but not a diffusers model (no "
                                 "model_index.json). Point it at the model's top folder, or at a "
                                 ".safetensors file.", key="model.path", value=path)
        return ModelSource("folder", str(p), path)
    if p.is_file():
        if p.suffix.lower() not in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
            raise ModelLoadError(f"model.path '{path}' is a {p.suffix or 'extension-less'} file; expected a "
                                 ".safetensors or .ckpt checkpoint.", key="model.path", value=path)
        return ModelSource("single_file", str(p), path)
    looks_local = path.startswith((".", "/", "~")) or os.sep in path.strip("/").replace("/", "", 1) \
        or path.lower().endswith((".safetensors", ".ckpt"))
    if looks_local or path.count("/") != 1:
        raise ModelLoadError(f"model.path '{path}' does not exist. Check the path (it is read relative to "
                             f"the folder you started from: {os.getcwd()}).", key="model.path", value=path)
    return ModelSource("hub", path, path)


class ModelFamily:
    """Interface the loop uses. Tensors: ``pixels`` in [-1, 1], ``latents`` scaled for the UNet."""

    family: str = ""
    prediction_type: str = "epsilon"

    def trainable_modules(self) -> Dict[str, Any]:
        raise NotImplementedError

    def tokenize(self, captions: List[str]):
        raise NotImplementedError

    def encode_text(self, input_ids):
        raise NotImplementedError

    def encode_pixels(self, pixels) -> Dict[str, Any]:
        raise NotImplementedError

    def sample_latents(self, dist: Dict[str, Any], generator: Optional[Any]):
        raise NotImplementedError

    def noisy_and_target(self, latents, noise, timesteps):
        raise NotImplementedError

    def predict(self, noisy_latents, timesteps, conditioning):
        raise NotImplementedError

    def pipeline(self, sampler: str):
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError
