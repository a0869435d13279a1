"""FSDP for full fine-tunes: the UNet's weights, gradients and optimizer state sharded over the processes.

Why it is shaped like this:

- **Chosen by config or by the launcher.** ``general.distributed = fsdp`` with its ``general.fsdp_*``
  settings (named as in ``accelerate config``), or ``accelerate launch --config_file fsdp.yaml``, which
  hands its settings to the processes as ACCELERATE_USE_FSDP / FSDP_* variables: the launcher wins
  (:func:`fsdp_from_launcher`), as it does for the process count. Only full fine-tunes that train the
  UNet shard; LoRA and embedding runs stay on DDP (their trained weights are small).
- **accelerate's plugin, torch's ``fully_shard``.** :func:`fsdp_plugin` builds accelerate's
  ``FullyShardedDataParallelPlugin`` (FSDP2, which accelerate recommends and which runs on CPU/gloo
  too); :class:`FSDPShards` applies it with torch's ``fully_shard`` in accelerate's order (the blocks
  its auto-wrap policy picks, then the root) instead of ``accelerator.prepare``: accelerate 1.15
  switches to FSDP only for GPU process types (a CPU run stays MULTI_CPU and would get DDP), and its
  FSDP2 ``prepare`` takes one model whose parameters must be all of the optimizer's, while text encoders
  and embeddings train beside the UNet here. The optimizer is built afterwards, on the sharded weights.
- **Gradients.** FSDP reduce-scatters the UNet's gradients in backward (averaged, like DDP);
  the other trained modules (text encoders) are DDP-wrapped (``trainer.parallel.distributed.DDPGradients``), and
  ``trainer.parallel.distributed.GradientSync`` carries the loss, the stop flag and any weight no module owns. Clipping goes through ``accelerator.clip_grad_norm_``, which is DTensor-aware.
- **Same files as one process.** Backups gather whole weights and a whole optimizer state on rank 0 in
  the single-process layout (:func:`full_tensor`, :func:`full_optimizer_state`), and loading gives each
  process its piece (:func:`load_full_into`, :func:`shard_optimizer_state`): a backup resumes with or
  without FSDP on any number of processes. Results are saved from an unsharded CPU copy on rank 0
  (:meth:`FSDPShards.plain_copy`). Sampling and validation run on every process together.
- **Refused** where sharded weights cannot work (:func:`validate_fsdp`): EMA, stochastic rounding,
  freezing the UNet mid-run, fused backward.

The config rules (:func:`validate_fsdp`, :func:`fsdp_warnings`) and the launcher settings run without torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from trainer.parallel.distributed import launched

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
    from trainer.errors import ConfigError
    try:
        import yaml
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
    from trainer.errors import ConfigError
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
    for key in ("stop_after_steps", "stop_after_epochs"):
        if cfg.parts.denoiser.get(key):
            raise ConfigError(f"parts.denoiser.{key}: {why}, and a sharded UNet cannot be frozen in the middle of the "
                              f"run. Set it to 0 (train the UNet throughout), or use general.distributed = ddp.",
                              key=f"parts.denoiser.{key}", value=cfg.parts.denoiser.get(key))


def fsdp_warnings(cfg) -> list:
    """``general.distributed = fsdp`` where it does not apply, and optimizers not made for sharded weights."""
    from trainer.errors import Issue
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
    from trainer.optim.registry import OPTIMIZERS
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
    from omegaconf import OmegaConf
    settings, notes = _fsdp_settings(_launcher_values())
    changes = []
    for key, value in settings.items():
        if OmegaConf.select(cfg, key) != value:
            OmegaConf.update(cfg, key, value)
            changes.append(f"{key} = {value}")
    return changes, notes


def plan_fsdp(cfg, world: int, cpu: bool, warn, log=None):
    """The accelerate ``FullyShardedDataParallelPlugin`` (FSDP2) when this process shards the UNet, else
    None (gradients are averaged as DDP does). Also takes the launcher's FSDP settings and checks the
    rules with the real process count."""
    changes, notes = fsdp_from_launcher(cfg)
    if changes and log is not None:
        log("FSDP settings from the accelerate launch config: " + ", ".join(changes))
    for note in notes:
        warn(f"FSDP: {note}.")
    plugin = None
    if world > 1 and shards_unet(cfg):
        validate_fsdp(cfg, world)
        plugin = fsdp_plugin(cfg, cpu, warn)
    if plugin is None or cpu:
        # accelerate would build its own (FSDP1) plugin from the launcher's environment; on CPU it
        # ignores FSDP anyway (MULTI_CPU), so the UNet is sharded by FSDPShards only
        os.environ["ACCELERATE_USE_FSDP"] = "false"
    return plugin


def fsdp_plugin(cfg, cpu: bool, warn):
    """accelerate's plugin from ``general.fsdp_*``: FSDP2, full state dicts, no wrapping by accelerate."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    g = cfg.general
    offload = bool(g.fsdp_offload_params)
    if offload and cpu:
        offload = False
        if g.device != "cpu":  # general.device = cpu: fsdp_warnings said so before launch
            warn("general.fsdp_offload_params has no effect on CPU processes: the weights already live in RAM.")
    classes = [c.strip() for c in str(g.fsdp_transformer_layer_cls_to_wrap or "").split(",") if c.strip()]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=g.fsdp_sharding_strategy == "full_shard", cpu_offload=offload,
        auto_wrap_policy=g.fsdp_auto_wrap_policy, transformer_cls_names_to_wrap=classes or None,
        min_num_params=int(g.fsdp_min_num_params), state_dict_type="FULL_STATE_DICT",
        activation_checkpointing=False, cpu_ram_efficient_loading=False)
    if cfg.training.mixed_precision != "no":  # what accelerate sets on GPUs; the same on CPU
        plugin.set_mixed_precision(cfg.training.mixed_precision)
    return plugin


class FSDPShards:
    """A module sharded over the processes with FSDP2 as ``plugin`` says: the blocks its auto-wrap
    policy picks become units gathered one at a time, then the module itself (accelerate's
    ``fsdp2_prepare_model`` order). Build the optimizer afterwards, on the sharded parameters."""

    def __init__(self, module, plugin, device, world: int):
        import torch
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        self.plain_class = type(module)  # fully_shard swaps in an FSDP subclass
        self.config = getattr(module, "config", None)
        mesh = init_device_mesh(device.type, (world,))
        kwargs = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                      mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
        policy = fsdp2_prepare_auto_wrap_policy(plugin, module)
        self.units = 0
        for sub in (get_module_children_bottom_up(module)[:-1] if policy is not None else []):
            # size_based_wrap also picks ModuleLists, which fully_shard refuses (no forward: never called)
            if policy(sub) and not isinstance(sub, FSDPModule) and type(sub).forward is not torch.nn.Module.forward:
                fully_shard(sub, **kwargs)
                self.units += 1
        # the root gathers what no unit holds; torch picks its reshard_after_forward (False for the root)
        fully_shard(module, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
        self.module = module
        self._ids = {id(p) for p in module.parameters()}

    def owns(self, p) -> bool:
        return id(p) in self._ids

    def full_state_dict(self, keep: bool) -> Dict[str, Any]:
        """The module's whole state dict on the CPU (every process takes part; only ``keep`` collects)."""
        out = {}
        for name, t in self.module.state_dict().items():
            full = full_tensor(t.detach())
            if keep:
                out[name] = full.cpu()
        return out

    def plain_copy(self, keep: bool):
        """Rank 0 (``keep``): an unsharded copy of the module on the CPU, from the gathered weights, for
        code that reads whole weights (the exporters); the others take part in gathering and get None."""
        state = self.full_state_dict(keep)
        if not keep:
            return None
        from accelerate import init_empty_weights
        with init_empty_weights():
            plain = self.plain_class.from_config(self.config) if self.config is not None else None
        if plain is None:
            raise RuntimeError(f"cannot rebuild an unsharded {self.plain_class.__name__} (no config)")
        plain.load_state_dict(state, assign=True)
        return plain.eval().requires_grad_(False)


def full_tensor(t):
    """The whole of ``t``: a sharded DTensor is gathered from all processes (a collective: every process
    must call it, in the same order); anything else passes through."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_optimizer_state(state_dict: Dict[str, Any], keep: bool) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with sharded state gathered to whole CPU tensors: the same layout as a
    single process's, so the backup resumes anywhere. Every process calls it; ``keep`` collects."""
    import torch
    state = {}
    for i in sorted(state_dict["state"]):  # the same order on every process: the gathers pair up
        entry = {}
        for k, v in state_dict["state"][i].items():
            full = full_tensor(v) if torch.is_tensor(v) else v
            entry[k] = full.cpu() if torch.is_tensor(full) else full
        if keep:
            state[i] = entry
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _local_piece(full, like):
    """This process's piece of the whole tensor ``full``, placed as the DTensor ``like`` is."""
    from torch.distributed.tensor import distribute_tensor
    mesh = like.device_mesh
    return distribute_tensor(full.to(mesh.device_type), mesh, like.placements, src_data_rank=None).to_local()


def load_full_into(p, full) -> None:
    """Copy a whole weight (from a backup) into ``p``: a sharded DTensor takes its piece (under no_grad)."""
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor):
        local = p.to_local()
        local.copy_(_local_piece(full.to(dtype=p.dtype), p))
    else:
        p.copy_(full.to(p.device, p.dtype))


def shard_optimizer_state(optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a whole-tensor state (any backup): the state of sharded
    weights becomes DTensors placed like the weights, as the optimizer makes them itself."""
    import torch
    from torch.distributed.tensor import DTensor
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            st = optimizer.state.get(p, {})
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                    d = torch.zeros_like(p, dtype=v.dtype)
                    d.to_local().copy_(_local_piece(v, p))
                    st[k] = d
