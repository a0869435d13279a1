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
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.config import ConfigError, save_config, to_container
from trainer.events import EventWriter
from trainer.optim import on_eval, on_train

log = logging.getLogger("atelier")


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
    def __init__(self, path: Path):
        self.path = Path(path)
        for sub in ("samples", "backups", "control"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self.events = EventWriter(self.path / "events.jsonl")

    @property
    def backups(self) -> Path:
        return self.path / "backups"

    def control_requested(self, what: str) -> bool:
        """The UI asks for 'sample' or 'backup' now by creating control/<what>."""
        f = self.path / "control" / what
        if f.exists():
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


def setup_logging(run_dir: Path) -> None:
    logger = logging.getLogger("atelier")
    logger.setLevel(logging.INFO)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    fh = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(sh)
    logger.propagate = False


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True):
        self.cfg = cfg
        self.run = RunFolder(run_dir)
        self.resume = resume
        self.show_progress = progress
        self.stop_requested = False
        self.pos = Position()
        self._last_backup_step = -1

    # --- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame):  # noqa: ARG002
        if self.stop_requested:
            log.warning("second stop request: stopping now without a backup")
            raise KeyboardInterrupt
        self.stop_requested = True
        log.info("stop requested (signal %s): finishing the current step, then a backup", signum)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    # --- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        g = cfg.general
        t = cfg.training
        cpu = g.device == "cpu" or (g.device == "auto" and not torch.cuda.is_available())
        if g.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("general.device = cuda, but no CUDA GPU is visible. Use auto or cpu.",
                              key="general.device")
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state()  # a second run in the same process (tests) may change precision
        self.accelerator = Accelerator(mixed_precision=t.mixed_precision, cpu=cpu)
        self.device = self.accelerator.device
        set_seed(g.seed)

        from trainer.data.pipeline import DataPipeline
        self.data = DataPipeline(cfg, warn=self.warn)
        self.report = self.data.report

        from trainer.models.base import load_model
        log.info("loading model %s", cfg.model.path)
        self.model = load_model(cfg.model, g.workspace, self.device)
        from trainer.methods.finetune import make_method
        self.method = make_method(self.model, cfg)
        self.method.prepare_data(self.data, self.warn)  # embedding placeholder: captions, tag dropout, warnings
        if t.gradient_checkpointing:
            for m in self.method.modules.values():
                m.gradient_checkpointing_enable() if hasattr(m, "gradient_checkpointing_enable") else \
                    m.enable_gradient_checkpointing()
        for name, m in self.method.modules.items():
            m.train()

        from trainer.optim import build_optimizer, build_scheduler, param_groups
        self.groups = param_groups(self.method, cfg)
        self.optimizer = build_optimizer(self.groups, cfg)
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

        # cached text outputs stay valid only while no text-side module trains
        frozen_text = not {"text_encoder", "text_encoder_2", "embedding"} & set(self.method.modules)
        self.data.prepare(self.model.encode_pixels, self.model.fingerprint(), cfg.model.vae_dtype,
                          encode_text_fn=(lambda captions: self.model.encode_captions(
                              self.method.expand_text(captions))) if frozen_text else None,
                          text_fingerprint=f"{cfg.model.path}:{cfg.model.text_encoder_dtype}:{cfg.model.clip_skip}")
        self.tb = None
        if g.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run.path / "tensorboard"))
            except Exception as exc:  # tensorboard missing: not fatal
                self.warn(f"TensorBoard logging is off: {exc}")

    def warn(self, message: str) -> None:
        log.warning(message)
        self.run.events.emit("warning", message=message)

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
        from trainer.loss import (choose_mask, make_noise, per_sample_loss, perturb_noise, sample_timesteps,
                                  weighted_mean)
        model = self.model
        lc = self.cfg.loss
        gen = self.generator if gen is None else gen  # all randomness of a step comes from here: exact resume
        latents = model.sample_latents(batch["latent_dist"], gen)
        noise = make_noise(latents.shape, gen, self.cfg.training.noise_offset).to(latents.device)
        timesteps = sample_timesteps(latents.shape[0], model.num_train_timesteps, lc, gen).to(latents.device)
        noisy, target = model.noisy_and_target(latents, noise, timesteps)
        if lc.input_perturbation > 0:  # the input gets extra noise; the target stays that of `noise`
            noisy, _ = model.noisy_and_target(latents, perturb_noise(noise, lc.input_perturbation, gen), timesteps)
        mask = choose_mask(batch.get("mask"), lc, gen)
        train_text = {"text_encoder", "text_encoder_2", "embedding"} & set(self.method.modules)
        with self.accelerator.autocast():
            cond = model.batch_condition(batch, self.method.expand_text, train_text)
            model_pred = model.predict(noisy.to(model.unet.dtype), timesteps, cond)
        losses = per_sample_loss(model_pred, target, lc, timesteps, model.noise_scheduler,
                                 mask=None if mask is None else mask.to(latents.device))
        return weighted_mean(losses, batch["loss_weights"])

    def validate(self) -> Optional[float]:
        """Mean loss over the validation concepts, with a fixed generator (same noise and timesteps every
        time, so the numbers are comparable) and the trained modules in eval mode; not trained on."""
        import torch
        if not self.data.validation_batches():
            return None
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
        cfg = self.cfg
        t = cfg.training
        ev = self.run.events
        if self.resume:
            self._load_backup(self._resolve_resume(self.resume))
        ev.emit("started", total_steps=self.total_steps, epochs=t.epochs if not t.max_steps else
                math.ceil(self.total_steps / self.steps_per_epoch), steps_per_epoch=self.steps_per_epoch,
                batch_size=t.batch_size, gradient_accumulation_steps=t.gradient_accumulation_steps,
                resumed_from_step=self.pos.step, dataset=self.report.to_dict(),
                device=str(self.device))
        log.info("training %d steps (%d per epoch) on %s", self.total_steps, self.steps_per_epoch, self.device)
        if cfg.sampling.at_start and self.pos.step == 0:
            self.sample()
        accum = t.gradient_accumulation_steps
        t_start = time.time()
        steps_at_start = self.pos.step
        bar = self._progress_bar()
        loss_acc = 0.0
        while self.pos.step < self.total_steps:
            usable = (len(self.data.epoch_batches(self.pos.epoch)) // accum) * accum
            for bi, batch in self.data.iter_batches(self.pos.epoch, self.pos.batch_in_epoch, usable):
                if self.pos.step >= self.total_steps:
                    break
                loss = self._forward_loss(batch)
                if not torch.isfinite(loss):
                    raise TrainingError(
                        f"The loss became {loss.item()} at step {self.pos.step + 1} (epoch {self.pos.epoch + 1}). "
                        "Training stopped; the last backup is intact. Try a lower learning rate, "
                        "model.vae_dtype = fp32, or bf16 instead of fp16.")
                self.accelerator.backward(loss / accum)
                loss_acc += loss.item() / accum
                self.pos.batch_in_epoch += 1
                if self.pos.batch_in_epoch % accum:
                    continue
                if t.max_grad_norm > 0:
                    self.accelerator.clip_grad_norm_([p for g in self.groups for p in g["params"]],
                                                     t.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.pos.step += 1
                if self.ema is not None:
                    self.ema.after_optimizer_step(self.pos.step)
                self._after_step(loss_acc, t_start, steps_at_start, bar)
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
        peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        ev.emit("finished", step=self.pos.step, path=str(path), message="training finished",
                peak_vram_mib=None if peak is None else round(peak, 1))
        log.info("finished: %s", path)
        return "finished"

    def _progress_bar(self):
        if not self.show_progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total_steps, initial=self.pos.step, unit="step", dynamic_ncols=True,
                    file=sys.stderr, disable=not sys.stderr.isatty())

    def _after_step(self, loss: float, t_start: float, steps_at_start: int, bar) -> None:
        step = self.pos.step
        elapsed = time.time() - t_start
        done = step - steps_at_start
        it_s = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total_steps - step) / it_s if it_s > 0 else None
        lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
        self.run.events.emit("step", step=step, total_steps=self.total_steps, epoch=self.pos.epoch + 1,
                             loss=loss, lr=lrs, it_s=round(it_s, 4), eta_s=None if eta is None else round(eta, 1))
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
                or self.run.control_requested("sample"):
            self.sample()
        if (b.every_n_steps and step % b.every_n_steps == 0) or self.run.control_requested("backup"):
            self.backup()

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
            path = self.backup() if self._last_backup_step != self.pos.step else list_backups(self.run.path)[-1]
        self.run.events.emit("stopped", step=self.pos.step, backup=str(path) if path else None,
                             message="stopped by request")
        log.info("stopped at step %d", self.pos.step)
        return "stopped"

    # --- samples ---------------------------------------------------------------------------
    def sample(self) -> List[str]:
        import torch
        prompts = list(self.cfg.sampling.prompts)
        if not prompts:
            return []
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
                        with torch.no_grad(), self.accelerator.autocast():
                            image = pipe(self.method.expand_text(sp.prompt),  # embedding placeholders
                                         negative_prompt=self.method.expand_text(sp.negative_prompt) or None,
                                         num_inference_steps=sp.steps, guidance_scale=sp.cfg_scale,
                                         width=sp.width, height=sp.height, generator=gen,
                                         **self.model.sampling_kwargs()).images[0]
                        path = self.run.path / "samples" / f"step{self.pos.step:06d}-p{i}{suffix}.png"
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

    # --- backups ---------------------------------------------------------------------------
    def _trainable_state(self) -> Dict[str, Any]:
        return {f"{name}.{pn}": p.detach().cpu().contiguous()
                for name, m in self.method.modules.items()
                for pn, p in m.named_parameters() if p.requires_grad}

    def backup(self) -> Path:
        import torch
        from safetensors.torch import save_file
        from trainer.io import atomic_dir
        target = self.run.backups / f"backup-step{self.pos.step:06d}"
        with atomic_dir(target) as tmp:
            tmp = Path(tmp)
            save_file(self._trainable_state(), str(tmp / "trainable.safetensors"))
            if self.ema is not None:
                self.ema.save(tmp)  # ema.safetensors + ema.json
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "python_rng": random.getstate()}, tmp / "training_state.pt")
            (tmp / "state.json").write_text(json.dumps({**asdict(self.pos), "time": time.time(),
                                                        "method": self.cfg.training.method,
                                                        "model": self.cfg.model.path}))
        self._last_backup_step = self.pos.step
        for old in list_backups(self.run.path)[:-self.cfg.backup.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self.run.events.emit("backup", step=self.pos.step, path=str(target))
        log.info("backup written: %s", target)
        return target

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
        weights = load_file(str(path / "trainable.safetensors"))
        params = {f"{name}.{pn}": p for name, m in self.method.modules.items()
                  for pn, p in m.named_parameters() if p.requires_grad}
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ConfigError(f"Backup {path} does not match this config's trainable weights "
                              f"(e.g. {missing[0]} is missing): LoRA rank, targets or components changed.",
                              key="resume")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(weights[k].to(p.device, p.dtype))
        ts = torch.load(path / "training_state.pt", weights_only=False)
        self.optimizer.load_state_dict(ts["optimizer"])
        self.scheduler.load_state_dict(ts["scheduler"])
        self.generator.set_state(ts["generator"])
        torch.set_rng_state(ts["torch_rng"])
        if ts.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ts["cuda_rng"])
        random.setstate(ts["python_rng"])
        self.pos = Position(step=state["step"], epoch=state["epoch"], batch_in_epoch=state["batch_in_epoch"])
        if self.ema is not None and not self.ema.load(path):
            self.warn(f"Backup {path.name} has no EMA weights (EMA was off): the EMA starts from the resumed "
                      "weights.")
        self._last_backup_step = self.pos.step
        log.info("resumed from %s at step %d", path, self.pos.step)

    # --- result ----------------------------------------------------------------------------
    def result_path(self, suffix: str = "") -> Path:
        o = self.cfg.output
        folder = Path(o.path) if o.path else self.run.path
        name = (o.name or self.run.path.name) + suffix
        return folder / (name + self.method.result_suffix(o.format))

    def save_result(self, suffix: str = "") -> Path:
        path = self.result_path(suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"atelier_config": json.dumps(to_container(self.cfg)), "atelier_step": str(self.pos.step),
                "atelier_epoch": str(self.pos.epoch)}
        use_ema = self.ema is not None and self.cfg.ema.save_ema
        if use_ema:
            meta["atelier_ema"] = f"decay={self.cfg.ema.decay:g} updates={self.ema.optimization_step}"
        on_eval(self.optimizer)  # schedule-free optimizers: save the averaged weights
        try:
            with self.ema.applied() if use_ema else nullcontext():
                self.method.save(path, self.cfg.output.dtype, meta)
        finally:
            on_train(self.optimizer)
        self.run.events.emit("saved", step=self.pos.step, path=str(path), format=self.cfg.output.format)
        log.info("saved %s", path)
        return path


def run_training(cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True,
                 warnings: Optional[List[str]] = None) -> int:
    """Run a whole training; returns the process exit code (0 finished/stopped, 1 failed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "trainer.pid").write_text(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0),
                                                     "started": time.time()}))
    trainer = Trainer(cfg, run_dir, resume=resume, progress=progress)
    previous_handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    trainer.install_signal_handlers()
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
        ev.emit("failed", step=trainer.pos.step, message=str(exc))
        return 1
    except Exception as exc:  # unexpected: keep the traceback for the UI and the log
        tb = traceback.format_exc()
        msg = f"{type(exc).__name__}: {exc}"
        if "out of memory" in str(exc).lower():
            msg = ("The GPU ran out of memory. Lower training.batch_size or data.resolution, turn on "
                   "training.gradient_checkpointing, or use mixed precision / fp16-bf16 weights. (" + msg + ")")
        log.error("%s\n%s", msg, tb)
        ev.emit("error", message=msg, traceback=tb)
        ev.emit("failed", step=trainer.pos.step, message=msg)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous_handlers[0])
        signal.signal(signal.SIGTERM, previous_handlers[1])
        if getattr(trainer, "tb", None) is not None:
            trainer.tb.close()
        for h in list(log.handlers):
            h.close()
            log.removeHandler(h)
