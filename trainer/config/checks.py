"""Checking a config: the field checks (choices, ranges) and each area's rules, called from here — the floor
above the areas (data, families, methods, optimizers, memory, processes, devices, paths).

- :func:`validate`: errors that stop a run before any model loads (a ConfigError naming the field; all of them
  at once, :class:`trainer.errors.ConfigErrors`, when there are several);
- :func:`cross_field_warnings`: the rules the community learned the hard way, shown before launch;
- :func:`load_config` / :func:`config_from_dict`: compose a config (``trainer.config.load``) and validate it;
- :func:`check_config`: every problem and warning of a config in one pass (the CLI's ``validate``, the page's
  Check settings).

Torch-free: the CLI's ``validate`` and the UI's Check run it without torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig

from trainer.config import preflight
from trainer.config.paths import check_path_fields
from trainer.config.fields import inner_type
from trainer.config.load import compose, compose_dict
from trainer.config.schema import AtelierConfig
from trainer.data.buckets import check_resolutions, training_side
from trainer.data.frames import check_clip_settings
from trainer.errors import ConfigError, Issue, every_error, raise_all
from trainer.families.checks import (check_family_options, guidance_warnings, part_warnings,
                                     resolution_shift_warnings)
from trainer.host import devices
from trainer.loss import check_loss, loss_warnings
from trainer.memory.rules import check_storage, precision_warnings
from trainer.memory.tiers import tier_warnings
from trainer.methods.rules import check_output_format, method_warnings, validate_method
from trainer.optim.rules import optim_warnings, validate_optim
from trainer.parallel.plan import fsdp_warnings, validate_fsdp


def _check_value(key: str, value: Any, meta: dict) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"'{key}' = {value!r} is not allowed: one of {', '.join(map(str, meta['choices']))}.",
                          key=key, value=value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = meta.get("min"), meta.get("max")
        if value != value:  # NaN
            raise ConfigError(f"'{key}' is NaN; give a number.", key=key, value=value)
        if lo is not None and value < lo or hi is not None and value > hi:
            raise ConfigError(f"'{key}' = {value!r} is out of range: allowed {lo} to {hi}.",
                              key=key, value=value)


# YAML 1.1, which OmegaConf reads, takes these words for booleans (``mixed_precision: no`` is False, and the string
# field then holds 'False'): a choice spelled so comes back as its word
_YAML_BOOLEANS = {"False": ("no", "off", "n", "false"), "True": ("yes", "on", "y", "true")}


def _choice_word(value: Any, meta: dict) -> Any:
    """``value``, or the choice YAML read as a boolean (``training.mixed_precision=no`` → 'no', not 'False')."""
    choices = meta.get("choices")
    if choices and isinstance(value, (str, bool)) and str(value) in _YAML_BOOLEANS and value not in choices:
        for word in _YAML_BOOLEANS[str(value)]:
            if word in choices:
                return word
    return value


def _walk(node: Any, cls: type, prefix: str, errors: List[ConfigError]) -> None:
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        value = node[fld.name] if fld.name in node else None
        tp = inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            _walk(value, tp, key + ".", errors)
            continue
        origin = getattr(tp, "__origin__", None)
        if origin in (list, List):
            item_tp = tp.__args__[0]
            if dataclasses.is_dataclass(item_tp) and value is not None:
                for i, item in enumerate(value):
                    _walk(item, item_tp, f"{key}.{i}.", errors)
            continue
        word = _choice_word(value, fld.metadata)
        if word is not value:
            node[fld.name] = value = word
        try:
            _check_value(key, value, fld.metadata)
        except ConfigError as exc:
            errors.append(exc)


def load_config(path: Optional[str | os.PathLike] = None, overrides: Iterable[str] = (),
                preset: Optional[str] = None) -> DictConfig:
    """Preset ⊕ user file ⊕ --set overrides, merged into the schema and validated; every problem found is
    raised together (:class:`ConfigErrors` for several)."""
    problems: List[ConfigError] = []
    cfg = compose(path, overrides, preset, problems=problems)
    raise_all(_unique(problems + validation_errors(cfg, after=problems)))
    return cfg


def config_from_dict(data: dict | DictConfig) -> DictConfig:
    """Merge a plain mapping (e.g. from the web UI's form) into the schema and validate it (errors as
    :func:`load_config`)."""
    problems: List[ConfigError] = []
    cfg = compose_dict(data, problems=problems)
    raise_all(_unique(problems + validation_errors(cfg, after=problems)))
    return cfg


def check_config(path: Optional[str | os.PathLike] = None, overrides: Iterable[str] = (),
                 preset: Optional[str] = None, data: Optional[dict | DictConfig] = None
                 ) -> Tuple[Optional[DictConfig], List[Issue]]:
    """Every problem of a config in one pass — ``validate``'s and the page's Check settings: what composing
    refused (unknown keys, wrong types and shapes), the field and cross-field rules, and the warnings with the
    files and folders a run would reject. Returns (the config, or None when it has errors; the issues).
    A file that cannot be read at all raises ConfigError."""
    problems: List[ConfigError] = []
    cfg = compose_dict(data, problems=problems) if data is not None else \
        compose(path, overrides, preset, problems=problems)
    errors = _unique(problems + validation_errors(cfg, after=problems))
    issues = [Issue(e.key or "", str(e), "error") for e in errors]
    issues += cross_field_warnings(cfg, tolerant=bool(errors))
    return (None if errors else cfg), issues


def validate(cfg: DictConfig) -> None:
    """Field checks (choices, ranges) and the hard cross-field rules. Raises ConfigError (:class:`ConfigErrors`
    naming each problem when there are several)."""
    raise_all(validation_errors(cfg))


def validation_errors(cfg: DictConfig, after: Sequence[ConfigError] = ()) -> List[ConfigError]:
    """Every problem :func:`validate` finds, in order, each once. Each rule runs even when an earlier one failed;
    ``after``: problems already found (composing), with which a rule may trip on a value left out or already named
    (only a ConfigError of such a rule counts then)."""
    errors: List[ConfigError] = []
    _walk(cfg, AtelierConfig, "", errors)
    for rule in _RULES:
        try:
            rule(cfg)
        except ConfigError as exc:
            errors += every_error(exc)
        except Exception:
            if not (errors or after):
                raise
    return _unique(errors)


def _unique(errors: Iterable[ConfigError]) -> List[ConfigError]:
    seen, out = set(), []
    for e in errors:
        if (e.key, str(e)) not in seen:
            seen.add((e.key, str(e)))
            out.append(e)
    return out


def _check_gpu_ids(cfg: DictConfig) -> None:
    ids = [i.strip() for i in str(cfg.general.gpu_ids or "").split(",") if i.strip()]
    for gpu in ids:
        if not gpu.isdigit():
            raise ConfigError(f"general.gpu_ids = {cfg.general.gpu_ids!r}: {gpu!r} is not a GPU number. List GPU "
                              "numbers separated by commas (0,1), or leave it empty for the first GPUs.",
                              key="general.gpu_ids", value=cfg.general.gpu_ids)


def _check_something_trains(cfg: DictConfig) -> None:
    if cfg.training.method in ("lora", "finetune") and not any(part.train for part in cfg.parts.values()):
        raise ConfigError("Nothing to train: turn on parts.denoiser.train and/or a text encoder's train "
                          "(parts.text_encoder_1.train …).", key="parts.denoiser.train", value=False)


def _check_concept_caption_files(cfg: DictConfig) -> None:
    raise_all([ConfigError(f"Concept {i} ('{c.name or c.path}') reads captions from one file, but "
                           f"data.concepts.{i}.caption_file is empty.", key=f"data.concepts.{i}.caption_file")
               for i, c in enumerate(cfg.data.concepts) if c.caption_source == "concept_file" and not c.caption_file])


def _check_sample_sizes(cfg: DictConfig) -> None:
    raise_all([ConfigError(f"sampling.prompts.{i}.{dim} = {s[dim]} must be a multiple of 8.",
                           key=f"sampling.prompts.{i}.{dim}", value=s[dim])
               for i, s in enumerate(cfg.sampling.prompts) for dim in ("width", "height") if s[dim] % 8])


def _check_compile_mode(cfg: DictConfig) -> None:
    mode = cfg.training.get("compile_mode", "default")
    if mode in ("reduce-overhead", "max-autotune") and cfg.general.device in ("cpu", "mps"):
        raise ConfigError(f"training.compile_mode = {mode} records CUDA graphs, which need a CUDA GPU "
                          f"(general.device = {cfg.general.device}): use default.", key="training.compile_mode",
                          value=mode)
    if mode in ("reduce-overhead", "max-autotune") and cfg.training.gradient_checkpointing:
        raise ConfigError(f"training.compile_mode = {mode} records CUDA graphs, which are not supported together "
                          "with activation checkpointing yet (PyTorch issue 154306): turn off "
                          "training.gradient_checkpointing or use default.",
                          key="training.compile_mode", value=mode)
    swap = cfg.parts.denoiser.get("blocks_to_swap", 0) or 0
    if cfg.training.get("compile") and cfg.training.get("compile_scope", "blocks") == "denoiser" and swap:
        raise ConfigError(f"training.compile_scope = denoiser compiles the whole denoiser as one graph, and "
                          f"parts.denoiser.blocks_to_swap = {swap} moves weights to the GPU between its blocks' "
                          "calls, which one graph cannot do: use compile_scope blocks (each block compiled, the swaps "
                          "between them) or no swapped blocks.", key="training.compile_scope", value="denoiser")


# validate's rules after the field checks, in the order their messages are shown
_RULES: Tuple[Callable[[DictConfig], None], ...] = (
    check_path_fields,  # paths a file system takes, plain run and result names
    check_family_options,  # options the model's family or its objective cannot use
    _check_gpu_ids,
    _check_something_trains,
    _check_concept_caption_files,
    check_resolutions,  # data.resolution and the concepts' own
    check_clip_settings,  # frame counts the family's VAE takes; no clips for an image family
    check_output_format,  # what the method can write
    _check_sample_sizes,
    _check_compile_mode,
    check_loss,  # timestep range, Huber schedule
    check_storage,  # fp8/NF4 storage and block swapping
    validate_method,  # LoRA variants and embeddings
    validate_optim,
    validate_fsdp,  # what cannot work on FSDP's sharded weights (EMA, stochastic rounding, ...)
)


def cross_field_warnings(cfg: DictConfig, tolerant: bool = False) -> List[Issue]:
    """The rules the community learned the hard way: shown before launch, never blocking. ``tolerant`` (a config
    with errors already named): a rule that trips on a value named there is skipped and the others still run."""
    out: List[Issue] = []
    for rule in _WARNING_RULES:
        try:
            out += rule(cfg)
        except ConfigError as exc:
            if not tolerant:
                raise
            out += [Issue(e.key or "", str(e), "error") for e in every_error(exc)]
        except Exception:
            if not tolerant:
                raise
    return out


def _sample_size_warnings(cfg: DictConfig) -> List[Issue]:
    res = training_side(cfg)
    return [Issue(f"sampling.prompts.{i}.width", f"Sample size {s.width}x{s.height} is far from the training "
                  f"resolution {res}: samples may look like noise even when training works.")
            for i, s in enumerate(cfg.sampling.prompts)
            if max(s.width, s.height) < 0.6 * res or min(s.width, s.height) > 1.6 * res]


def _concept_warnings(cfg: DictConfig) -> List[Issue]:
    if not any(c.enabled for c in cfg.data.concepts):
        return [Issue("data.concepts", "No enabled concept: add a folder of images to train on.", level="error")]
    return []


def _path_warnings(cfg: DictConfig) -> List[Issue]:  # files and folders train would reject
    return [Issue(key, message, level="error") for key, message in preflight.path_problems(cfg)]


def _tier_warnings(cfg: DictConfig) -> List[Issue]:  # a memory tier's settings undone
    return [Issue(key, message) for key, message in tier_warnings(cfg)]


def _device_warnings(cfg: DictConfig) -> List[Issue]:
    if cfg.general.device == "mps" or (cfg.general.device == "auto" and devices.is_apple_silicon()):
        return [Issue(key, message, level=level) for key, message, level in devices.device_problems(cfg, "mps")]
    return []


def _text_encoder_lr_warnings(cfg: DictConfig) -> List[Issue]:
    t, te1 = cfg.training, cfg.parts.text_encoder_1
    if te1.train and t.method == "lora" and te1.learning_rate is None and t.learning_rate > 5e-4:
        return [Issue("parts.text_encoder_1.learning_rate",
                      "The text encoder usually wants a lower LR than the denoiser (e.g. 5e-5).")]
    return []


def issue_line(issue: Issue) -> str:
    """One line for the terminal, ``level: key: message``, the key left out when the message names it already
    (most do: "data.concepts.0.path: folder … does not exist"), so each field is named once."""
    if issue.key and not re.search(rf"(?<![\w.]){re.escape(issue.key)}(?!\w|\.\w)", issue.message):
        return f"{issue.level}: {issue.key}: {issue.message}"
    return f"{issue.level}: {issue.message}"


def _ema_warnings(cfg: DictConfig) -> List[Issue]:
    e, t = cfg.ema, cfg.training
    if e.enabled and not e.warmup and t.max_steps:
        updates = t.max_steps // e.update_every_n_steps
        span = 1.0 / max(1e-12, 1.0 - e.decay)
        if updates < span:
            return [Issue("ema.decay", f"EMA decay {e.decay:g} averages over about {span:.0f} updates, but the "
                                       f"run makes only {updates}: the EMA result will lag far behind "
                                       "training. Lower the decay (e.g. 0.99).")]
    return []


# the warning rules, in the order their lines are shown
_WARNING_RULES: Tuple[Callable[[DictConfig], List[Issue]], ...] = (
    method_warnings,  # alpha ≤ rank, adapter dropouts, embedding placeholder in prompts, ...
    _sample_size_warnings,
    _concept_warnings,
    _path_warnings,
    optim_warnings,  # optimizer and LR-schedule rules (Prodigy LR 1, REX warm-up, ...)
    _tier_warnings,
    _device_warnings,
    _text_encoder_lr_warnings,
    loss_warnings,  # zero terminal SNR without v-prediction, min-SNR with debiasing, ...
    _ema_warnings,
    precision_warnings,  # stochastic rounding, fp16 weights trained directly
    part_warnings,  # settings of parts this family does not have
    guidance_warnings,  # model.guidance_scale on a model without a guidance embedding
    resolution_shift_warnings,  # loss.resolution_shift on a model whose scheduler has a fixed shift
    fsdp_warnings,  # general.distributed = fsdp on a LoRA/embedding run, optimizers on sharded weights
)

