"""The training loop, top to bottom: set-up, data, the step, samples, backups, the end.

Exact resume: everything random in a step comes from state that a backup stores — a dedicated
``torch.Generator`` (noise, timesteps, latent sampling), the global torch RNG (dropout), and data
choices (order, captions, crops, flips) that are pure functions of (seed, epoch, position).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.config import ConfigError, ModelSettings, save_config, to_container, to_yaml
from trainer.distributed import (PeerLost, collective_failure, env_rank_world, expand_rows, explain_failure,
                                 fault_injection, iter_shard, rank_file, take_rows, write_rank_error,
                                 write_rank_info)
from trainer import procs
from trainer.paths import is_absolute_path, path_name
from trainer.events import EventWriter
from trainer.optim import on_eval, on_train

log = logging.getLogger("atelier")


# Resume: settings whose change makes a backup meaningless (refused), and bookkeeping never compared.
# model.path may change (a moved or re-downloaded file): a warning, and the trainable weights must still fit.
_PROCESS_START = time.time()
RESUME_FIXED = ("model.family", "training.method", "parts.denoiser.train", "parts.text_encoder_1.train",
                "parts.text_encoder_2.train", "parts.text_encoder_3.train", "lora.type", "lora.rank", "lora.alpha",
                "parts.denoiser.lora_targets",
                "lora.custom_targets", "lora.conv_rank", "lora.conv_alpha", "lora.factor", "lora.decompose_both",
                "embedding.placeholder", "embedding.num_vectors", "embedding.train_alongside",
                "training.optimizer.name")
RESUME_IGNORED = ("general.workspace", "general.run_name", "version", "general.num_processes", "general.gpu_ids",
                  "training.batch_size")  # batch: the global batch is kept across process counts (see setup)


def portable_paths(node: Any, workspace: str) -> Any:
    """The config with absolute paths made shareable: relative to the workspace inside it, the last
    component alone (``…/name``) outside it."""
    if isinstance(node, dict):
        return {k: portable_paths(v, workspace) for k, v in node.items()}
    if isinstance(node, list):
        return [portable_paths(v, workspace) for v in node]
    if isinstance(node, str) and is_absolute_path(node):  # also C:\… and \\server\share written on Windows
        p = Path(node).expanduser()
        if not (os.path.isabs(node) or node.startswith("~")):  # another system's path: never this machine's
            return f"…/{path_name(node)}"
        try:
            ws, real = Path(workspace).expanduser().resolve(), p.resolve()
            return Path(os.path.relpath(real, ws)).as_posix() if real == ws or ws in real.parents else f"…/{p.name}"
        except (OSError, ValueError):
            return f"…/{path_name(node)}"
    return node


def _flat(node: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config as dotted keys (lists compared whole)."""
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


class TrainingError(RuntimeError):
    """A failure during training with a message a user can act on."""


@dataclass
class Position:
    """Where the run is: optimizer steps done, epoch, and the next micro-batch within the epoch."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


# ----------------------------------------------------------------------------------------------
# run folder
# ----------------------------------------------------------------------------------------------

class RunFolder:
    def __init__(self, path: Path, main: bool = True):
        self.path = Path(path)
        self.main = main  # several processes: only rank 0 writes events and answers control requests
        for sub in ("samples", "backups", "control"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self.events = EventWriter(self.path / "events.jsonl", enabled=main, reserve=True)
        if main:  # a save killed half-way (kill -9, power loss) left temporaries: this trainer holds the folder
            from trainer.io import remove_stale_temps
            for folder in (self.path, self.path / "backups", self.path / "samples"):
                for name in remove_stale_temps(folder):
                    log.info("removed %s, left by an interrupted save", folder / name)

    @property
    def backups(self) -> Path:
        return self.path / "backups"

    def control_requested(self, what: str) -> bool:
        """The UI asks for 'sample' or 'backup' now by creating control/<what>."""
        f = self.path / "control" / what
        if self.main and f.exists():
            try:
                f.unlink()
            except OSError:
                pass
            return True
        return False


def list_backups(run_dir: Path) -> List[Path]:
    folder = Path(run_dir) / "backups"
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and (p / "state.json").exists()
                   and not p.name.startswith(".")), key=lambda p: p.name)


def setup_logging(run_dir: Path, rank: int = 0) -> None:
    logger = logging.getLogger("atelier")
    logger.setLevel(logging.INFO)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    if rank == 0:  # several processes: rank 0 writes train.log, the others log warnings to stderr
        fh = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    if rank:
        sh.setLevel(logging.WARNING)
    sh.setFormatter(logging.Formatter(f"%(levelname)s {f'[rank {rank}] ' if rank else ''}%(message)s"))
    logger.addHandler(sh)
    logger.propagate = False


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------


def _scaler_step(scaler, optimizer) -> bool:
    """fp16: the GradScaler's step (skipped when a gradient is inf/NaN) and scale update; returns
    whether the step was skipped. Read from the scaler's record of its unscale, between ``step`` and
    ``update``; a scaler class without that record is judged, as accelerate does, by a drop of the scale."""
    scaler.step(optimizer)
    try:
        found = scaler._found_inf_per_device(optimizer)
        skipped = any(bool(v.item()) for v in found.values())
    except Exception:
        skipped = None
        scale = scaler.get_scale()
    scaler.update()
    return skipped if skipped is not None else scaler.get_scale() < scale


class Trainer:
    def __init__(self, cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True):
        self.cfg = cfg
        self.rank, self.world = env_rank_world()  # from torchrun / accelerate launch; (0, 1) otherwise
        self.is_main = self.rank == 0
        self.run = RunFolder(run_dir, main=self.is_main)
        self._stop_signal_at = 0.0
        self._weights_touched = False  # rank 0 sampled/saved (schedule-free swaps): re-broadcast weights
        self.resume = resume
        self.show_progress = progress
        self.stop_requested = False
        self.pos = Position()
        self._last_backup_step = -1
        self.fsdp = None  # FSDPShards when a full fine-tune shards its UNet over the processes
        self._unet_dtype = None  # the UNet's input dtype, read once (set-up fixes it)

    # --- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame):  # noqa: ARG002
        self.request_stop(f"signal {signum}", from_signal=True)

    def request_stop(self, why: str, from_signal: bool = False) -> None:
        """Finish the current step, write a backup, stop. A second request by signal (Ctrl+C twice)
        stops at once without a backup; the stop file (the UI's Stop) asks only once — the UI's second
        Stop kills the process tree instead."""
        if self.world > 1:  # the stop rides the next gradient sync, so every process stops at the same step
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

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)):  # SIGBREAK: Ctrl+Break on Windows
            if sig is not None:
                signal.signal(sig, self._on_signal)

    # --- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        g = cfg.general
        t = cfg.training
        from trainer.devices import device_problems, resolve_device
        mps_backend = getattr(torch.backends, "mps", None)
        try:
            device = resolve_device(g.device, torch.cuda.is_available(),
                                    bool(mps_backend is not None and mps_backend.is_available()))
        except ValueError as exc:
            raise ConfigError(str(exc), key="general.device", value=g.device) from None
        for key, message, level in device_problems(cfg, device):
            if level == "error":
                raise ConfigError(message, key=key)
            self.warn(message)
        cpu = device == "cpu"
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state()  # a second run in the same process (tests) may change precision
        from trainer.distributed import accelerator_kwargs
        from trainer.fsdp import plan_fsdp
        fsdp_plugin = plan_fsdp(cfg, self.world, cpu, self.warn, log.info)  # None: gradients averaged as DDP does
        self.accelerator = Accelerator(mixed_precision=t.mixed_precision, cpu=cpu,
                                       fsdp_plugin=None if cpu else fsdp_plugin,  # accelerate: FSDP on GPUs only
                                       kwargs_handlers=accelerator_kwargs(cfg, cpu, self.world, self.warn,
                                                                          sharded=fsdp_plugin is not None))
        self.device = self.accelerator.device
        if self.device.type == "cuda":
            # cuDNN's SDPA kernel (chosen first for bf16 on Hopper since torch 2.5) fails in Flux.1's 1024 px
            # backward (torch 2.11, cu130, H200: "mha_graph.execute(...).is_good()", an illegal memory access
            # without CUDA_LAUNCH_BLOCKING); flash/memory-efficient attention train it
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        set_seed(g.seed)
        self.global_micro_batch = self._plan_global_batch()

        from trainer.data.pipeline import DataPipeline
        self.data = DataPipeline(self._global_batch_cfg(), warn=self.warn)  # one plan of global batches
        self.report = self.data.report

        from trainer.models.base import load_model
        log.info("loading model %s", cfg.model.path)
        with self.accelerator.main_process_first():  # builds built-in models / fills the hub cache once
            self.model = load_model(cfg, g.workspace, self.device)
        from trainer.methods.finetune import make_method
        self.method = make_method(self.model, cfg)
        self.method.prepare_data(self.data, self.warn)  # embedding placeholder: captions, tag dropout, warnings
        check = getattr(self.model, "check_captions", None)  # e.g. Flux with T5 off: captions within CLIP's limit
        if check is not None:
            check([(it.path, c) for it in self.data.items + self.data.validation_items for c in it.captions])
        from trainer.offload import TextEncoderOffload, plan_offload, text_frozen
        frozen_text = text_frozen(self.method)  # cached text outputs stay valid only while no text-side module trains
        self.text_offload = None
        offloading = plan_offload(cfg, self.data.captions_cacheable(), frozen_text, self.warn)
        from trainer.precision import place_text_encoders
        place_text_encoders(self.model, cfg, offloading)  # fp8 text encoders; the device unless offloaded
        if offloading:
            self.text_offload = TextEncoderOffload(self.model, self.device)  # before the denoiser reaches the device
            log.info("text encoders in CPU RAM except while they encode: %s", ", ".join(self.text_offload.slots))
        from trainer.block_swap import plan_block_swap
        plan_block_swap(self.model, cfg, self.device, self.warn)  # blocks_to_swap: placed by apply_storage
        from trainer.precision import apply_storage
        apply_storage(self.model, self.method, cfg)  # fp8/NF4: quantised on the way to the device
        if t.gradient_checkpointing:
            for m in self.method.modules.values():
                m.gradient_checkpointing_enable() if hasattr(m, "gradient_checkpointing_enable") else \
                    m.enable_gradient_checkpointing()
        for name, m in self.method.modules.items():
            m.train()
        if fsdp_plugin is not None:  # shard the UNet before the optimizer is built on its weights
            from trainer.fsdp import FSDPShards
            self.fsdp = FSDPShards(self.method.modules["unet"], fsdp_plugin, self.device, self.world)
            log.info("FSDP: the denoiser is sharded over %d processes (%d units + root, %s)", self.world,
                     self.fsdp.units, g.fsdp_sharding_strategy)

        from trainer.optim import build_optimizer, build_scheduler, param_groups
        self.groups = param_groups(self.method, cfg)
        self.optimizer = build_optimizer(self.groups, cfg)
        self.grad_sync = self.weights_sync = None  # weights_sync: broadcasts, when grad_sync carries scalars only
        self.ddp = None  # DDPGradients: torch DDP on the trained modules (several processes)
        if self.world > 1:  # FSDP averages the sharded UNet's gradients itself
            from trainer.distributed import DDPGradients, GradientSync
            trained = [p for grp in self.groups for p in grp["params"]]
            sharded = {id(p) for p in trained if self.fsdp is not None and self.fsdp.owns(p)}
            if getattr(self.optimizer, "fused_backward", False):  # each weight steps inside backward: its
                from trainer.distributed import weight_grad_average  # gradient is averaged right before
                self.optimizer.grad_reduce = weight_grad_average(self.world)  # (DDP's would come too late)
                self.weights_sync = GradientSync([p for p in trained if id(p) not in sharded], self.world,
                                                 self.device)
                self.weights_sync.broadcast_from_main()
                self.grad_sync = GradientSync([], self.world, self.device)  # the loss and the stop flag
            else:  # DDP for the modules' weights (it broadcasts rank 0's at wrap time); the few weights no
                # module's forward owns (an embedding's token vectors), the loss and the stop flag: grad_sync
                self.ddp = DDPGradients(self.method.modules, sharded, self.device)
                self.grad_sync = GradientSync([p for p in trained if id(p) not in sharded and id(p) not in self.ddp.ids],
                                              self.world, self.device)
                self.grad_sync.broadcast_from_main()
                self.weights_sync = GradientSync([p for p in trained if id(p) not in sharded], self.world,
                                                 self.device)  # re-broadcasts after rank 0 swapped weights
                log.info("DDP: %d trained weights of %s averaged in backward (%d more in one all-reduce a step)",
                         len(self.ddp.params), ", ".join(n for n, m in self.method.modules.items()
                                                         if any(m is w for w, _ in self.ddp.wrapped)) or "nothing",
                         len(self.grad_sync.params))
        self.micro_batches_per_epoch = len(self.data.epoch_batches(0))
        self.steps_per_epoch = max(1, self.micro_batches_per_epoch // t.gradient_accumulation_steps)
        if self.micro_batches_per_epoch < t.gradient_accumulation_steps:
            raise ConfigError(f"An epoch has {self.micro_batches_per_epoch} batches, fewer than "
                              f"training.gradient_accumulation_steps = {t.gradient_accumulation_steps}: "
                              "no optimizer step would happen. Lower accumulation or batch size.",
                              key="training.gradient_accumulation_steps")
        self.total_steps = t.max_steps if t.max_steps > 0 else t.epochs * self.steps_per_epoch
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.generator = torch.Generator().manual_seed(g.seed)
        self._setup_loss_ema_precision()
        self.compiled = False  # training.compile: the first step pays for the compiles (its time is reported)
        if t.get("compile", False):
            from trainer.compile import compile_blocks, describe
            try:
                done = compile_blocks(self.model.denoiser)
            except ValueError as exc:
                raise ConfigError(str(exc), key="training.compile", value=True) from None
            self.compiled = True
            log.info("training.compile: %s compiled at their first call", describe(done))

        with self.accelerator.main_process_first():  # rank 0 fills the caches; the others then read them
            self.cache_summary = self.data.prepare(
                self.model.encode_pixels, self.model.fingerprint(), cfg.model.vae_dtype,
                encode_text_fn=(lambda captions: self.model.encode_captions(
                    self.method.expand_text(captions))) if frozen_text else None,
                text_fingerprint=self.model.text_fingerprint(ModelSettings(cfg)),
                # inpainting: batches carry the pixels, the cache keeps them (and data-masked latents)
                inpaint_fn=self.model.encode_masked_images if getattr(self.model, "inpainting", False) else None)
        if self.text_offload is not None:
            self.text_offload.encoders_out()  # the denoiser back on the device for training
        self.tb = None
        if g.tensorboard and self.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run.path / "tensorboard"))
            except Exception as exc:  # tensorboard missing: not fatal
                self.warn(f"TensorBoard logging is off: {exc}")

    def warn(self, message: str) -> None:
        log.warning(message)
        self.run.events.emit("warning", message=message)

    # --- several processes -----------------------------------------------------------------
    def _plan_global_batch(self) -> int:
        """The global micro-batch: training.batch_size per process x processes. A backup fixes it (and
        the accumulation), so resuming on another number of processes adjusts the per-process batch."""
        from omegaconf import OmegaConf
        t, g = self.cfg.training, self.cfg.general
        if self.world > 1:
            if int(g.get("num_processes", 1) or 1) != self.world:  # launched by hand: the launcher's count wins
                OmegaConf.update(self.cfg, "general.num_processes", self.world)
        if self.resume:
            path = self._resolve_resume(self.resume)
            state = json.loads((path / "state.json").read_text())
            saved, acc = state.get("global_micro_batch"), state.get("gradient_accumulation_steps")
            if acc and int(acc) != int(t.gradient_accumulation_steps):
                raise ConfigError(f"Backup {path.name} was made with training.gradient_accumulation_steps = {acc}; this "
                                  f"config has {t.gradient_accumulation_steps}. Resume with the same accumulation.",
                                  key="training.gradient_accumulation_steps")
            if saved and int(saved) != int(t.batch_size) * self.world:
                if int(saved) % self.world:
                    raise ConfigError(
                        f"Backup {path.name} trained with a global batch of {saved} per micro-batch "
                        f"({state.get('world_size', 1)} process(es) x batch {int(saved) // state.get('world_size', 1)}); "
                        f"{self.world} processes cannot split it. Resume with a general.num_processes that divides "
                        f"{saved} (training.batch_size is adjusted).", key="general.num_processes")
                per = int(saved) // self.world
                self.warn(f"Resuming a backup of {state.get('world_size', 1)} process(es) on {self.world}: "
                          f"training.batch_size is {per} per process (was {t.batch_size}) so the global batch "
                          f"stays {saved} and the run continues exactly.")
                OmegaConf.update(self.cfg, "training.batch_size", per)
        return int(t.batch_size) * self.world

    def _global_batch_cfg(self):
        """The config the data pipeline plans with: every process plans the same global batches."""
        if self.world == 1:
            return self.cfg
        import copy

        from omegaconf import OmegaConf
        data_cfg = copy.deepcopy(self.cfg)
        OmegaConf.update(data_cfg, "training.batch_size", self.global_micro_batch)
        return data_cfg

    # --- loss options, EMA, precision ------------------------------------------------------
    def _setup_loss_ema_precision(self) -> None:
        """Zero-terminal-SNR schedule, the EMA copy, fp8 storage and stochastic-rounding hooks."""
        from trainer.ema import make_ema
        from trainer.loss import prepare_noise_schedule
        from trainer.precision import apply_precision
        cfg = self.cfg
        prepare_noise_schedule(self.model, cfg.loss, self.warn)
        self.ema = make_ema(self.method, cfg.ema, self.device)
        self.rounding = apply_precision(self.model, self.method, self.optimizer, cfg,
                                        lambda: cfg.general.seed * 1_000_003 + self.pos.step, self.warn)

    # --- one micro-batch -------------------------------------------------------------------
    def _forward_loss(self, batch, gen=None):
        import torch
        from trainer.loss import choose_mask, make_noise, per_sample_loss, perturb_noise, weighted_mean
        model = self.model
        objective = model.objective  # DDPM or flow matching, chosen by the family
        lc = self.cfg.loss
        gen = self.generator if gen is None else gen  # all randomness of a step comes from here: exact resume
        # several processes: every draw is made for the whole global micro-batch (the same on every
        # process), each keeps its rows; so N processes equal one process with N x the batch
        rows = batch.get("global_rows")
        latents = model.sample_latents(expand_rows(batch["latent_dist"], rows), gen)
        noise = make_noise(latents.shape, gen, self.cfg.training.noise_offset).to(latents.device)
        timesteps = objective.sample_timesteps(latents.shape[0], lc, gen, latents).to(latents.device)
        noisy, target = objective.noisy_and_target(latents, noise, timesteps)
        if lc.input_perturbation > 0:  # the input gets extra noise; the target stays that of `noise`
            noisy, _ = objective.noisy_and_target(latents, perturb_noise(noise, lc.input_perturbation, gen), timesteps)
        mask = choose_mask(batch.get("mask"), lc, gen)
        noisy = model.model_input(noisy, batch, gen, self.warn)  # inpainting: noisy ‖ mask ‖ masked-image latents
        train_text = {"text_encoder", "text_encoder_2", "text_encoder_3", "embedding"} & set(self.method.modules)
        drops = {}  # per-encoder caption dropout: drawn only when on, so other runs keep their random stream
        parts = self.cfg.parts
        encoders = [("drop_te1", parts.text_encoder_1), ("drop_te2", parts.text_encoder_2)]
        if model.info.part("text_encoder_3") is not None:  # SD3's T5 (asked only of families that have a third)
            encoders.append(("drop_te3", parts.text_encoder_3))
        for key, part in encoders:
            if not part.enabled:  # switched off: the encoder only ever sees the empty caption
                drops[key] = [True] * latents.shape[0]
            elif part.caption_dropout > 0:
                drops[key] = (torch.rand(latents.shape[0], generator=gen) < part.caption_dropout).tolist()
        if rows is not None:
            noisy, target, timesteps = (take_rows(x, rows) for x in (noisy, target, timesteps))
            drops = {k: v[rows[0]:rows[1]] for k, v in drops.items()}
        with self.accelerator.autocast():
            cond = model.batch_condition(batch, self.method.expand_text, train_text, **drops)
            if self._unet_dtype is None:  # diffusers' .dtype walks every module (~8 ms a step on the tiny UNet)
                self._unet_dtype = model.denoiser.dtype
            model_pred = model.predict(noisy.to(self._unet_dtype), timesteps, cond)
        losses = per_sample_loss(model_pred, target, lc, timesteps, objective,
                                 mask=None if mask is None else mask.to(latents.device))
        variance = getattr(model, "variance_loss", None)  # learned-variance models: their variational bound
        if variance is not None and lc.vb_strength > 0:
            vb = variance(take_rows(latents, rows) if rows is not None else latents, noisy, timesteps, model_pred)
            if vb is not None:
                losses = losses + lc.vb_strength * vb
        return weighted_mean(losses, batch["loss_weights"])

    def validate(self) -> Optional[float]:
        """Mean loss over the validation concepts, with a fixed generator (same noise and timesteps every
        time, so the numbers are comparable) and the trained modules in eval mode; not trained on."""
        import torch
        if not self.data.validation_batches() or (not self.is_main and self.fsdp is None):
            return None  # DDP: rank 0 alone (no collectives); FSDP: every process runs the sharded UNet
        modes = {n: m.training for n, m in self.method.modules.items()}
        for m in self.method.modules.values():
            m.eval()
        gen = torch.Generator().manual_seed(int(self.cfg.general.seed) + 7919)
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for batch in self.data.iter_validation():
                    n = len(batch["captions"])
                    total += self._forward_loss(batch, gen).item() * n
                    count += n
        finally:
            for n, m in self.method.modules.items():
                m.train(modes[n])
        loss = total / max(count, 1)
        self.run.events.emit("validation", step=self.pos.step, epoch=self.pos.epoch, loss=loss, images=count)
        if self.tb is not None:
            self.tb.add_scalar("validation_loss", loss, self.pos.step)
        log.info("validation loss %.5f (%d images)", loss, count)
        return loss

    # --- the run ---------------------------------------------------------------------------
    def train(self) -> str:
        import torch

        from trainer.startup import resume_gc
        cfg = self.cfg
        t = cfg.training
        ev = self.run.events
        if self.resume:
            self._load_backup(self._resolve_resume(self.resume))
        ev.emit("started", total_steps=self.total_steps, epochs=t.epochs if not t.max_steps else
                math.ceil(self.total_steps / self.steps_per_epoch), steps_per_epoch=self.steps_per_epoch,
                batch_size=t.batch_size, gradient_accumulation_steps=t.gradient_accumulation_steps,
                resumed_from_step=self.pos.step, dataset=self.report.to_dict(),
                device=str(self.device), world_size=self.world, global_micro_batch=self.global_micro_batch,
                distributed="fsdp" if self.fsdp is not None else "ddp" if self.world > 1 else "none",
                global_batch=self.global_micro_batch * t.gradient_accumulation_steps,
                cache=getattr(self, "cache_summary", None))
        log.info("training %d steps (%d per epoch) on %s", self.total_steps, self.steps_per_epoch, self.device)
        if cfg.sampling.at_start and self.pos.step == 0:
            self.sample()
        accum = t.gradient_accumulation_steps
        t_start = time.time()
        steps_at_start = self.pos.step
        bar = self._progress_bar()
        loss_acc = 0.0
        loss_sum = None  # the current optimizer step's loss, summed on the device
        while self.pos.step < self.total_steps:
            usable = (len(self.data.epoch_batches(self.pos.epoch)) // accum) * accum
            if self.world == 1:
                batches = self.data.iter_batches(self.pos.epoch, self.pos.batch_in_epoch, usable)
            else:  # this process's slice of each global batch
                batches = iter_shard(self.data, self.pos.epoch, self.pos.batch_in_epoch, usable, self.rank, self.world)
            for bi, batch in batches:
                if self.pos.step >= self.total_steps:
                    break
                try:
                    with self._accumulating((self.pos.batch_in_epoch + 1) % accum != 0):
                        loss = self._forward_loss(batch)
                        self.accelerator.backward(loss / accum)  # DDP: the gradient all-reduce runs in here
                except Exception as exc:
                    if self.ddp is not None and collective_failure(exc):
                        raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
                    raise
                # the step's loss stays on the device until the step ends: one host-device sync per optimizer
                # step (the step event carries the loss), not two per micro-batch
                part = loss.detach().float() / accum
                loss_sum = part if loss_sum is None else loss_sum + part
                self.pos.batch_in_epoch += 1
                if self.pos.batch_in_epoch % accum:
                    continue
                loss_acc, loss_sum = float(loss_sum), None
                if self.world == 1 and not math.isfinite(loss_acc):  # before the optimizer touches the weights
                    raise TrainingError(
                        f"The loss became {loss_acc} at step {self.pos.step + 1} (epoch {self.pos.epoch + 1}). "
                        "Training stopped; the last backup is intact. Try a lower learning rate, "
                        "model.vae_dtype = fp32, or bf16 instead of fp16.")
                if self.ddp is not None:
                    self.ddp.check_step()
                if self.grad_sync is not None:  # average gradients (+ loss, stop flag) over the processes
                    loss_acc = self._sync_step(loss_acc)
                # fp16 on a GPU: accelerate's backward scaled the loss, but the optimizer is ours (never
                # accelerator.prepare'd), so unscaling and the overflow-skipping step are done here
                scaler = self.accelerator.scaler
                if scaler is not None:
                    scaler.unscale_(self.optimizer)
                if t.max_grad_norm > 0:
                    self.accelerator.clip_grad_norm_([p for g in self.groups for p in g["params"]],
                                                     t.max_grad_norm)
                overflowed = False
                if scaler is not None:
                    overflowed = _scaler_step(scaler, self.optimizer)
                else:
                    self.optimizer.step()
                if not overflowed:  # as accelerate's own scheduler wrapper: a skipped step does not advance
                    self.scheduler.step()  # the schedule (and torch warns about a step before optimizer.step)
                self.optimizer.zero_grad(set_to_none=True)
                self.pos.step += 1
                if self.ema is not None:
                    self.ema.after_optimizer_step(self.pos.step)
                self._after_step(loss_acc, t_start, steps_at_start, bar)
                resume_gc()  # paused during a fresh process's start-up (trainer/startup.py); no-op after
                fault_injection(self.rank, self.pos.step)
                loss_acc = 0.0
                if self.stop_requested:
                    return self._stop(bar)
            if self.pos.batch_in_epoch >= usable:
                self.pos.epoch += 1
                self.pos.batch_in_epoch = 0
                self._after_epoch()
                if self.stop_requested:
                    return self._stop(bar)
        if bar is not None:
            bar.close()
        if cfg.sampling.at_end and cfg.sampling.prompts:
            self.sample()
        path = self.save_result()
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        reserved = torch.cuda.max_memory_reserved() / 2**20 if cuda else None  # what the card must have (less the context)
        ev.emit("finished", step=self.pos.step, path=str(path), message="training finished",
                peak_vram_mib=None if peak is None else round(peak, 1),
                peak_vram_reserved_mib=None if reserved is None else round(reserved, 1))
        log.info("finished: %s", path)
        return "finished"

    def _accumulating(self, on: bool):
        """DDP: no gradient all-reduce on a micro-batch that is not the last of its optimizer step."""
        import contextlib
        return self.ddp.accumulating(on) if self.ddp is not None else contextlib.nullcontext()

    def _sync_step(self, loss_acc: float) -> float:
        if self._weights_touched:  # rank 0 swapped weights to sample/save: start again from identical ones
            (self.weights_sync or self.grad_sync).broadcast_from_main()
            self._weights_touched = False
        loss_acc, stop = self.grad_sync.step(loss_acc, bool(self._stop_signal_at) or self.stop_requested)
        self.stop_requested = self.stop_requested or stop
        if not math.isfinite(loss_acc):
            raise TrainingError(
                f"The loss became {loss_acc} at step {self.pos.step + 1} (epoch {self.pos.epoch + 1}). "
                "Training stopped; the last backup is intact. Try a lower learning rate, "
                "model.vae_dtype = fp32, or bf16 instead of fp16.")
        return loss_acc

    def _progress_bar(self):
        if not self.show_progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total_steps, initial=self.pos.step, unit="step", dynamic_ncols=True,
                    file=sys.stderr, disable=not sys.stderr.isatty())

    def _apply_component_schedule(self) -> None:
        """parts.<part>.stop_after_steps/_epochs: freeze components whose window has ended (after
        every scheduler step, which writes their LR again, and after loading a backup)."""
        sched = getattr(self, "component_schedule", None)
        if sched is None:
            from trainer.optim import ComponentSchedule
            sched = self.component_schedule = ComponentSchedule(self.optimizer, self.cfg, self.steps_per_epoch)
        if sched:
            for name in sched.apply(self.pos.step):
                log.info("%s: training window over at step %d; its weights are frozen from now on", name,
                         self.pos.step)

    def _trained_params(self) -> set:
        """ids of the weights the optimizer trains (frozen components included: they stay in backups)."""
        return {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def _after_step(self, loss: float, t_start: float, steps_at_start: int, bar) -> None:
        self._apply_component_schedule()
        step = self.pos.step
        elapsed = time.time() - t_start
        done = step - steps_at_start
        it_s = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total_steps - step) / it_s if it_s > 0 else None
        # Prodigy / D-Adaptation keep lr at ~1 and learn a step size d: log the LR they actually use
        lrs = {g.get("name", str(i)): g["lr"] * g["d"] if isinstance(g.get("d"), float) else g["lr"]
               for i, g in enumerate(self.optimizer.param_groups)}
        extra = {}
        if self.compiled and done == 1:  # the first step of this process compiled the blocks
            extra["first_step_s"] = round(elapsed, 2)
            log.info("training.compile: the first step, compiles included, took %.1f s", extra["first_step_s"])
        self.run.events.emit("step", step=step, total_steps=self.total_steps, epoch=self.pos.epoch + 1,
                             loss=loss, lr=lrs, it_s=round(it_s, 4), eta_s=None if eta is None else round(eta, 1),
                             **extra)
        if self.tb is not None:
            self.tb.add_scalar("loss", loss, step)
            for name, lr in lrs.items():
                self.tb.add_scalar(f"lr/{name}", lr, step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", epoch=self.pos.epoch + 1)
        if step % 10 == 0 or step == self.total_steps:
            log.info("step %d/%d epoch %d loss %.5f lr %s", step, self.total_steps, self.pos.epoch + 1, loss,
                     {k: f"{v:.3g}" for k, v in lrs.items()})
        s, b = self.cfg.sampling, self.cfg.backup
        v = self.cfg.training.validation_every_n_steps
        if v and step % v == 0:
            self.validate()
        if (s.every_n_steps and step % s.every_n_steps == 0 and step < self.total_steps) \
                or self._requested("sample"):
            self.sample()
        if (b.every_n_steps and step % b.every_n_steps == 0) or self._requested("backup"):
            self.backup()

    def _requested(self, what: str) -> bool:
        """The UI asked for a sample or backup now (rank 0 sees the request). With FSDP every process
        takes part in either, so rank 0's answer is broadcast."""
        asked = self.run.control_requested(what)
        if self.fsdp is None:
            return asked
        import torch
        import torch.distributed as dist
        flag = torch.tensor([1.0 if asked else 0.0], device=self.device)
        try:
            dist.broadcast(flag, src=0)
        except Exception as exc:  # a peer died or hung past general.dist_timeout_s
            raise PeerLost(f"{type(exc).__name__}: {exc}") from exc
        return bool(flag.item() > 0)

    def _after_epoch(self) -> None:
        e = self.pos.epoch
        s, b, o = self.cfg.sampling, self.cfg.backup, self.cfg.output
        last = self.pos.step >= self.total_steps
        if not self.cfg.training.validation_every_n_steps:
            self.validate()
        if s.every_n_epochs and e % s.every_n_epochs == 0 and not (last and s.at_end):
            self.sample()
        if b.every_n_epochs and e % b.every_n_epochs == 0 and self._last_backup_step != self.pos.step:
            self.backup()
        if o.save_every_n_epochs and e % o.save_every_n_epochs == 0 and not last:
            self.save_result(suffix=f"-epoch{e:04d}")

    def _stop(self, bar) -> str:
        if bar is not None:
            bar.close()
        path = None
        if self.cfg.backup.on_stop and self.pos.step > 0:
            path = self.backup() if self._last_backup_step != self.pos.step else \
                (list_backups(self.run.path) or [None])[-1]
        self.run.events.emit("stopped", step=self.pos.step, backup=str(path) if path else None,
                             message="stopped by request")
        log.info("stopped at step %d", self.pos.step)
        return "stopped"

    # --- samples ---------------------------------------------------------------------------
    def sample(self) -> List[str]:
        import torch
        prompts = list(self.cfg.sampling.prompts)
        if not prompts or (not self.is_main and self.fsdp is None):
            return []  # FSDP: every process runs the pipeline (the sharded UNet gathers per block); rank 0 writes
        self._weights_touched = self.world > 1
        rng_state = torch.get_rng_state()
        modes = {n: m.training for n, m in self.method.modules.items()}
        for m in self.method.modules.values():
            m.eval()
        on_eval(self.optimizer)  # schedule-free optimizers: sample the averaged weights
        pipe = self.model.pipeline(self.cfg.sampling.scheduler)
        paths, path_prompts, weights = [], [], []
        from trainer.ema import sample_variants
        try:
            for suffix, use_ema in sample_variants(self.ema, self.cfg.ema):  # raw and/or EMA weights
                with self.ema.applied() if use_ema else nullcontext():
                    for i, sp in enumerate(prompts):
                        gen = torch.Generator(device="cpu").manual_seed(int(sp.seed))
                        negative = self.method.expand_text(sp.negative_prompt)  # pipelines' own default if empty
                        with torch.no_grad(), self.accelerator.autocast():
                            image = pipe(self.method.expand_text(sp.prompt),  # embedding placeholders
                                         **({"negative_prompt": negative} if negative else {}),
                                         num_inference_steps=sp.steps, guidance_scale=sp.cfg_scale,
                                         width=sp.width, height=sp.height, generator=gen,
                                         **self.model.sampling_kwargs(),
                                         **self.model.prompt_kwargs(sp)).images[0]  # inpainting: image, mask
                        path = self._sample_path(i, suffix)
                        if not self.is_main:
                            continue
                        tmp = path.with_name(path.stem + ".tmp.png")
                        image.save(tmp)
                        os.replace(tmp, path)
                        paths.append(str(path))
                        path_prompts.append(sp.prompt)
                        weights.append("ema" if use_ema else "raw")
                        if self.tb is not None:
                            import numpy as np
                            self.tb.add_image(f"sample/{i}{suffix}", np.asarray(image), self.pos.step,
                                              dataformats="HWC")
        finally:
            on_train(self.optimizer)
            for n, m in self.method.modules.items():
                m.train(modes[n])
            torch.set_rng_state(rng_state)
        self.run.events.emit("sample", step=self.pos.step, epoch=self.pos.epoch, paths=paths,
                             prompts=path_prompts, weights=weights)
        return paths

    def _sample_path(self, index: int, suffix: str) -> Path:
        """``samples/step<STEP>-p<INDEX><suffix>.png``; a second sample of the same prompt at the same step (Sample
        now on a scheduled sample's step, or the reverse) gets ``-2``, ``-3`` … instead of replacing the first."""
        stem = f"step{self.pos.step:06d}-p{index}{suffix}"
        path, n = self.run.path / "samples" / f"{stem}.png", 1
        while path.exists():
            n += 1
            path = path.with_name(f"{stem}-{n}.png")
        return path

    # --- backups ---------------------------------------------------------------------------
    def _trainable_state(self) -> Dict[str, Any]:
        """Whole trained weights on the CPU (FSDP: gathered by every process, kept by rank 0)."""
        from trainer.fsdp import full_tensor
        trained = self._trained_params()  # not requires_grad: components past their window stay in backups
        out = {}
        for name, m in self.method.modules.items():
            for pn, p in m.named_parameters():
                if id(p) in trained:
                    full = full_tensor(p.detach())
                    if self.is_main:
                        out[f"{name}.{pn}"] = full.cpu().contiguous()
        return out

    def backup(self) -> Path:
        target = self.run.backups / f"backup-step{self.pos.step:06d}"
        weights = optimizer_state = None
        if self.fsdp is not None:  # every process gathers its shards; rank 0 writes the same files as DDP
            from trainer.fsdp import full_optimizer_state
            weights = self._trainable_state()
            optimizer_state = full_optimizer_state(self.optimizer.state_dict(), keep=self.is_main)
        if not self.is_main:  # DDP: every process holds the same weights and optimizer state: rank 0 writes
            self._last_backup_step = self.pos.step
            return None
        try:
            self._write_backup(target, weights, optimizer_state)
        except (OSError, RuntimeError) as exc:  # a full disk, a permission problem: one clear message
            from trainer.io import write_failure
            raise TrainingError(write_failure(exc, self.run.backups, "a backup")) from None
        self._last_backup_step = self.pos.step
        for old in list_backups(self.run.path)[:-self.cfg.backup.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self.run.events.emit("backup", step=self.pos.step, path=str(target))
        log.info("backup written: %s", target)
        return target

    def _write_backup(self, target: Path, weights, optimizer_state) -> None:
        import torch
        from safetensors.torch import save_file
        from trainer.io import atomic_dir
        with atomic_dir(target) as tmp:
            tmp = Path(tmp)
            save_file(weights if weights is not None else self._trainable_state(), str(tmp / "trainable.safetensors"))
            if self.ema is not None:
                self.ema.save(tmp)  # ema.safetensors + ema.json
            torch.save({"optimizer": optimizer_state if optimizer_state is not None else self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(),
                        "grad_scaler": None if self.accelerator.scaler is None else self.accelerator.scaler.state_dict(),
                        "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "mps_rng": torch.mps.get_rng_state() if self.device.type == "mps" else None,
                        "python_rng": random.getstate()}, tmp / "training_state.pt")
            (tmp / "config.yaml").write_text(to_yaml(self.cfg), encoding="utf-8")  # what resume compares with
            (tmp / "state.json").write_text(json.dumps({**asdict(self.pos), "time": time.time(),
                                                        "method": self.cfg.training.method,
                                                        "world_size": self.world,
                                                        "global_micro_batch": self.global_micro_batch,
                                                        "gradient_accumulation_steps":
                                                            self.cfg.training.gradient_accumulation_steps,
                                                        "model": self.cfg.model.path}))

    def _resolve_resume(self, resume: str) -> Path:
        if resume == "last":
            found = list_backups(self.run.path)
            if not found:
                raise ConfigError(f"--resume last: no backup in {self.run.backups}. Start without --resume, "
                                  "or give a backup folder.", key="resume")
            return found[-1]
        p = Path(resume)
        if not (p / "state.json").exists():
            raise ConfigError(f"--resume '{resume}' is not a backup folder (no state.json).", key="resume")
        return p

    def _load_backup(self, path: Path) -> None:
        import torch
        from safetensors.torch import load_file
        state = json.loads((path / "state.json").read_text())
        if state.get("method") != self.cfg.training.method:
            raise ConfigError(f"Backup {path} is from a {state.get('method')} run; this config trains "
                              f"{self.cfg.training.method}.", key="training.method")
        self._compare_with_backup_config(path)
        weights = load_file(str(path / "trainable.safetensors"))
        trained = self._trained_params()
        params = {f"{name}.{pn}": p for name, m in self.method.modules.items()
                  for pn, p in m.named_parameters() if id(p) in trained}
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ConfigError(f"Backup {path} does not match this config's trainable weights "
                              f"(e.g. {missing[0]} is missing): LoRA rank, targets or components changed.",
                              key="resume")
        from trainer.fsdp import load_full_into
        with torch.no_grad():
            for k, p in params.items():
                load_full_into(p, weights[k])  # FSDP: each process takes its piece of the whole weight
        ts = torch.load(path / "training_state.pt", weights_only=False)
        try:
            self.optimizer.load_state_dict(ts["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"Backup {path}: its optimizer state does not fit this config's optimizer ({exc}). "
                              "Resume with the same training.optimizer and training.fused_backward settings.",
                              key="training.optimizer.name") from None
        if self.fsdp is not None:
            from trainer.fsdp import shard_optimizer_state
            shard_optimizer_state(self.optimizer)
        new_base_lrs = list(getattr(self.scheduler, "base_lrs", []))  # this config's learning rates
        self.scheduler.load_state_dict(ts["scheduler"])
        self._rebase_learning_rates(new_base_lrs)
        if ts.get("grad_scaler") and self.accelerator.scaler is not None:  # fp16: the loss scale reached
            self.accelerator.scaler.load_state_dict(ts["grad_scaler"])
        self.generator.set_state(ts["generator"])
        torch.set_rng_state(ts["torch_rng"])
        if ts.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ts["cuda_rng"])
        if ts.get("mps_rng") is not None and self.device.type == "mps":
            torch.mps.set_rng_state(ts["mps_rng"])
        random.setstate(ts["python_rng"])
        self.pos = Position(step=state["step"], epoch=state["epoch"], batch_in_epoch=state["batch_in_epoch"])
        self._apply_component_schedule()  # freeze what the uninterrupted run had frozen by this step
        if self.ema is not None and not self.ema.load(path):
            self.warn(f"Backup {path.name} has no EMA weights (EMA was off): the EMA starts from the resumed "
                      "weights.")
        self._last_backup_step = self.pos.step
        log.info("resumed from %s at step %d", path, self.pos.step)

    def _compare_with_backup_config(self, path: Path) -> None:
        """Resume with changed settings: refuse what cannot change (the model, what trains and its shape),
        apply the rest with one ``warning`` event per change (learning rates, schedule, sampling, backups …)."""
        saved = path / "config.yaml"
        if not saved.is_file():
            return  # a backup from before backups carried their config
        from omegaconf import OmegaConf
        try:
            from trainer.config import migrate
            old = _flat(to_container(migrate(OmegaConf.load(saved), str(saved))))  # a version-1 backup too
        except Exception:
            return
        new = _flat(to_container(self.cfg))
        def under(key: str, names: tuple) -> bool:
            return any(key == n or key.startswith(n + ".") or (n.endswith("_") and key.startswith(n)) for n in names)
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and not under(k, RESUME_IGNORED))
        fixed = [k for k in changed if under(k, RESUME_FIXED)]
        if fixed:
            shown = "; ".join(f"{k}: {old.get(k)!r} in the backup, {new.get(k)!r} now" for k in fixed[:4])
            raise ConfigError(f"Backup {path.name} cannot continue with these settings changed ({shown}): they change "
                              "the model or the shape of what trains. Resume with the backup's values, or start a "
                              "new run.", key=fixed[0])
        for k in changed:
            self.warn(f"Resumed with a changed setting: {k} was {old.get(k)!r} in backup {path.name}, now "
                      f"{new.get(k)!r}; the new value applies from step {json.loads((path / 'state.json').read_text())['step'] + 1}.")

    def _rebase_learning_rates(self, new_base_lrs: list) -> None:
        """A resumed scheduler restores the backup's base learning rates; a changed training.*learning_rate
        must win (config.yaml and the file's metadata say the new one)."""
        old = list(getattr(self.scheduler, "base_lrs", []))
        if not new_base_lrs or len(old) != len(new_base_lrs) or old == new_base_lrs:
            return
        self.scheduler.base_lrs = list(new_base_lrs)
        for group, base in zip(self.optimizer.param_groups, new_base_lrs):
            group["initial_lr"] = base
        lambdas = getattr(self.scheduler, "lr_lambdas", None)  # LambdaLR (diffusers' schedules): lr = base × λ(step)
        if lambdas is not None:
            lrs = [base * fn(self.scheduler.last_epoch) for base, fn in zip(new_base_lrs, lambdas)]
        else:
            import warnings
            with warnings.catch_warnings():  # torch warns when get_lr is called outside step()
                warnings.simplefilter("ignore", UserWarning)
                closed = getattr(self.scheduler, "_get_closed_form_lr", None)
                lrs = closed() if closed is not None else self.scheduler.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = list(lrs)

    # --- result ----------------------------------------------------------------------------
    def result_path(self, suffix: str = "") -> Path:
        o = self.cfg.output
        folder = Path(o.path) if o.path else self.run.path
        name = (o.name or self.run.path.name) + suffix
        return folder / (name + self.method.result_suffix(o.format))

    def save_result(self, suffix: str = "") -> Path:
        path = self.result_path(suffix)
        if not self.is_main and self.fsdp is None:
            return path
        self._weights_touched = self.world > 1
        if self.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"atelier_step": str(self.pos.step), "atelier_epoch": str(self.pos.epoch)}
        embed = self.cfg.output.get("config_metadata", "portable")
        if embed != "none":  # files are shared publicly: no home or data folders in them unless asked
            config = to_container(self.cfg)
            meta["atelier_config"] = json.dumps(config if embed == "full" else
                                                portable_paths(config, self.cfg.general.workspace))
        use_ema = self.ema is not None and self.cfg.ema.save_ema
        if use_ema:
            meta["atelier_ema"] = f"decay={self.cfg.ema.decay:g} updates={self.ema.optimization_step}"
        on_eval(self.optimizer)  # schedule-free optimizers: save the averaged weights
        try:
            with self.ema.applied() if use_ema else nullcontext(), self._whole_unet():
                if self.is_main:
                    self.method.save(path, self.cfg.output.dtype, meta)
        except (OSError, RuntimeError) as exc:
            from trainer.io import write_failure
            if "write" not in str(exc).lower() and not isinstance(exc, OSError):
                raise
            raise TrainingError(write_failure(exc, path.parent, f"the result {path.name}")) from None
        finally:
            on_train(self.optimizer)
        if not self.is_main:
            return path
        self.run.events.emit("saved", step=self.pos.step, path=str(path), format=self.cfg.output.format)
        log.info("saved %s", path)
        return path


    @contextmanager
    def _whole_unet(self):
        """FSDP: every process gathers the sharded UNet; on rank 0 ``model.unet`` is an unsharded CPU copy
        meanwhile, so the exporters read whole weights. Without FSDP: nothing to do."""
        if self.fsdp is None:
            yield
            return
        sharded = self.model.denoiser
        plain = self.fsdp.plain_copy(keep=self.is_main)
        if plain is not None:
            self.model.set_part("unet", plain)
        try:
            yield
        finally:
            self.model.set_part("unet", sharded)


def run_training(cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True,
                 warnings: Optional[List[str]] = None) -> int:
    """Run a whole training; returns the process exit code (0 finished/stopped, 1 failed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rank, world = env_rank_world()
    setup_logging(run_dir, rank)
    if rank == 0:
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "trainer.pid").write_text(json.dumps({"pid": os.getpid(), "pgid": procs.process_group_id(),
                                                         "started": time.time()}))
    if world > 1:
        rank_file(run_dir, rank, "error").unlink(missing_ok=True)  # a failure of an earlier attempt
        write_rank_info(run_dir, rank)
    trainer = Trainer(cfg, run_dir, resume=resume, progress=progress)
    stop_sigs = [sig for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)) if sig is not None]
    previous_handlers = {sig: signal.getsignal(sig) for sig in stop_sigs}
    trainer.install_signal_handlers()
    watcher = None
    if rank == 0:  # the UI's Stop (control/stop); with several processes rank 0 passes it on at the next sync
        since = _launched_at()
        watcher = procs.StopFileWatcher(run_dir, trainer.request_stop, since=since).start()
    ev = trainer.run.events
    for w in warnings or []:
        ev.emit("warning", message=w)
    try:
        trainer.setup()
        if cfg.data.only_cache:
            ev.emit("finished", step=0, message="caches are ready (data.only_cache); nothing trained")
            log.info("caches are ready; data.only_cache is on, so no training")
            return 0
        if trainer.stop_requested:
            ev.emit("stopped", step=0, message="stopped before training started")
            return 0
        trainer.train()
        return 0
    except KeyboardInterrupt:
        ev.emit("stopped", step=trainer.pos.step, message="stopped immediately (second stop request)")
        return 0
    except (ConfigError, TrainingError) as exc:
        log.error("%s", exc)
        ev.emit("error", message=str(exc), key=getattr(exc, "key", ""), traceback="")
        _failed(trainer, str(exc), "", peer_lost=False)
        return 1
    except Exception as exc:  # unexpected: keep the traceback for the UI and the log
        tb = traceback.format_exc()
        msg = f"{type(exc).__name__}: {exc}"
        from trainer.io import looks_like_write_failure, write_failure
        if looks_like_write_failure(exc):  # caches, samples …: a full disk or a read-only folder, said plainly
            msg = write_failure(exc, cfg.general.workspace, "the run's files (caches, samples, results)")
        elif "out of memory" in str(exc).lower():
            msg = ("The GPU ran out of memory. Lower training.batch_size or data.resolution, turn on "
                   "training.gradient_checkpointing, or use mixed precision / fp16-bf16 weights. (" + msg + ")")
        log.error("%s\n%s", msg, tb)
        try:
            ev.emit("error", message=msg, traceback=tb)
            _failed(trainer, msg, tb, peer_lost=isinstance(exc, PeerLost))
        except OSError as again:  # not even the reserve left room: say it where the user looks
            print(f"error: {msg}\n(the run folder's events.jsonl could not record it: {again})", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.close()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if getattr(trainer, "tb", None) is not None:
            trainer.tb.close()
        _end_process_group()
        for h in list(log.handlers):
            h.close()
            log.removeHandler(h)


def _launched_at() -> float:
    """When the UI launched this trainer (a stop file older than that is a leftover), else when it started."""
    try:
        return float(os.environ.get("ATELIER_LAUNCHED_AT", ""))
    except ValueError:
        return _PROCESS_START


def _failed(trainer: Trainer, message: str, tb: str, peer_lost: bool) -> None:
    """The ``failed`` event. Several processes: every failing rank writes rank-K-error.json; rank 0 names
    the rank that caused it (its own error, another rank's file, or a rank whose process is gone)."""
    if trainer.world == 1:
        trainer.run.events.emit("failed", step=trainer.pos.step, message=message)
        return
    write_rank_error(trainer.run.path, trainer.rank, message, tb)
    if not trainer.is_main:
        return
    rank, why = explain_failure(trainer.run.path, trainer.rank, message, peer_lost, trainer.world)
    trainer.run.events.emit("failed", step=trainer.pos.step, rank=rank, world_size=trainer.world,
                            message=f"rank {rank} of {trainer.world}: {why}")


def _end_process_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a peer already gone: nothing to tidy
        pass
