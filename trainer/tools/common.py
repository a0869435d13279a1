"""What the model tools share: loading a model the way training does, the weights' stored dtype,
reading kohya LoRA files and finding the model layer each LoRA key belongs to."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import diffusers.utils.logging as dlog
import torch
import transformers.utils.logging as tlog
from omegaconf import OmegaConf
from safetensors import safe_open

from trainer.config.checks import load_config
from trainer.config.fields import PART_OF_SLOT
from trainer.errors import ConfigError
from trainer.families.sources import load_model
from trainer.formats.dora import COMFY_EPS
from trainer.formats.metadata import network_shape_metadata
from trainer.tools import ToolError, model_problem

_TORCH_TO_NAME = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------

def tool_config(model_path: str, workspace: Optional[str] = None, config: Optional[str] = None,
                dtype: str = "fp32", config_path: Optional[str] = None) -> Any:
    """A run config for loading ``model_path`` (or the model of ``config``): every part stored in ``dtype``
    (the VAE as the config says), the built-in tiny models under ``<workspace>/models``, ``config_path``
    as ``model.config_path`` (the diffusers configs of a single file that is not the standard size)."""

    cfg = load_config(config) if config else load_config(None)
    if model_path:
        OmegaConf.update(cfg, "model.path", str(model_path))
    if workspace:
        OmegaConf.update(cfg, "general.workspace", str(workspace))
    if config_path:
        OmegaConf.update(cfg, "model.config_path", str(config_path))
    for part in set(PART_OF_SLOT.values()):
        if part in cfg.parts:
            OmegaConf.update(cfg, f"parts.{part}.dtype", dtype)
    return cfg


def quiet_libraries() -> None:
    """No per-component progress bars from diffusers/transformers: a tool prints what it wrote."""
    try:
        dlog.disable_progress_bar()
        tlog.disable_progress_bar()
    except Exception:  # an older library without the switch: the bars stay
        pass


def load_family(model_path: str, workspace: Optional[str] = None, *, config: Optional[str] = None,
                config_path: Optional[str] = None, device: Any = "cpu", dtype: str = "fp32") -> Any:
    """The loaded family object (``trainer.families.*``), or ToolError naming what is wrong with MODEL."""
    cfg = tool_config(model_path, workspace, config, dtype, config_path)
    path = str(cfg.model.path)
    problem = model_problem(path)
    if problem:
        raise ToolError(problem if not config else problem.replace("MODEL", f"model.path of {config}", 1))
    if config_path and not Path(config_path).expanduser().is_dir():
        raise ToolError(f"--config-path '{config_path}' is not a folder; give a diffusers model folder whose "
                        "configs describe the single file.")
    quiet_libraries()
    try:
        model = load_model(cfg, str(cfg.general.workspace), device)
    except ConfigError as exc:
        text = str(exc)
        if not config:  # the tools' own option names
            text = text.replace("set model.config_path to", "give --config-path")
        raise ToolError(text) from None
    return model


def source_dtype(model: Any) -> str:
    """The dtype the model's denoiser weights are stored in (fp32 when it cannot be told: .ckpt, hub)."""
    src = getattr(model, "source", None)
    if src is None:
        return "fp32"
    loc = Path(src.location)
    if src.kind == "single_file":
        files, prefix = [loc], "model.diffusion_model."
    elif src.kind == "folder":
        sub = next((loc / s for s in ("unet", "transformer") if (loc / s).is_dir()), loc)
        files, prefix = sorted(sub.glob("*.safetensors")), ""
    else:
        return "fp32"
    for file in files:
        if file.suffix.lower() != ".safetensors":
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = [k for k in f.keys() if k.startswith(prefix)] or list(f.keys())
                for key in keys[:50]:
                    name = _TORCH_TO_NAME.get(f.get_slice(key).get_dtype())
                    if name:
                        return name
        except Exception:  # an unreadable file: the loader would have said so
            continue
    return "fp32"


# --------------------------------------------------------------------------------------------------
# kohya LoRA files
# --------------------------------------------------------------------------------------------------

@dataclass
class LoraFile:
    """A LoRA file's layers by name: kohya LoRA/LoCon (``down``, ``up``, ``alpha``), diffusers/peft (``down`` = lora_A,
    ``up`` = lora_B, no alpha: α/r is in lora_B), LyCORIS LoHa (``hada_w1_a`` …) or LoKr (``lokr_w1`` or ``lokr_w1_a``
    /``_b``, ``lokr_w2`` …); ``extra``: tensors that are no LoRA layer (bundled embeddings)."""

    path: Path
    layers: Dict[str, Dict[str, Any]]
    metadata: Dict[str, str]
    extra: Dict[str, Any] = field(default_factory=dict)

    def kind(self, name: str) -> str:
        layer = self.layers[name]
        return "loha" if "hada_w1_a" in layer else "lokr" if any(k.startswith("lokr_") for k in layer) else "lora"

    def rank(self, name: str) -> Optional[int]:
        """The rank alpha is divided by; None for a LoKr layer of two full factors (its scale is 1)."""
        layer, kind = self.layers[name], self.kind(name)
        if kind == "lora":
            return int(layer["down"].shape[0])
        if kind == "loha":
            return int(layer["hada_w1_b"].shape[0])
        for key in ("lokr_w2_b", "lokr_w1_b"):  # as ComfyUI/LyCORIS: the factored side's rank
            if key in layer:
                return int(layer[key].shape[0])
        return None

    def alpha(self, name: str) -> float:
        alpha, rank = self.layers[name].get("alpha"), self.rank(name)
        return float(alpha.item()) if alpha is not None else float(rank or 1)

    def scale(self, name: str) -> float:
        rank = self.rank(name)
        return 1.0 if rank is None else self.alpha(name) / rank

    @property
    def max_rank(self) -> int:
        return max(self.rank(n) or 0 for n in self.layers)

    @property
    def weight_dtype(self) -> Any:
        return next(t for t in next(iter(self.layers.values())).values() if t.ndim > 0).dtype

    def delta(self, name: str) -> Any:
        """The layer's weight change in float32, flattened to [out, in·k·k]: (alpha/rank) · up @ down (LoRA),
        · (w1a @ w1b) ⊙ (w2a @ w2b) (LoHa), · w1 ⊗ w2 (LoKr), as ComfyUI's and LyCORIS' loaders compute them."""
        layer, kind = self.layers[name], self.kind(name)

        def mat(key: str):
            if key in layer:
                return layer[key].float().flatten(1)
            return layer[f"{key}_a"].float().flatten(1) @ layer[f"{key}_b"].float().flatten(1)
        if kind == "lora":
            d = layer["up"].float().flatten(1) @ layer["down"].float().flatten(1)
        elif kind == "loha":
            d = mat("hada_w1") * mat("hada_w2")
        else:
            d = torch.kron(mat("lokr_w1"), mat("lokr_w2"))
        return d * self.scale(name)

    def is_dora(self, name: str) -> bool:
        return "dora_scale" in self.layers[name]

    def dora(self, name: str, base: Any) -> Any:
        """The layer's trained weight, m · V / ‖V‖ per output row with V = W + delta (peft's and LyCORIS' DoRA), for
        the base weight ``base``; the magnitude m read from ``dora_scale`` as the file's ``atelier_dora_format`` header
        says it was written (:func:`trainer.formats.dora.dora_scale_for`; LyCORIS/kohya files without it: lycoris)."""
        w = base.detach().float().cpu()
        v = w + self.delta(name).reshape(w.shape)
        rows_v = v.flatten(1).norm(dim=1)
        s = self.layers[name]["dora_scale"].float().cpu()
        fmt = str(self.metadata.get("atelier_dora_format", "lycoris"))
        if s.numel() != s.shape[0]:  # one value per (out, in) pair: the a1111 form, whatever the header says
            cols_v = v.transpose(0, 1).reshape(v.shape[1], -1).norm(dim=1)
            m = (s.reshape(v.shape[0], v.shape[1], -1)[:, :, 0] / cols_v[None, :]).mean(dim=1) * rows_v
        elif fmt == "comfyui":
            m = s.reshape(-1) * rows_v / (w.flatten(1).norm(dim=1) + COMFY_EPS)
        else:
            m = s.reshape(-1)
        return v * (m / rows_v).reshape(-1, *([1] * (v.ndim - 1)))

    def trained_for(self) -> str:
        """What the header says the LoRA was trained on, for messages ('' when it does not say)."""
        m = self.metadata
        return str(m.get("ss_base_model_version") or m.get("modelspec.architecture") or "")


def read_lora(path: str | Path, what: str = "LoRA", allow_dora: bool = False) -> LoraFile:
    """Read a kohya-layout LoRA/LoCon ``.safetensors``; ToolError for anything else, saying what it is. ``allow_dora``:
    DoRA files (``dora_scale`` keys, read as their ``atelier_dora_format`` header says: see :meth:`LoraFile.dora`)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ToolError(f"{what} file '{path}' does not exist.")
    if p.is_dir():
        raise ToolError(f"{what} '{path}' is a folder; give the LoRA's .safetensors file.")
    if p.suffix.lower() != ".safetensors":
        raise ToolError(f"{what} '{path}' is a {p.suffix or 'extension-less'} file; LoRA files are .safetensors "
                        "(kohya layout, as Atelier writes them).")
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise ToolError(f"{what} '{path}' is not a readable .safetensors file ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}).") from None
    layers: Dict[str, Dict[str, Any]] = {}
    extra: Dict[str, Any] = {}
    other: List[str] = []
    # kohya: <name>.lora_down/lora_up/alpha; diffusers/peft: <prefix>.<module>.lora_A/lora_B (α/r in lora_B, so no
    # alpha: the scale is 1), named "peft:<prefix>.<module>" (layer_index names a model's layers the same way)
    parts = {".lora_down.weight": ("", "down"), ".lora_up.weight": ("", "up"), ".alpha": ("", "alpha"),
             ".lora_A.weight": ("peft:", "down"), ".lora_B.weight": ("peft:", "up")}
    parts.update({f".{k}": ("", k) for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1",
                                             "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")})
    if allow_dora:
        parts[".dora_scale"] = ("", "dora_scale")
    for key, value in tensors.items():
        for suffix, (kind, part) in parts.items():
            if key.endswith(suffix):
                layers.setdefault(kind + key[: -len(suffix)], {})[part] = value
                break
        else:
            if key.startswith("bundle_emb."):
                extra[key] = value
            else:
                other.append(key)
    if any(k.endswith(".dora_scale") for k in other):
        raise ToolError(f"{what} '{path}' is a DoRA file (dora_scale keys); resizing DoRA is not supported (its "
                        "magnitude is tied to the full-rank direction). Merge it into the model instead, or use a plain "
                        "LoRA.")
    if any(k.endswith(".oft_blocks") for k in other):
        raise ToolError(f"{what} '{path}' is a LyCORIS OFT file (oft_blocks): OFT rotates the model's own weights, "
                        "which the LoRA tools do not compute yet. Load it in ComfyUI, or train a LoRA/LoHa/LoKr.")
    if any(k.endswith((".hada_t1", ".hada_t2", ".lokr_t2")) for k in other):
        raise ToolError(f"{what} '{path}' is a LyCORIS file with Tucker-decomposed conv layers (hada_t1/lokr_t2), "
                        "which the model tools do not read yet. Use LoHa/LoKr without use_tucker, or a LoRA.")
    if not layers:
        sample = ", ".join(sorted(tensors)[:3]) or "no tensors at all"
        looks = " It looks like a full model checkpoint." if any(
            k.startswith(("model.diffusion_model.", "first_stage_model.", "conditioner.", "cond_stage_model."))
            for k in tensors) else ""
        raise ToolError(f"{what} '{path}' is not a LoRA file: none of its {len(tensors)} tensors is a kohya "
                        f"lora_down/lora_up or a diffusers lora_A/lora_B pair (e.g. {sample}).{looks}")
    def complete(layer: Dict[str, Any]) -> bool:
        if "hada_w1_a" in layer or "hada_w2_a" in layer:
            return all(k in layer for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        if any(k.startswith("lokr_") for k in layer):
            return all(k in layer or (f"{k}_a" in layer and f"{k}_b" in layer) for k in ("lokr_w1", "lokr_w2"))
        return "down" in layer and "up" in layer
    broken = sorted(n for n, l in layers.items() if not complete(l))
    if broken or other:
        shown = (broken + other)[:3]
        raise ToolError(f"{what} '{path}' is not a complete kohya LoRA: {len(broken) + len(other)} keys without "
                        f"their lora_down/lora_up pair or of an unknown kind (e.g. {', '.join(shown)}).")
    for name, layer in layers.items():
        if "down" not in layer:
            continue  # LoHa/LoKr: their factors are checked against the model's layer when merged
        down, up = layer["down"], layer["up"]
        if down.ndim not in (2, 4) or up.ndim != down.ndim or up.shape[1] != down.shape[0]:
            raise ToolError(f"{what} '{path}': layer {name} has lora_up {tuple(up.shape)} and lora_down "
                            f"{tuple(down.shape)}, which do not multiply; the file is damaged.")
    return LoraFile(p, layers, metadata, extra)


# --------------------------------------------------------------------------------------------------
# kohya names of a loaded model's layers
# --------------------------------------------------------------------------------------------------

def layer_index(model: Any) -> Dict[str, Tuple[str, str, Any]]:
    """Layer name → (slot, module path, module) for every Linear/Conv2d layer of the model's parts, named by the
    family's own LoRA namer (kohya files) and, for families whose files are in the diffusers/peft layout, as
    ``peft:<prefix>.<module>``."""
    namer = model.lora_namer()
    index: Dict[str, Tuple[str, str, Any]] = {}
    for slot, module in model.parts().items():
        if slot not in namer:
            continue
        prefix, rename = namer[slot]
        for path, mod in module.named_modules():
            if not isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
                continue
            try:
                name = f"{prefix}_{rename(path).replace('.', '_')}"
            except (KeyError, ValueError):  # a module the original layout has no name for
                continue
            index[name] = (slot, path, mod)
    for slot, (prefix, rename) in model.peft_file_names().items():  # diffusers/peft-layout files' names
        module = model.part(slot)
        if module is None:
            continue
        named: Dict[str, List[Tuple[str, Any]]] = {}
        for path, mod in module.named_modules():
            if not isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
                continue
            try:
                named.setdefault(f"peft:{prefix}.{rename(path)}", []).append((path, mod))
            except (KeyError, ValueError):  # a module the file's layout has no name for
                continue
        for name, found in named.items():  # several Linears under one name: one fused layer of the file
            index[name] = (slot, found[0][0], found[0][1] if len(found) == 1 else RowStack([m for _, m in found]))
    return index


class StackedWeight:
    """The weights of several Linears as one, rows stacked: ``shape``, ``device``, ``dtype``, ``detach()`` (the
    stacked copy) and ``add_`` (each Linear gets its rows), what :func:`match_lora` and :func:`apply_loras` use."""

    def __init__(self, parts: List[Any]):
        self.parts = parts
        self.shape = torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
        self.device, self.dtype = parts[0].device, parts[0].dtype

    def detach(self) -> torch.Tensor:
        return torch.cat([p.detach() for p in self.parts])

    def add_(self, delta: torch.Tensor) -> "StackedWeight":
        for p, rows in zip(self.parts, delta.split([p.shape[0] for p in self.parts])):
            p.add_(rows)
        return self


class RowStack:
    """Linears that a LoRA file names as one layer (Flux.2's BFL files: the double blocks' fused q/k/v), in the order
    the model registers them, which is the fused weight's row order."""

    def __init__(self, modules: List[Any]):
        self.modules = modules

    @property
    def weight(self) -> StackedWeight:
        return StackedWeight([m.weight for m in self.modules])


def match_lora(lora: LoraFile, index: Mapping[str, Tuple[str, str, Any]], model_label: str) -> None:
    """Refuse a LoRA whose layers are not all layers of the model (by name and size), saying how many match."""
    matched, first_bad = 0, None
    for name, layer in lora.layers.items():
        target = index.get(name)
        ok = target is not None
        if ok:
            weight = target[2].weight
            try:
                out_dim, in_numel = lora.delta(name).shape
            except RuntimeError:  # factors that do not multiply
                out_dim, in_numel = -1, -1
            ok = weight.shape[0] == out_dim and math.prod(weight.shape[1:]) == in_numel
        if ok:
            matched += 1
        elif first_bad is None:
            first_bad = name
    if matched == len(lora.layers):
        return
    said = lora.trained_for()
    hint = f" Its header says it was trained for {said}." if said else ""
    raise ToolError(f"LoRA '{lora.path}': only {matched} of its {len(lora.layers)} layers match a layer of the model "
                    f"({model_label}; e.g. {first_bad} does not). It was made for another model family or "
                    f"architecture.{hint} Use a LoRA trained on this family.")


def apply_loras(model: Any, loras: List[Tuple[LoraFile, float]]) -> int:
    """W += weight · (alpha/rank) · up @ down for every layer of every LoRA (DoRA layers: W += weight · (DoRA(W) − W)),
    in place (checked first: a LoRA that does not fit changes nothing). Returns the number of layers changed."""
    index = layer_index(model)
    label = f"{model.info.label}, {getattr(model.source, 'display', '')}"
    for lora, _ in loras:
        match_lora(lora, index, label)
    n = 0
    with torch.no_grad():
        for lora, weight in loras:
            for name in lora.layers:
                param = index[name][2].weight
                if lora.is_dora(name):  # W + weight · (DoRA(W) − W), as ComfyUI applies a strength to DoRA
                    delta = (lora.dora(name, param) - param.detach().float().cpu()) * float(weight)
                else:
                    delta = (lora.delta(name) * float(weight)).reshape(param.shape)
                param.add_(delta.to(device=param.device, dtype=param.dtype))
                n += 1
    return n


def network_metadata(state: Mapping[str, Any], base: Mapping[str, str]) -> Dict[str, str]:
    """``base`` with ``ss_network_dim``/``ss_network_alpha``/conv args recomputed from ``state`` (kohya tensors)
    and the file hashes that no longer hold removed."""
    meta = {k: str(v) for k, v in base.items() if not k.startswith("sshs_")}
    try:
        args = json.loads(meta.get("ss_network_args", "") or "{}")
    except ValueError:
        args = {}
    if isinstance(args, dict):
        args = {k: v for k, v in args.items() if k not in ("conv_dim", "conv_alpha")}
    shape = network_shape_metadata(state)
    if "ss_network_args" in shape:
        args = {**(args if isinstance(args, dict) else {}), **json.loads(shape.pop("ss_network_args"))}
    meta.update(shape)
    if args:
        meta["ss_network_args"] = json.dumps(args)
    else:
        meta.pop("ss_network_args", None)
    return meta
