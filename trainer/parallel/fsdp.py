"""FSDP for full fine-tunes: the UNet's weights, gradients and optimizer state sharded over the processes.

Why it is shaped like this:

- **Chosen by config or by the launcher.** ``general.distributed = fsdp`` with its ``general.fsdp_*``
  settings (named as in ``accelerate config``), or ``accelerate launch --config_file fsdp.yaml``, which
  hands its settings to the processes as ACCELERATE_USE_FSDP / FSDP_* variables: the launcher wins
  (:func:`trainer.parallel.plan.fsdp_from_launcher`), as it does for the process count. Only full fine-tunes that train the
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
- **Refused** where sharded weights cannot work (:func:`trainer.parallel.plan.validate_fsdp`): EMA, stochastic
  rounding, freezing the UNet mid-run, fused backward.

Whether a run shards, the launcher's settings and those rules are :mod:`trainer.parallel.plan` (torch-free).
"""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
from accelerate import init_empty_weights
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.parallel.plan import fsdp_from_launcher, shards_unet, validate_fsdp


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
        with init_empty_weights():
            plain = self.plain_class.from_config(self.config) if self.config is not None else None
        if plain is None:
            raise RuntimeError(f"cannot rebuild an unsharded {self.plain_class.__name__} (no config)")
        plain.load_state_dict(state, assign=True)
        return plain.eval().requires_grad_(False)


def full_tensor(t):
    """The whole of ``t``: a sharded DTensor is gathered from all processes (a collective: every process
    must call it, in the same order); anything else passes through."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_optimizer_state(state_dict: Dict[str, Any], keep: bool) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with sharded state gathered to whole CPU tensors: the same layout as a
    single process's, so the backup resumes anywhere. Every process calls it; ``keep`` collects."""
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
    mesh = like.device_mesh
    return distribute_tensor(full.to(mesh.device_type), mesh, like.placements, src_data_rank=None).to_local()


def load_full_into(p, full) -> None:
    """Copy a whole weight (from a backup) into ``p``: a sharded DTensor takes its piece (under no_grad)."""
    if isinstance(p, DTensor):
        local = p.to_local()
        local.copy_(_local_piece(full.to(dtype=p.dtype), p))
    else:
        p.copy_(full.to(p.device, p.dtype))


def shard_optimizer_state(optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a whole-tensor state (any backup): the state of sharded
    weights becomes DTensors placed like the weights, as the optimizer makes them itself."""
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
