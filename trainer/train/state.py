"""The explicit state of one run: what the set-up made (model, method, optimizer, data …), where the run is
(:class:`Position`) and how its processes work together (``par``, a ``trainer.parallel`` strategy). The
functions of ``trainer.train`` read and change it; nothing else holds the run."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trainer.parallel.plan import env_rank_world
from trainer.parallel.strategy import SingleProcess, make_strategy
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
    fills in the rest (device, data, model, method, optimizer, scheduler, generator, EMA …)."""

    def __init__(self, cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True):
        self.cfg = cfg
        rank, world = env_rank_world()  # from torchrun / accelerate launch; (0, 1) otherwise
        self.par: SingleProcess = make_strategy(rank, world)  # set-up replaces it once FSDP is planned
        self.run = RunFolder(run_dir, main=self.par.is_main)
        self.resume = resume
        self.show_progress = progress
        self.stop_requested = False
        self._stop_signal_at = 0.0
        self.pos = Position()
        self.last_backup_step = -1
        self.unet_dtype = None  # the denoiser's input dtype, read once (set-up fixes it)
        self.ema = None
        self.tb = None
        self.compiled = False
        self.component_schedule = None
        # made by trainer.train.setup.setup
        self.accelerator: Any = None
        self.device: Any = None
        self.model: Any = None
        self.method: Any = None
        self.data: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.generator: Any = None

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
