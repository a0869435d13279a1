"""``model.training_adapter``: a frozen LoRA added to the base model while a run trains, left out of what it saves.

A step-distilled model (Z-Image Turbo, Krea 2 Turbo, FLUX.1 [schnell]) trained directly learns the new concept and,
with it, to undo its distillation: the LoRA then breaks few-step sampling. A de-distilling adapter (ai-toolkit's
"training adapters") turns the base back into an undistilled model while training, so the LoRA learns only the
concept; samples and users then apply the LoRA to the distilled model alone.

What this follows: ai-toolkit (ostris/ai-toolkit at 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350,
``extensions_built_in/diffusion_models/z_image/z_image.py`` ``load_training_adapter``) merges the adapter into the
transformer at multiplier 1 for training and applies it at −1 while sampling, so samples show the LoRA on the
distilled model with its few-step settings. Here the adapter is a forward hook on each layer it names, adding
``x · (α/r · up @ down)ᵀ`` to the layer's output: the same function as the merged weight, kept apart so that samples
switch it off exactly (no subtraction from rounded weights) and fp8/NF4 storage of the base stays as it is. It is
no module of the trained method, so it is never saved and never trained.

The file is read with the model tools' LoRA reader (kohya, diffusers/peft and ComfyUI layouts of the family, the
same names :mod:`trainer.tools.merge` matches), and must be a plain LoRA (down/up factors) on Linear layers; one of
another family, or of another layout (LoHa, LoKr, DoRA, convolutions), is refused in one line naming the file.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, List, Optional

import torch
import torch.nn.functional as F

from trainer.errors import ConfigError
from trainer.tools import ToolError
from trainer.tools.common import LoraFile, RowStack, layer_index, match_lora, read_lora

KEY = "model.training_adapter"


class TrainingAdapter:
    """The hooks of one adapter file on the model's layers; ``active`` (on while training) switches them."""

    def __init__(self, path: Path, layers: int):
        self.path, self.layers = path, layers
        self.active = True
        self.handles: List[Any] = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def adapter_file(value: str, mcfg: Any) -> Path:
    """The adapter's local file: ``value`` itself, or a hub file ``org/repo/path/file.safetensors`` from the hub cache
    (downloaded once unless ``model.hub_offline``)."""
    local = Path(value).expanduser()
    if local.exists() or value.count("/") < 2 or value.startswith((".", "/", "~")):
        return local
    repo, filename = "/".join(value.split("/")[:2]), value.split("/", 2)[2]
    # the hub client: only a hub adapter needs it (it imports requests and more)
    from huggingface_hub import hf_hub_download
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=bool(getattr(mcfg, "hub_offline", False)),
                                    cache_dir=getattr(mcfg, "cache_dir", "") or None))
    except Exception as exc:
        raise ConfigError(f"{KEY} '{value}': the hub file could not be found or downloaded ({type(exc).__name__}). "
                          "Check the repo and file name, your network (or model.hub_offline), or give a local "
                          ".safetensors file.", key=KEY, value=value) from None


COMFY_PREFIX = "peft:diffusion_model."


def comfy_names_as_family(lora: LoraFile, model: Any) -> LoraFile:
    """A diffusers/peft-layout file named as ComfyUI loads it (``diffusion_model.<module>.lora_A``: ai-toolkit's
    published adapters, whose loader swaps the prefix for ``transformer.``) with the family's own prefix, where the
    family's files are in that layout with one prefix."""
    prefixes = {prefix for prefix, _ in model.peft_file_names().values()}
    if len(prefixes) != 1 or not any(n.startswith(COMFY_PREFIX) for n in lora.layers):
        return lora
    own = f"peft:{prefixes.pop()}."
    return replace(lora, layers={(own + n[len(COMFY_PREFIX):]) if n.startswith(COMFY_PREFIX) else n: layer
                                 for n, layer in lora.layers.items()})


def _factors(lora: LoraFile, name: str, target: Any, where: str) -> List[tuple]:
    """(Linear, down, up · α/r) for one layer of the file: a fused layer (:class:`RowStack`) gives each Linear its rows
    of ``up``."""
    layer = lora.layers[name]
    if lora.kind(name) != "lora" or lora.is_dora(name) or layer["down"].ndim != 2:
        kind = "DoRA" if lora.is_dora(name) else "convolution LoRA" if lora.kind(name) == "lora" else lora.kind(name)
        raise ConfigError(f"{KEY} '{where}': layer {name} is a {kind} layer; a training adapter is a plain LoRA "
                          "(lora_down/lora_up or lora_A/lora_B on Linear layers).", key=KEY, value=where)
    down, up = layer["down"].float(), layer["up"].float() * lora.scale(name)
    modules = target.modules if isinstance(target, RowStack) else [target]
    if not all(isinstance(m, torch.nn.Linear) for m in modules):
        raise ConfigError(f"{KEY} '{where}': layer {name} is not a Linear layer of the model; a training adapter "
                          "is a LoRA of the transformer's Linear layers.", key=KEY, value=where)
    rows = up.split([m.out_features for m in modules])
    return [(m, down, part) for m, part in zip(modules, rows)]


def attach_training_adapter(model: Any, value: str, mcfg: Any) -> Optional[TrainingAdapter]:
    """Read ``model.training_adapter`` and hook it onto ``model``'s layers (before the method wraps them); None when
    the setting is empty. The adapter is checked whole before any hook is added."""
    value = str(value or "").strip()
    if not value:
        return None
    path = adapter_file(value, mcfg)
    try:
        lora = comfy_names_as_family(read_lora(path, "Training adapter", allow_dora=True), model)
        index = layer_index(model)
        match_lora(lora, index, f"{model.info.label}, {getattr(model.source, 'display', '')}")
    except ToolError as exc:
        raise ConfigError(f"{KEY}: {str(exc).splitlines()[0]}", key=KEY, value=value) from None
    device = getattr(model, "device", None)
    plan = [f for name in lora.layers for f in _factors(lora, name, index[name][2], value)]
    adapter = TrainingAdapter(path, len(lora.layers))
    for module, down, up in plan:
        dtype = module.weight.dtype if module.weight.is_floating_point() else torch.float32
        down = down.to(device=device if device is not None else module.weight.device, dtype=dtype)
        up = up.to(device=down.device, dtype=dtype)
        adapter.handles.append(module.register_forward_hook(_hook(adapter, down, up)))
    logging.getLogger("atelier").info("training adapter: %s on %d layers (left out of samples and of the saved file)",
                                      path.name, adapter.layers)
    return adapter


def _hook(adapter: TrainingAdapter, down: torch.Tensor, up: torch.Tensor):
    def hook(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not adapter.active:
            return output
        x = args[0]
        if down.device != x.device:  # a layer of swapped blocks or an offloaded part runs elsewhere
            down_x, up_x = down.to(x.device), up.to(x.device)
        else:
            down_x, up_x = down, up
        extra = F.linear(F.linear(x.to(down_x.dtype), down_x), up_x)
        return output + extra.to(output.dtype)
    return hook


@contextmanager
def adapter_off(model: Any) -> Iterator[None]:
    """The model without its training adapter (samples: the LoRA on the distilled model, as users will run it)."""
    adapter = getattr(model, "training_adapter", None)
    if adapter is None:
        yield
        return
    adapter.active = False
    try:
        yield
    finally:
        adapter.active = True
