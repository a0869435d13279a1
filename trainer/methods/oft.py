"""OFT (orthogonal fine-tuning, ``lora.type = oft``) trained in place and saved in LyCORIS' diag-OFT layout.

Each adapted Linear/Conv2d keeps its frozen weight W and learns ``oft_blocks`` B of shape (block_num, block_size,
block_size), block_size = ``lora.rank``. Per block of block_size output rows, Q = B - Bᵀ (skew-symmetric) gives
the orthogonal R = (I + Q)(I - Q)⁻¹ (Cayley), and the layer runs with W' = Rᵀ W per block — the formula of
ComfyUI's comfy/weight_adapter/oft.py (``einsum("k n m, k n ... -> k m ...", r, W)``) and of LyCORIS' diag-OFT.
B starts at zero, so R = I and the model starts unchanged.

Why LyCORIS' layout and not peft's OFT: ComfyUI (comfy/weight_adapter/oft.py and boft.py at commit 3684cff) loads
``<name>.oft_blocks`` (3-D: OFT, 4-D: BOFT) with ``<name>.alpha`` and an optional ``rescale``; it reads no peft
OFT key. peft 0.21's OFT also rotates the layer's *input* side (x·R before W), which no per-block rotation of the
output side can express, so its weights cannot be rewritten into the file ComfyUI loads. The layer here is our own
(about the size of peft's), because LyCORIS' modules patch ``forward`` from outside the model tree, where the
training loop, backups and EMA (which walk the model's parameters) would not see them.

No norm constraint: ComfyUI reads ``alpha`` as the constraint on ‖Q‖ while LyCORIS trains with alpha × out_dim,
so a constrained file would not reproduce in ComfyUI; the file's ``alpha`` is 0 (no constraint in either).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Union

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from trainer.errors import ConfigError
from trainer.formats.kohya import assign_tensor, load_lora_file, named_targets

OFT_KEYS = ("oft_blocks",)


class OftLayer(torch.nn.Module):
    """A frozen Linear/Conv2d run with its output rows rotated block by block (see the module docstring)."""

    def __init__(self, base_layer: torch.nn.Module, block_size: int):
        super().__init__()
        self.base_layer = base_layer
        out = int(base_layer.weight.shape[0])
        self.block_size, self.block_num = block_size, out // block_size
        self.oft_blocks = torch.nn.Parameter(torch.zeros(self.block_num, block_size, block_size))
        self._disable_adapters = False  # what LoraMethod.adapters_off switches, as on peft's layers

    def rotation(self) -> torch.Tensor:
        """R per block: (I + Q)(I - Q)⁻¹ with Q = B - Bᵀ, in fp32."""
        blocks = self.oft_blocks.float()
        q = blocks - blocks.transpose(1, 2)
        eye = torch.eye(self.block_size, device=blocks.device, dtype=blocks.dtype)
        return (eye + q) @ torch.linalg.inv(eye - q)

    def rotated_weight(self) -> torch.Tensor:
        """W' = Rᵀ W per block of output rows, in fp32."""
        base = self.base_layer
        # an fp8-stored base (trainer.memory.precision.store_fp8) computes with fp8 · scale: rotate that
        weight = base.dequantize() if hasattr(base, "W_q") else base.weight
        shape = weight.shape
        blocks = weight.float().reshape(self.block_num, self.block_size, *shape[1:])
        return torch.einsum("k n m, k n ... -> k m ...", self.rotation(), blocks).reshape(shape)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = self.base_layer
        if self._disable_adapters:
            return base(x, *args, **kwargs)
        dtype = x.dtype if not torch.is_autocast_enabled() else torch.get_autocast_dtype(x.device.type)
        weight = self.rotated_weight().to(dtype)
        bias = None if base.bias is None else base.bias.to(dtype)
        if isinstance(base, torch.nn.Linear):
            return F.linear(x.to(dtype), weight, bias)
        return base._conv_forward(x.to(dtype), weight, bias)


def add_oft(module: torch.nn.Module, targets: Union[List[str], str], block_size: int, what: str, key: str) -> int:
    """Freeze ``module`` and wrap each layer ``targets`` picks (peft's matching of name endings or one regex) in an
    :class:`OftLayer`; ConfigError naming the layer when it is no Linear/Conv2d or its outputs do not split into
    blocks of ``block_size`` (``lora.rank``). Returns the number of layers wrapped."""
    match = LoraConfig(target_modules=targets)
    picked = [(name, m) for name, m in module.named_modules()
              if name and not isinstance(m, OftLayer) and check_target_module_exists(match, name)]
    if not picked:
        raise ConfigError(f"Could not add the {what} adapter: no layer matches the targets. Check {key}.", key=key)
    for name, layer in picked:
        if type(layer) not in (torch.nn.Linear, torch.nn.Conv2d):
            raise ConfigError(f"lora.type = oft: {what} layer {name} is a {type(layer).__name__}; OFT rotates the "
                              f"weights of Linear and Conv2d layers only. Check {key}.", key=key)
        out = int(layer.weight.shape[0])
        if out % block_size:
            fits = [d for d in range(1, min(out, 64) + 1) if out % d == 0 and d > 1]
            raise ConfigError(f"OFT with a rank the layer cannot take: lora.rank = {block_size} is OFT's block size, "
                              f"and {what} layer {name} has {out} outputs, which it does not divide (ranks that "
                              f"do: {', '.join(map(str, fits)) or 'none'}).", key="lora.rank", value=block_size)
    module.requires_grad_(False)
    for name, layer in picked:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        wrapped = OftLayer(layer, block_size).to(device=layer.weight.device)
        setattr(parent, child, wrapped)
    return len(picked)


def oft_layers(model: Any, adapter: str = "default") -> Iterator[tuple[str, Any]]:
    """(module path, OftLayer) for every OFT layer of ``model`` (one adapter per layer: ``adapter`` is unused)."""
    for name, module in model.named_modules():
        if isinstance(module, OftLayer):
            yield name, module


def oft_state_dict(modules: Mapping[str, Any], namer: Any) -> Dict[str, torch.Tensor]:
    """The LyCORIS diag-OFT file's tensors: ``<kohya name>.oft_blocks`` and ``<kohya name>.alpha`` = 0 (no
    constraint), names from the family's ``namer`` as for LoRA files."""
    names = named_targets(modules, namer, "default", oft_layers)
    if not names:
        raise ValueError("no OFT layers found in the given models")
    out: Dict[str, torch.Tensor] = {}
    for kohya, (_, layer) in names.items():
        out[f"{kohya}.oft_blocks"] = layer.oft_blocks.detach().cpu().clone()
        out[f"{kohya}.alpha"] = torch.tensor(0.0)
    return out


def load_oft_into_layers(path: Any, modules: Mapping[str, Any], namer: Any) -> int:
    """Copy a diag-OFT file (``lora.init_weights``) into the OFT layers already added; the inverse of
    :func:`oft_state_dict`. A constrained file (alpha > 0) or one with ``rescale`` is refused: training here runs
    neither."""
    state = load_lora_file(path)
    names = named_targets(modules, namer, "default", oft_layers)
    seen = set()
    for key, value in state.items():
        name, _, part = key.partition(".")
        if key.startswith("bundle_emb."):
            continue
        if name not in names or part not in ("oft_blocks", "alpha"):
            raise ValueError(f"key {key} matches no OFT layer of the model (targets, rank or family differ?)")
        if part == "alpha" and float(value) != 0.0:
            raise ValueError(f"{name}.alpha = {float(value):g}: a constrained OFT file; training here runs "
                             "unconstrained OFT (alpha 0)")
        if part == "oft_blocks":
            assign_tensor(names[name][1].oft_blocks, value, key)
            seen.add(name)
    missing = sorted(set(names) - seen)
    if missing:
        raise ValueError(f"model OFT layers not in the file: {', '.join(missing[:10])}")
    return len(seen)
