"""Which process layout a run gets, decided from the config and the launcher without torch: where this process is
(:func:`env_rank_world`, :func:`launched`: what torchrun / ``accelerate launch`` set), FSDP asked for (by
``general.distributed``, an accelerate config file, or ``accelerate launch``'s environment, which wins) or DDP, the
FSDP settings under accelerate's names, and the rules of sharded weights (``trainer.config.checks`` calls
:func:`validate_fsdp` and :func:`fsdp_warnings`; every process checks again with its real process count).
The sharding itself is :mod:`trainer.parallel.fsdp`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from trainer.errors import ConfigError, Issue
from trainer.optim.registry import OPTIMIZERS


def env_rank_world() -> Tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun / accelerate launch set them)."""
    try:
        return int(os.environ.get("RANK", "0")), max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def launched() -> bool:
    """True inside a process started by torchrun / accelerate launch (so never launch again)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


FSDP_STRATEGIES = {  # accelerate's FSDP1 sharding strategies (names and 1-based numbers) and FSDP2 booleans
    "TRUE": "full_shard", "FULL_SHARD": "full_shard", "1": "full_shard",
    "FALSE": "shard_grad_op", "SHARD_GRAD_OP": "shard_grad_op", "2": "shard_grad_op",
    "NO_SHARD": "no_shard", "3": "no_shard",
    "HYBRID_SHARD": "full_shard", "4": "full_shard", "HYBRID_SHARD_ZERO2": "shard_grad_op", "5": "shard_grad_op",
}


def accelerate_config_file(cfg) -> Optional[dict]:
    """The accelerate config named by ``general.accelerate_config`` (YAML or JSON), or None when unset."""
    path = str(cfg.general.get("accelerate_config", "") or "").strip()
    if not path:
        return None
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"general.accelerate_config = {path!r} cannot be read ({exc.strerror or exc}): give the "
                          "file `accelerate config` wrote (e.g. ~/.cache/huggingface/accelerate/default_config.yaml) "
                          "or leave it empty.", key="general.accelerate_config", value=path) from None
    except Exception as exc:
        raise ConfigError(f"general.accelerate_config = {path!r} is not a YAML/JSON accelerate config: {exc}",
                          key="general.accelerate_config", value=path) from None
    if not isinstance(data, dict):
        raise ConfigError(f"general.accelerate_config = {path!r} is not an accelerate config (no mapping).",
                          key="general.accelerate_config", value=path)
    return data


def _launcher_fsdp() -> bool:
    """Started by ``accelerate launch`` with an FSDP config (or ``--use_fsdp``)."""
    return launched() and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def _launcher_values() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}


def _file_values(conf: dict) -> Dict[str, str]:
    """An accelerate config file's ``fsdp_config`` under the names its launcher passes them (FSDP_*)."""
    names = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}
    fsdp = conf.get("fsdp_config") or {}
    return {names.get(k, ("" if k.startswith("fsdp_") else "FSDP_") + k.upper()): str(v)
            for k, v in fsdp.items() if v is not None} if isinstance(fsdp, dict) else {}


def wants_fsdp(cfg) -> bool:
    """FSDP asked for: by a launch through ``accelerate launch`` with an FSDP config (it wins), by an
    accelerate config file with ``distributed_type: FSDP`` in ``general.accelerate_config``, or by
    ``general.distributed = fsdp``. An FSDP config with sharding strategy NO_SHARD means DDP."""
    if _launcher_fsdp():
        return _fsdp_settings(_launcher_values())[0]["general.distributed"] == "fsdp"
    conf = accelerate_config_file(cfg)
    if conf and str(conf.get("distributed_type", "")).upper() == "FSDP":
        return _fsdp_settings(_file_values(conf))[0]["general.distributed"] == "fsdp"
    return str(cfg.general.get("distributed", "ddp")) == "fsdp"


def shards_unet(cfg) -> bool:
    """FSDP asked for, and a run it applies to: a full fine-tune that trains the UNet."""
    return wants_fsdp(cfg) and cfg.training.method == "finetune" and bool(cfg.parts.denoiser.train)


def validate_fsdp(cfg, world: Optional[int] = None) -> None:
    """Hard errors (ConfigError): features that cannot work on sharded UNet weights. Checked before
    launch with general.num_processes and again by every process with the real process count."""
    accelerate_config_file(cfg)  # a bad general.accelerate_config fails before launch
    n = world if world is not None else int(cfg.general.get("num_processes", 1) or 1)
    if n <= 1 or not shards_unet(cfg):
        return
    why = "with FSDP (general.distributed = fsdp, or an FSDP accelerate config) the UNet is sharded over " \
          "the processes"
    if cfg.ema.enabled:
        raise ConfigError(f"ema.enabled: {why}, and the EMA copy of the whole model cannot follow them. Turn EMA "
                          "off, or train with DDP (general.distributed = ddp) if the model fits each GPU.",
                          key="ema.enabled", value=True)
    if cfg.precision.get("stochastic_rounding"):
        raise ConfigError(f"precision.stochastic_rounding: {why}, and its hooks swap each weight's storage, which "
                          "FSDP owns. Train fp32 weights (parts.denoiser.dtype = fp32) with training.mixed_precision = "
                          "bf16 instead, or use general.distributed = ddp.", key="precision.stochastic_rounding",
                          value=True)
    if cfg.training.get("fused_backward"):
        raise ConfigError(f"training.fused_backward: {why}, and FSDP averages each gradient after backward. Turn "
                          "fused_backward off.", key="training.fused_backward", value=True)
    if cfg.training.get("compile") and cfg.training.get("compile_scope", "blocks") == "denoiser":
        raise ConfigError(f"training.compile_scope = denoiser: {why}, and FSDP gathers each block's weights around "
                          "its call, which one graph of the whole denoiser cannot hold. Use compile_scope blocks (each "
                          "block compiled inside its gathering), or general.distributed = ddp.",
                          key="training.compile_scope", value="denoiser")
    for key in ("stop_after_steps", "stop_after_epochs"):
        if cfg.parts.denoiser.get(key):
            raise ConfigError(f"parts.denoiser.{key}: {why}, and a sharded UNet cannot be frozen in the middle of the "
                              f"run. Set it to 0 (train the UNet throughout), or use general.distributed = ddp.",
                              key=f"parts.denoiser.{key}", value=cfg.parts.denoiser.get(key))


def fsdp_warnings(cfg) -> list:
    """``general.distributed = fsdp`` where it does not apply, and optimizers not made for sharded weights."""
    out = []
    if not wants_fsdp(cfg):
        return out
    t, g = cfg.training, cfg.general
    key = "general.distributed" if str(g.get("distributed", "ddp")) == "fsdp" else "general.accelerate_config"
    if t.method != "finetune":
        out.append(Issue(key, f"FSDP shards full fine-tunes only; this {t.method} run uses DDP (every process holds "
                              "the model; the trained adapter or embedding is small)."))
        return out
    if not cfg.parts.denoiser.train:
        out.append(Issue(key, "FSDP shards the UNet, which this fine-tune does not train: it uses DDP."))
        return out
    spec = OPTIMIZERS.get(t.optimizer.name)
    if spec is not None and spec.library != "torch":
        out.append(Issue("training.optimizer.name",
                         f"With FSDP the optimizer steps sharded (DTensor) weights; {t.optimizer.name} "
                         f"({spec.library}) may not support them (8-bit optimizers do not; Prodigy/D-Adaptation "
                         "would estimate per shard). torch optimizers (adamw, adam, sgd, adafactor, ...) do."))
    if g.get("fsdp_offload_params") and g.device == "cpu":
        out.append(Issue("general.fsdp_offload_params", "general.fsdp_offload_params has no effect on CPU "
                                                        "processes: the weights already live in RAM."))
    return out


def _fsdp_settings(values: Dict[str, str]) -> Tuple[Dict[str, Any], List[str]]:
    """accelerate's FSDP settings (as its launcher passes them: FSDP_* names, string values) → Atelier
    settings, and notes on what Atelier does differently."""
    out: Dict[str, Any] = {"general.distributed": "fsdp"}
    notes: List[str] = []
    version = str(values.get("FSDP_VERSION", "1")).strip()
    reshard = str(values.get("FSDP_RESHARD_AFTER_FORWARD", "")).strip().upper()
    legacy = str(values.get("FSDP_SHARDING_STRATEGY", "")).strip().upper()
    pick = reshard if version == "2" or reshard not in ("", "TRUE", "FALSE") else legacy or reshard
    if version != "2":
        notes.append(f"the accelerate config asks for FSDP version {version}; Atelier shards with FSDP2 "
                     "(fully_shard) and maps its settings")
    strategy = FSDP_STRATEGIES.get(pick)
    if strategy == "no_shard":
        out["general.distributed"] = "ddp"
        notes.append("sharding strategy NO_SHARD is plain data parallelism: the run uses DDP")
    elif strategy:
        out["general.fsdp_sharding_strategy"] = strategy
        if pick.startswith("HYBRID") or pick in ("4", "5"):
            notes.append(f"{pick} (sharding within each node) is not supported: shards over all processes")
    if "FSDP_OFFLOAD_PARAMS" in values:
        out["general.fsdp_offload_params"] = str(values["FSDP_OFFLOAD_PARAMS"]).strip().lower() in ("true", "1")
    policy = str(values.get("FSDP_AUTO_WRAP_POLICY", "") or "").strip().lower()
    if policy in ("transformer_based_wrap", "size_based_wrap", "no_wrap"):
        out["general.fsdp_auto_wrap_policy"] = policy
    classes = values.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if classes not in (None, "", "None"):
        out["general.fsdp_transformer_layer_cls_to_wrap"] = str(classes).strip()
    try:
        if values.get("FSDP_MIN_NUM_PARAMS") not in (None, ""):
            out["general.fsdp_min_num_params"] = int(float(values["FSDP_MIN_NUM_PARAMS"]))
    except ValueError:
        pass
    if str(values.get("FSDP_ACTIVATION_CHECKPOINTING", "")).strip().lower() in ("true", "1"):
        out["training.gradient_checkpointing"] = True
    if str(values.get("FSDP_STATE_DICT_TYPE", "")).strip().upper() == "SHARDED_STATE_DICT":
        notes.append("backups gather full weights on rank 0 (not SHARDED_STATE_DICT), so they resume on any "
                     "number of processes")
    return out, notes


def fsdp_from_launcher(cfg) -> Tuple[List[str], List[str]]:
    """``accelerate launch --config_file fsdp.yaml`` (or ``--use_fsdp``) hands its FSDP settings to the
    processes as ACCELERATE_USE_FSDP / FSDP_* environment variables. The launcher wins, as for the
    process count: they are written into the config. Returns ("key = value" changes, notes)."""
    if not _launcher_fsdp():
        return [], []
    settings, notes = _fsdp_settings(_launcher_values())
    changes = []
    for key, value in settings.items():
        if OmegaConf.select(cfg, key) != value:
            OmegaConf.update(cfg, key, value)
            changes.append(f"{key} = {value}")
    return changes, notes
