"""LoRA and its variants on peft, saved in the key layouts A1111 and ComfyUI load.

``lora.type``:
- ``lora``: peft LoRA (LoCon when conv layers are targeted) → kohya file (``lora_down``/``lora_up``/``alpha``).
- ``dora``: peft LoRA with ``use_dora=True`` → kohya file plus ``dora_scale`` (LyCORIS/A1111/ComfyUI
  convention; diffusers' ``load_lora_weights`` drops ``dora_scale`` with a warning).
- ``loha`` / ``lokr``: peft ``LoHaConfig`` / ``LoKrConfig`` → LyCORIS file (``hada_*`` / ``lokr_*``,
  ``alpha``); ``lora.lokr_full_matrix`` keeps both LoKr factors full (LyCORIS' ``full_matrix``). peft's
  parameter names and shapes are LyCORIS's; the exporter bakes peft's alpha/r into LoKr layers with two full
  factors, where LyCORIS loaders use scale 1 (see trainer/formats/lycoris.py).
- ``oft``: OFT, our own layer (trainer/methods/oft.py) → LyCORIS diag-OFT file (``oft_blocks``, ``alpha`` 0).
- ``lora.loraplus_lr_ratio`` (LoRA+, LoRA/DoRA) changes only the optimizer's groups (trainer/optim/build.py).
  peft rather than lycoris-lora for training because peft layers sit inside the diffusers models
  (the loop, backups, EMA and the sampling pipeline see them without a second mechanism).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from trainer.config.fields import PART_OF_SLOT, part_key
from trainer.data.buckets import parse_resolution
from trainer.errors import ConfigError
from trainer.formats.embeddings import bundle_embedding_state_dict
from trainer.formats.kohya import kohya_lora_state_dict, load_lora_kohya_into_peft, save_lora_kohya
from trainer.formats.lycoris import load_lycoris_into_peft, lycoris_state_dict, save_lycoris
from trainer.methods.base import MethodBase
from trainer.methods.oft import OftLayer, add_oft, load_oft_into_layers, oft_state_dict
from trainer.methods.rules import block_of, custom_target_regex, parse_blocks

LYCORIS_TYPES = ("loha", "lokr")
FULL_RANK = 1 << 20  # lora.lokr_full_matrix: a peft LoKr rank above every layer's size


def unet_targets(cfg, model=None) -> Union[List[str], str]:
    """peft ``target_modules`` for the denoiser: the family's list of name endings for the
    ``parts.denoiser.lora_targets`` preset (``model.lora_targets``), or (custom) one regex, which needs no model."""
    choice = cfg.parts.denoiser.lora_targets
    if choice == "custom":
        return custom_target_regex(list(cfg.lora.custom_targets))
    if model is None:
        raise ValueError(f"parts.denoiser.lora_targets = {choice}: the preset's layers are the model family's; "
                         "pass the loaded model")
    return model.lora_targets("unet", choice)


def in_blocks(module, targets: Union[List[str], str], spec: str) -> List[str]:
    """The full paths of the modules ``targets`` (name endings, or one full-match regex) picks in ``module`` that lie
    in the blocks ``spec`` (``parts.denoiser.lora_blocks``) names; ConfigError naming the block lists when none do."""

    ranges = parse_blocks(spec)

    def picked(path: str) -> bool:
        if isinstance(targets, str):
            return re.fullmatch(targets, path) is not None
        return any(path == t or path.endswith("." + t) for t in targets)

    lists: Dict[str, int] = {}
    out = []
    for path, _ in module.named_modules():
        name, index = block_of(path)
        if index < 0:
            continue
        lists[name] = max(lists.get(name, 0), index + 1)
        if picked(path) and any((not n or n == name) and a <= index <= b for n, a, b in ranges):
            out.append(path)
    if not out:
        have = ", ".join(f"{n} (0-{k - 1})" for n, k in lists.items()) or "none"
        raise ConfigError(f"parts.denoiser.lora_blocks = {spec}: no layer the LoRA targets lies in those blocks. This "
                          f"denoiser's block lists: {have}.", key="parts.denoiser.lora_blocks", value=spec)
    return out


def chosen_parts(model, cfg) -> Dict[str, Any]:
    """slot -> module for the parts whose ``parts.<part>.train`` is on; a part the model does not have
    is refused, naming the family's parts."""
    chosen: Dict[str, Any] = {}
    for slot in PART_OF_SLOT:
        if not cfg.parts[PART_OF_SLOT[slot]].train:
            continue
        module = model.part(slot)
        if module is None:
            have = ", ".join(f"{p.label} ({part_key(p.slot, 'train')})" for p in model.info.parts)
            raise ConfigError(f"{part_key(slot, 'train')} is on, but this {model.family} model has no such part; "
                              f"its parts are {have}.", key=part_key(slot, "train"))
        chosen[slot] = module
    return chosen


def _conv_patterns(model, config, lcfg) -> tuple[Dict[str, int], Dict[str, float]]:
    """rank/alpha patterns giving k×k convs ``lora.conv_rank``/``conv_alpha`` (kohya's conv_dim/conv_alpha)."""
    if lcfg.conv_rank is None and lcfg.conv_alpha is None:
        return {}, {}

    ranks: Dict[str, int] = {}
    alphas: Dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d) and tuple(module.kernel_size) != (1, 1) \
                and check_target_module_exists(config, name):
            key = re.escape(name)
            ranks[key] = int(lcfg.conv_rank if lcfg.conv_rank is not None else lcfg.rank)
            alphas[key] = float(lcfg.conv_alpha if lcfg.conv_alpha is not None else lcfg.alpha)
    return ranks, alphas


def adapter_config(lcfg, targets: Union[List[str], str], model=None):
    """The peft config of ``lora.type`` for one model (conv rank/alpha patterns need the model)."""
    kind = lcfg.type
    if kind in ("lora", "dora"):
        config = LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                            target_modules=targets, init_lora_weights=True, use_dora=kind == "dora")
    elif kind == "loha":
        config = LoHaConfig(r=lcfg.rank, alpha=lcfg.alpha, rank_dropout=lcfg.rank_dropout,
                            module_dropout=lcfg.module_dropout, target_modules=targets, init_weights=True)
    elif kind == "lokr" and lcfg.get("lokr_full_matrix", False):
        # peft keeps a factor full when r >= half its larger side: a rank no layer reaches keeps both full, and
        # alpha = r gives LyCORIS' scale 1 of two full factors (the exporter writes alpha = rank)
        config = LoKrConfig(r=FULL_RANK, alpha=FULL_RANK, rank_dropout=lcfg.rank_dropout,
                            module_dropout=lcfg.module_dropout, target_modules=targets, init_weights=True,
                            decompose_factor=int(lcfg.factor))
    elif kind == "lokr":
        config = LoKrConfig(r=lcfg.rank, alpha=lcfg.alpha, rank_dropout=lcfg.rank_dropout,
                            module_dropout=lcfg.module_dropout, target_modules=targets, init_weights=True,
                            decompose_both=bool(lcfg.decompose_both), decompose_factor=int(lcfg.factor))
    else:
        raise ConfigError(f"lora.type = {kind} is not known.", key="lora.type", value=kind)
    if model is not None and config.r != FULL_RANK:
        ranks, alphas = _conv_patterns(model, config, lcfg)
        if ranks:
            config.rank_pattern, config.alpha_pattern = ranks, alphas
    return config


def _add_adapter(model, config, what: str, key: str) -> None:
    """diffusers' ``add_adapter`` where the model has it, else peft's injection (PixArt's transformer
    has no PeftAdapterMixin); both wrap the targets in the same peft layers."""
    try:
        if hasattr(model, "add_adapter"):
            model.add_adapter(config)
        else:
            inject_adapter_in_model(config, model)
    except ValueError as exc:  # peft: "Target modules … not found in the base model", unsupported layer, …
        raise ConfigError(f"Could not add the {what} adapter: {exc}. Check {key}.", key=key) from None


def autocasts(cfg, device) -> bool:
    """The training forward runs under autocast (bf16 anywhere; fp16 on a GPU, where accelerate turns it on)."""
    mp = cfg.training.get("mixed_precision", "no")
    return mp == "bf16" or (mp == "fp16" and device is not None and torch.device(device).type in ("cuda", "mps"))


def skip_input_casts(modules) -> None:
    """peft casts a plain LoRA layer's input to the adapter's dtype (fp32 master weights) before its two matmuls,
    and autocast casts it back to the compute dtype: two copies of every adapted layer's input per forward (and two
    in backward) that change no value. Under autocast they are switched off (peft's ``cast_input_dtype_enabled``,
    what ``peft.helpers.disable_input_dtype_casting`` sets); the adapters keep their fp32 weights, cast once per
    forward by autocast's cache. DoRA and the other variants keep peft's casts (their weight norms are computed
    outside the matmuls)."""
    for m in modules:
        for layer in m.modules():
            if isinstance(layer, LoraLayer) and not getattr(layer, "lora_variant", None):
                layer.cast_input_dtype_enabled = False


class LoraMethod(MethodBase):
    """Adds adapters to the chosen components; only adapter weights (and an alongside embedding) train."""

    name = "lora"

    def __init__(self, model, cfg):
        self.model = model
        self.cfg = cfg
        lcfg = cfg.lora
        self.modules: Dict[str, Any] = {}
        for slot, module in chosen_parts(model, cfg).items():  # slot: unet (the denoiser), text_encoder(_2)
            if slot == "unet":
                custom = cfg.parts.denoiser.lora_targets == "custom"
                key = "lora.custom_targets" if custom else "parts.denoiser.lora_targets"
                targets = unet_targets(cfg, model)
                if cfg.parts.denoiser.get("lora_blocks", ""):
                    key, targets = "parts.denoiser.lora_blocks", in_blocks(module, targets,
                                                                           cfg.parts.denoiser.lora_blocks)
            else:
                key, targets = "lora.type", model.lora_targets(slot, "default")
            if lcfg.type == "oft":
                add_oft(module, targets, int(lcfg.rank), model.info.part(slot).label, key)
            else:
                _add_adapter(module, adapter_config(lcfg, targets, module), model.info.part(slot).label, key)
            self.modules[slot] = module
        for m in self.modules.values():
            for p in m.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # adapters train in fp32 whatever the base dtype
        if autocasts(cfg, getattr(model, "device", None)):
            skip_input_casts(self.modules.values())
        if lcfg.init_weights:
            self._load_init_weights(lcfg.init_weights)
        self._add_alongside_embedding(model, cfg)

    def _load_init_weights(self, path: str) -> None:
        try:
            read = getattr(self.model, "read_lora_files", None)  # a result in several files (Wan 2.2 A14B's experts)
            state = {k: v for k, v in (read(path) if read is not None else load_file(path)).items()
                     if not k.startswith("bundle_emb.")}
            own = getattr(self.model, "load_lora_state_dict", None)  # a family whose files are not kohya-shaped
            if self.cfg.lora.type == "oft":
                load_oft_into_layers(state, self._adapted(), self.model.lora_namer())
            elif own is not None and self.cfg.lora.type not in LYCORIS_TYPES:
                own(state, self._adapted())
            elif self.cfg.lora.type in LYCORIS_TYPES:
                load_lycoris_into_peft(state, modules=self._adapted(), namer=self.model.lora_namer())
            else:
                load_lora_kohya_into_peft(state, modules=self._adapted(), namer=self.model.lora_namer(),
                                          dora_format=_header(path).get("atelier_dora_format", "lycoris"))
        except (OSError, ValueError, NotImplementedError, SafetensorError) as exc:
            raise ConfigError(f"lora.init_weights '{path}' does not fit this run (lora.type = {self.cfg.lora.type}, "
                              f"rank, targets, components): {exc}", key="lora.init_weights", value=path) from None

    def _adapted(self) -> Dict[str, Any]:
        """slot -> module carrying the adapter (the embedding holder is no adapter)."""
        return {slot: m for slot, m in self.modules.items() if slot != "embedding"}

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The base model, for a while: every adapter layer runs its base layer alone (a prior_prediction
        concept's target). peft's own ``enable_adapters`` is not used: switching back on would set
        ``requires_grad`` on adapters a component's training window has frozen."""
        layers = [m for module in self._adapted().values() for m in module.modules()
                  if isinstance(m, (BaseTunerLayer, OftLayer))]
        before = [m._disable_adapters for m in layers]
        for m in layers:
            m._disable_adapters = True
        try:
            yield
        finally:
            for m, was in zip(layers, before):
                m._disable_adapters = was

    def result_suffix(self, fmt: str) -> str:
        if fmt in ("auto", "safetensors"):
            return ".safetensors"
        raise ValueError(f"output.format = {fmt} is not available for LoRA; use safetensors.")

    def adapter_state_dict(self) -> Dict[str, Any]:
        """The file's tensors: kohya LoRA/DoRA or LyCORIS LoHa/LoKr/diag-OFT keys (+ a bundled embedding)."""
        if self.cfg.lora.type == "oft":
            sd = oft_state_dict(self._adapted(), self.model.lora_namer())
            if self.embedding is not None and self.cfg.embedding.bundle:
                sd.update(bundle_embedding_state_dict(self.embedding.placeholder, self.embedding.vectors()))
            return sd
        to_state = lycoris_state_dict if self.cfg.lora.type in LYCORIS_TYPES else kohya_lora_state_dict
        custom = getattr(self.model, "lora_state_dict", None)  # a family whose files are not kohya-shaped
        if custom is not None and to_state is kohya_lora_state_dict:
            sd = custom(self._adapted(), "default")
        elif to_state is kohya_lora_state_dict:
            sd = to_state(modules=self._adapted(), namer=self.model.lora_namer(), dora_format=self.dora_format)
        else:
            sd = to_state(modules=self._adapted(), namer=self.model.lora_namer())
        if self.embedding is not None and self.cfg.embedding.bundle:
            sd.update(bundle_embedding_state_dict(self.embedding.placeholder, self.embedding.vectors()))
        return sd

    @property
    def dora_format(self) -> str:
        return str(self.cfg.output.get("dora_format", "comfyui") or "comfyui")

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        lcfg = self.cfg.lora
        sd = self.adapter_state_dict()
        meta = self.model.lora_metadata(title=Path(path).stem, resolution=_resolution(self.cfg), extra=metadata)
        if lcfg.type == "dora" and getattr(self.model, "lora_state_dict", None) is None:
            meta = {**meta, "atelier_dora_format": self.dora_format}  # how dora_scale is to be read
        if lcfg.type == "oft":  # LyCORIS' algo name; constraint 0 and no rescale (see trainer/methods/oft.py)
            save_lycoris(path, sd, meta, dtype, algo="diag-oft", network_args={"dim": lcfg.rank, "constraint": 0})
        elif lcfg.type in LYCORIS_TYPES:
            args: Dict[str, Any] = {}
            if lcfg.conv_rank is not None or lcfg.conv_alpha is not None:
                args.update(conv_dim=lcfg.conv_rank or lcfg.rank,
                            conv_alpha=lcfg.conv_alpha if lcfg.conv_alpha is not None else lcfg.alpha)
            if lcfg.type == "lokr":
                args.update(factor=lcfg.factor, decompose_both=bool(lcfg.decompose_both))
                if lcfg.get("lokr_full_matrix", False):
                    args.update(full_matrix=True)
            save_lycoris(path, sd, meta, dtype, algo=lcfg.type, network_args=args)
        else:
            split = getattr(self.model, "split_lora_file", None)  # a result in several files (Wan 2.2 A14B's experts)
            for suffix, part, part_meta in (split(sd, meta) if split is not None else [("", sd, meta)]):
                save_lora_kohya(Path(path).with_name(Path(path).stem + suffix + Path(path).suffix), part, part_meta,
                                dtype)
        self._save_alongside_embedding(Path(path), dtype, metadata)


def _header(path: str) -> Dict[str, str]:
    """A .safetensors file's metadata header."""
    with safe_open(path, framework="pt") as fh:
        return dict(fh.metadata() or {})


def _resolution(cfg) -> Optional[Any]:
    """The training resolution for the file header (an int or (w, h)); None if it cannot be told."""
    value = cfg.data.resolution
    try:
        return int(value)
    except (TypeError, ValueError):
        pass
    try:
        return parse_resolution(value)[0]
    except Exception:  # a header detail must never fail a save
        return None
