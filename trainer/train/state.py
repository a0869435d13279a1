"""The explicit state of one run: what the set-up made (model, method, optimizer, data …), where the run is
(:class:`Position`) and how its processes work together (``par``, a ``trainer.parallel`` strategy). The
functions of ``trainer.train`` read and change it; nothing else holds the run."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LRScheduler

from trainer.data.concepts import DataReport
from trainer.data.pipeline import DataPipeline
from trainer.families.base import Family
from trainer.memory.offload import TextEncoderOffload
from trainer.memory.precision import StochasticRounding
from trainer.methods.base import MethodBase
from trainer.optim.schedule import ComponentSchedule
from trainer.parallel.plan import env_rank_world
from trainer.parallel.strategy import SingleProcess, make_strategy
from trainer.train.ema import TrainableEMA
from trainer.train.run_folder import RunFolder

log = logging.getLogger("atelier")


@dataclass
class Position:
    """Where the run is: optimizer steps done, epoch, and the next micro-batch within the epoch."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


class RunState:
    """Everything one run holds. ``__init__`` makes the run folder and the defaults; ``trainer.train.setup``
    fills in the rest (device, data, model, method, optimizer, scheduler, generator, EMA …): those fields are
    None (or 0) until it has run."""

    # the run as it was started
    cfg: DictConfig
    par: SingleProcess  # one process, DDP or FSDP (trainer.parallel.strategy); set-up replaces it once FSDP is planned
    run: RunFolder
    resume: Optional[str]
    show_progress: bool
    # where it is, and whether it should stop
    pos: Position
    last_backup_step: int
    stop_requested: bool
    _stop_signal_at: float
    ended_together: bool  # train() returned on every rank: they leave the process group at a barrier
    # made by trainer.train.setup.setup
    accelerator: Optional[Accelerator]
    device: Optional[torch.device]
    global_micro_batch: int  # training.batch_size x processes (a backup fixes it)
    data: Optional[DataPipeline]
    report: Optional[DataReport]  # the data's report (the ``started`` event carries it)
    model: Optional[Family]
    method: Optional[MethodBase]
    text_offload: Optional[TextEncoderOffload]  # data.offload_text_encoders, when it applies
    groups: List[Dict[str, Any]]  # the optimizer's parameter groups, one per trained module
    optimizer: Optional[torch.optim.Optimizer]
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    scheduler: Optional[LRScheduler]
    generator: Optional[torch.Generator]  # the host's draws (caption dropout, mask choices)
    device_generator: Optional[torch.Generator]  # the step's tensors (noise, timesteps …): ``generator`` on the CPU
    ema: Optional[TrainableEMA]
    rounding: Optional[StochasticRounding]  # precision.stochastic_rounding's optimizer hooks
    compiled: bool  # training.compile: the denoiser's blocks compile at their first call
    compile_counts: Optional[Dict[str, int]]  # training.compile: the kernel cache's counts before the first step
    cache_summary: Optional[Dict[str, Any]]  # what filling the caches encoded and reused
    tb: Any  # torch.utils.tensorboard's SummaryWriter (optional: tensorboard may be missing), or None
    # made by the loop as it goes
    unet_dtype: Optional[torch.dtype]  # the denoiser's input dtype, read once
    component_schedule: Optional[ComponentSchedule]  # parts.<part>.stop_after_*: made at its first use

    def __init__(self, cfg: DictConfig, run_dir: Path, resume: Optional[str] = None, progress: bool = True):
        self.cfg = cfg
        rank, world = env_rank_world()  # from torchrun / accelerate launch; (0, 1) otherwise
        self.par = make_strategy(rank, world)
        self.run = RunFolder(run_dir, main=self.par.is_main)
        self.resume = resume
        self.show_progress = progress
        self.pos = Position()
        self.last_backup_step = -1
        self.stop_requested = False
        self._stop_signal_at = 0.0
        self.ended_together = False
        self.accelerator = None
        self.device = None
        self.global_micro_batch = 0
        self.data = None
        self.report = None
        self.model = None
        self.method = None
        self.text_offload = None
        self.groups = []
        self.optimizer = None
        self.micro_batches_per_epoch = 0
        self.steps_per_epoch = 0
        self.total_steps = 0
        self.scheduler = None
        self.generator = None
        self.device_generator = None
        self.ema = None
        self.rounding = None
        self.compiled = False
        self.compile_counts = None
        self.cache_summary = None
        self.tb = None
        self.unet_dtype = None
        self.component_schedule = None

    # the process's place, as the strategy says
    @property
    def is_main(self) -> bool:
        return self.par.is_main

    @property
    def world(self) -> int:
        return self.par.world

    @property
    def rank(self) -> int:
        return self.par.rank

    def warn(self, message: str) -> None:
        """A warning in the log and as a ``warning`` event (the UI shows it)."""
        log.warning(message)
        self.run.events.emit("warning", message=message)

    def request_stop(self, why: str, from_signal: bool = False) -> None:
        """Finish the current step, write a backup, stop. A second request by signal (Ctrl+C twice)
        stops at once without a backup; the stop file (the UI's Stop) asks only once — the UI's second
        Stop kills the process tree instead."""
        if self.par.stop_rides_the_sync:  # every process stops at the same step: the request rides the sync
            if from_signal and self._stop_signal_at and time.time() - self._stop_signal_at > 10:
                log.warning("second stop request: stopping now without a backup")
                raise KeyboardInterrupt
            if not self._stop_signal_at:  # the launcher forwards the group's signal again: one request
                self._stop_signal_at = time.time()
                log.info("stop requested (%s): finishing the current step, then a backup", why)
            return
        if self.stop_requested:
            if from_signal:
                log.warning("second stop request: stopping now without a backup")
                raise KeyboardInterrupt
            return
        self.stop_requested = True
        log.info("stop requested (%s): finishing the current step, then a backup", why)

    @property
    def stop_wanted(self) -> bool:
        """This process was asked to stop (by the stop file, a signal, or another process at the last sync)."""
        return self.stop_requested or bool(self._stop_signal_at)
