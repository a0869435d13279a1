"""One object says how the processes of a run work together: one process, several with torch's DDP, or
several with the denoiser sharded by FSDP. The loop asks it and never branches on the process count.

What differs between the three, and nothing else, lives here:

- which batches this process trains (its slice of each planned global batch, see ``trainer.parallel.distributed``);
- how gradients are averaged (DDP's hooks in backward, FSDP's reduce-scatter, a small all-reduce for the
  loss, the stop flag and weights no forward owns) and when a micro-batch skips it (accumulation);
- who evaluates, samples and saves (rank 0; every process together when the denoiser is sharded), and
  who writes (rank 0);
- weights and optimizer state whole for backups and results (FSDP gathers them), and back in pieces on
  resume.

The mechanisms stay in :mod:`trainer.parallel.distributed` (batch slicing, DDP wrapping, failures) and
:mod:`trainer.parallel.fsdp` (sharding, gathering).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from trainer.parallel.distributed import (
    DDPGradients,
    GradientSync,
    PeerLost,
    collective_failure,
    iter_shard,
    weight_grad_average,
)
from trainer.parallel.fsdp import FSDPShards, full_optimizer_state, shard_optimizer_state

log = logging.getLogger("atelier")


class SingleProcess:
    """One process: every question has the trivial answer."""

    name = "none"
    sharded = False  # FSDP: validation, sampling and saving run on every process together
    fsdp = None  # trainer.parallel.fsdp.FSDPShards when the denoiser is sharded

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @property
    def is_main(self) -> bool:
        """This process writes events, logs, samples, backups and results."""
        return self.rank == 0

    @property
    def evaluates_here(self) -> bool:
        """This process runs validation, sampling and the result's export."""
        return self.is_main or self.sharded

    @property
    def stop_rides_the_sync(self) -> bool:
        """A stop request waits for the next gradient sync, so every process stops at the same step."""
        return self.world > 1

    # --- set-up -----------------------------------------------------------------------------------
    def shard(self, method, plugin, device) -> None:
        """Before the optimizer is built: shard what FSDP shards (nothing here)."""

    def attach(self, method, optimizer, groups, device) -> None:
        """After the optimizer is built: hook up gradient averaging (nothing here)."""

    def data_config(self, cfg, global_micro_batch: int):
        """The config the data pipeline plans with: every process plans the same global batches."""
        return cfg

    # --- the step ---------------------------------------------------------------------------------
    def batches(self, data, epoch: int, start: int, stop: int) -> Iterator[Tuple[int, dict]]:
        return data.iter_batches(epoch, start, stop)

    def micro_batch(self, last_of_step: bool):
        """Around one micro-batch's forward and backward."""
        return contextlib.nullcontext()

    def end_step(self, loss: float, stop: bool) -> Tuple[float, bool]:
        """After the step's last backward, before the optimizer: (the loss over all processes, stop?)."""
        return loss, stop

    def weights_touched(self) -> None:
        """Rank 0 swapped weights to sample or save (schedule-free, EMA): start the next sync from its."""

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer to a question every process must answer alike (the UI asked for a backup)."""
        return flag

    # --- whole weights (FSDP gathers; otherwise they are whole already) ---------------------------
    def full_optimizer_state(self, optimizer) -> Optional[dict]:
        """The optimizer's state as one process holds it (None: take ``optimizer.state_dict()``)."""
        return None

    def shard_optimizer_state(self, optimizer) -> None:
        """After loading a whole optimizer state: keep this process's pieces."""

    @contextlib.contextmanager
    def whole_denoiser(self, model):
        """While exporting: the model's denoiser holds whole weights on the process that writes."""
        yield

    def training_entry(self, module):
        """The module a training step's call of ``module`` runs through (``training.compile_scope`` denoiser
        compiles it): ``module`` itself, or DDP's entry around it."""
        return module


class DistributedData(SingleProcess):
    """Several processes, each training its slice of every global batch; gradients averaged by torch's
    DDP in backward (``trainer.parallel.distributed.DDPGradients``), or per weight inside backward with
    ``training.fused_backward``; the step's loss and the stop flag in one small all-reduce."""

    name = "ddp"

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world)
        self.ddp = None  # DDPGradients
        self.grad_sync = None  # GradientSync: loss, stop flag, weights no forward owns
        self.weights_sync = None  # GradientSync over every trained weight: broadcasts after rank 0 swapped them
        self._touched = False

    def owned_elsewhere(self, params) -> set:
        """ids of trained weights averaged by someone else (FSDP's shards)."""
        return set()

    def attach(self, method, optimizer, groups, device) -> None:
        trained = [p for grp in groups for p in grp["params"]]
        elsewhere = self.owned_elsewhere(trained)
        mine = [p for p in trained if id(p) not in elsewhere]
        self.weights_sync = GradientSync(mine, self.world, device)
        if getattr(optimizer, "fused_backward", False):  # each weight steps inside backward: its gradient is
            optimizer.grad_reduce = weight_grad_average(self.world)  # averaged right before (DDP's: too late)
            self.weights_sync.broadcast_from_main()
            self.grad_sync = GradientSync([], self.world, device)
            return
        self.ddp = DDPGradients(method.modules, elsewhere, device)  # broadcasts rank 0's weights at wrap time
        self.grad_sync = GradientSync([p for p in mine if id(p) not in self.ddp.ids], self.world, device)
        self.grad_sync.broadcast_from_main()
        log.info("DDP: %d trained weights of %s averaged in backward (%d more in one all-reduce a step)",
                 len(self.ddp.params), ", ".join(self.ddp.names) or "nothing", len(self.grad_sync.params))

    def training_entry(self, module):
        return self.ddp.entry_for(module) if self.ddp is not None else module

    def data_config(self, cfg, global_micro_batch: int):
        data_cfg = copy.deepcopy(cfg)
        OmegaConf.update(data_cfg, "training.batch_size", global_micro_batch)
        return data_cfg

    def batches(self, data, epoch: int, start: int, stop: int):
        return iter_shard(data, epoch, start, stop, self.rank, self.world)

    @contextlib.contextmanager
    def micro_batch(self, last_of_step: bool):
        try:
            with self.ddp.accumulating(not last_of_step) if self.ddp is not None else contextlib.nullcontext():
                yield  # DDP: the gradient all-reduce runs inside this micro-batch's backward
        except PeerLost:
            raise
        except Exception as exc:
            if self.ddp is not None and collective_failure(exc):
                raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
            raise

    def end_step(self, loss: float, stop: bool) -> Tuple[float, bool]:
        if self.ddp is not None:
            self.ddp.check_step()
        # rank 0 alone samples and saves (DDP): whether it swapped weights (schedule-free, EMA) travels in
        # the step's all-reduce, so every process joins the broadcast of rank 0's weights that follows
        loss, stop, touched = self.grad_sync.step(loss, stop, self._touched)
        self._touched = False
        if touched:  # start the optimizer step from identical weights (the gradients are averaged already)
            self.weights_sync.broadcast_from_main()
        return loss, stop

    def weights_touched(self) -> None:
        self._touched = True


class ShardedData(DistributedData):
    """Several processes with the denoiser sharded by FSDP (full fine-tunes, ``general.distributed =
    fsdp``): FSDP reduce-scatters its gradients; the other trained modules are DDP-wrapped as above.
    Validation, sampling and the result's export run on every process (the sharded blocks gather)."""

    name = "fsdp"
    sharded = True

    def shard(self, method, plugin, device) -> None:
        self.device = device
        self.fsdp = FSDPShards(method.modules["unet"], plugin, device, self.world)
        log.info("FSDP: the denoiser is sharded over %d processes (%d units + root)", self.world, self.fsdp.units)

    def owned_elsewhere(self, params) -> set:
        return {id(p) for p in params if self.fsdp.owns(p)}

    def agree(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        try:
            dist.broadcast(value, src=0)
        except Exception as exc:  # a peer died or hung past general.dist_timeout_s
            raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
        return bool(value.item() > 0)

    def full_optimizer_state(self, optimizer) -> Optional[dict]:
        return full_optimizer_state(optimizer.state_dict(), keep=self.is_main)

    def shard_optimizer_state(self, optimizer) -> None:
        shard_optimizer_state(optimizer)

    @contextlib.contextmanager
    def whole_denoiser(self, model):
        """Every process gathers the sharded UNet; on rank 0 ``model.unet`` is an unsharded CPU copy meanwhile,
        so the exporters read whole weights."""
        sharded = model.denoiser
        plain = self.fsdp.plain_copy(keep=self.is_main)
        if plain is not None:
            model.set_part("unet", plain)
        try:
            yield
        finally:
            model.set_part("unet", sharded)


def make_strategy(rank: int, world: int, fsdp_plugin: Any = None) -> SingleProcess:
    """The strategy for this process: FSDP when a plugin was planned (``trainer.parallel.fsdp.plan_fsdp``), DDP for
    several processes, else one process."""
    if world <= 1:
        return SingleProcess(rank, world)
    return ShardedData(rank, world) if fsdp_plugin is not None else DistributedData(rank, world)
