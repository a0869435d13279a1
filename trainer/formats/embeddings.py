"""Textual-inversion embeddings in A1111's formats (``.safetensors`` ``emb_params`` or ``clip_l``/``clip_g``,
``.pt`` ``string_to_param``), and an embedding bundled into a LoRA file (``bundle_emb.*``).

Both load with diffusers' ``load_textual_inversion``, A1111 and ComfyUI (see LIBRARY-NOTES).
torch and safetensors are imported where they are used (see :mod:`trainer.formats.checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from trainer.formats.checkpoint import cast_state_dict
from trainer.io import atomic_path, save_safetensors_atomic

CLIP_STAR_TOKEN_ID = 265  # "*" in the CLIP vocab: A1111's placeholder in .pt files


def save_embedding_a1111(path: str | os.PathLike, vectors: "torch.Tensor | Mapping[str, torch.Tensor]", *,
                         name: str, step: int | None = None, metadata: Mapping[str, Any] | None = None,
                         dtype: str = "fp32") -> None:
    """Write a textual-inversion embedding the way A1111 (and kohya) do, atomically.

    ``.safetensors``: ``{"emb_params": T[num_vectors, dim]}`` (SD1/2) — or, given a mapping such as
    ``{"clip_l": …, "clip_g": …}`` (SDXL), those tensors. ``.pt``: A1111's
    ``{"string_to_param": {"*": T}, "string_to_token": {"*": 265}, "name", "step"}``.
    Both load with diffusers' ``load_textual_inversion``, A1111 and ComfyUI.
    """
    path = Path(path)
    tensors = dict(vectors) if isinstance(vectors, Mapping) else {"emb_params": vectors}
    tensors = {k: v.detach().reshape(-1, v.shape[-1]) for k, v in tensors.items()}
    tensors = cast_state_dict(tensors, dtype)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        save_safetensors_atomic({k: v.contiguous() for k, v in tensors.items()}, path,
                                {str(k): str(v) for k, v in (metadata or {}).items()})
    elif suffix == ".pt":
        if set(tensors) != {"emb_params"}:
            raise ValueError("A1111 .pt embeddings hold one tensor; save SDXL embeddings as .safetensors")
        data = {"string_to_param": {"*": tensors["emb_params"].contiguous()},
                "string_to_token": {"*": CLIP_STAR_TOKEN_ID}, "name": name, "step": step}
        with atomic_path(path) as tmp:
            torch.save(data, tmp)
    else:
        raise ValueError(f"embeddings are .safetensors or .pt; got {path.name!r}")


def load_embedding_a1111(path: str | os.PathLike) -> "torch.Tensor":
    """The vectors ``[num_vectors, dim]`` of an A1111 (``emb_params`` / ``string_to_param``) or
    diffusers (``{token: T}``) embedding file."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        data: Any = load_file(str(path))
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
    if "string_to_param" in data:
        params = data["string_to_param"]
        if len(params) != 1:
            raise ValueError(f"{path.name}: the embedding holds {len(params)} terms; expected one")
        tensor = next(iter(params.values()))
    elif "emb_params" in data:
        tensor = data["emb_params"]
    elif len(data) == 1:
        tensor = next(iter(data.values()))
    else:
        raise ValueError(f"{path.name}: not an SD1/2 embedding (keys {sorted(data)[:5]}); SDXL files hold "
                         "clip_l/clip_g")
    return tensor.detach().reshape(-1, tensor.shape[-1]).float()


def bundle_embedding_state_dict(name: str, vectors: "torch.Tensor | Mapping[str, torch.Tensor]"
                                ) -> dict[str, "torch.Tensor"]:
    """Keys that bundle an embedding into a LoRA file: ``bundle_emb.<name>.string_to_param.*``
    (A1111's Lora extension reads them; the embedding's prompt word is ``name``). An SDXL embedding
    (a mapping ``{"clip_l", "clip_g"}``) gives ``bundle_emb.<name>.clip_l`` / ``.clip_g``, which A1111
    collects into the same dict its SDXL embedding files hold."""
    if not name or "." in name or any(c.isspace() for c in name):
        raise ValueError(f"bundled embedding name {name!r} must be non-empty without dots or spaces")
    if isinstance(vectors, Mapping):
        return {f"bundle_emb.{name}.{k}": v.detach().cpu().reshape(-1, v.shape[-1]).clone()
                for k, v in vectors.items()}
    return {f"bundle_emb.{name}.string_to_param.*": vectors.detach().cpu().reshape(-1, vectors.shape[-1]).clone()}
