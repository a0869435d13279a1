"""The training loop, top to bottom: a run's state is set up, then each optimizer step takes its
micro-batches (forward, backward), ends them together over the processes, steps the optimizer, and reports;
samples, backups and validation come on their schedules; the end saves the result.

How the processes share the work (one, DDP, FSDP) is the strategy's (``state.par``, :mod:`trainer.parallel`);
the step's parts are in :mod:`trainer.train.step`, backups and the result in :mod:`trainer.train.checkpoint`,
samples in :mod:`trainer.train.sampling`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from trainer.config.load import save_config
from trainer.data.cache import cache_folder
from trainer.errors import ConfigError, TrainingError
from trainer.host import procs
from trainer.host.startup import resume_gc
from trainer.io import looks_like_write_failure, write_failure
from trainer.parallel.distributed import PeerLost, fault_injection
from trainer.parallel.launch import (
    crash_report,
    explain_failure,
    rank_file,
    record_crashes,
    stop_recording_crashes,
    write_rank_error,
    write_rank_info,
)
from trainer.methods.compute_copies import make_compute_copies
from trainer.parallel.plan import env_rank_world
from trainer.train.checkpoint import backup, load_backup, resolve_resume, save_result
from trainer.train.compile import (CACHE_ENV, KERNEL_CACHE, cache_counts, graph_break_reasons, graph_break_warning,
                                   kernel_cache)
from trainer.train.run_folder import list_backups, setup_logging
from trainer.train.sampling import sample
from trainer.train.setup import setup
from trainer.train.state import RunState
from trainer.train.step import apply_component_schedule, forward_loss, optimizer_step, validate
from trainer.train.transfer import LateRead, to_device

log = logging.getLogger("atelier")
_PROCESS_START = time.time()


def train(state: RunState) -> str:
    """From the first (or resumed) step to the result; returns "finished" or "stopped"."""

    cfg = state.cfg
    t = cfg.training
    ev = state.run.events
    par = state.par
    if state.resume:
        load_backup(state, resolve_resume(state.run, state.resume))
    ev.emit("started", total_steps=state.total_steps, epochs=t.epochs if not t.max_steps else
            math.ceil(state.total_steps / state.steps_per_epoch), steps_per_epoch=state.steps_per_epoch,
            batch_size=t.batch_size, gradient_accumulation_steps=t.gradient_accumulation_steps,
            resumed_from_step=state.pos.step, dataset=state.report.to_dict(),
            device=str(state.device), world_size=state.world, global_micro_batch=state.global_micro_batch,
            distributed=par.name, global_batch=state.global_micro_batch * t.gradient_accumulation_steps,
            cache=state.cache_summary)
    log.info("training %d steps (%d per epoch) on %s", state.total_steps, state.steps_per_epoch, state.device)
    if cfg.sampling.at_start and state.pos.step == 0:
        sample(state)
    accum = t.gradient_accumulation_steps
    t_start = time.time()
    steps_at_start = state.pos.step
    bar = _progress_bar(state)
    loss_sum = None  # the current optimizer step's loss, summed on the device
    # one process: a step's loss (its event, the finite check) is read when the next step has been queued, so the
    # host never waits for the device; several processes read it at once (their all-reduce carries it)
    late = LateRead(state.device)

    def report() -> None:  # the pending step's event, after its finite check
        ready = late.take()
        if ready is not None:
            _check_finite(state, ready[0], ready[1])
            _report_step(state, ready[0], ready[1], t_start, steps_at_start, bar)

    copies = make_compute_copies(state.method, cfg, state.world, state.device)  # bf16/fp16 LoRA weights, fp32 masters
    if copies is not None:
        copies.refresh()  # after a resumed backup's weights
        log.info("training.adapter_compute_copies: %d LoRA weights computed from %s copies", len(copies),
                 cfg.training.mixed_precision)
    computing = copies.computing if copies is not None else contextlib.nullcontext
    while state.pos.step < state.total_steps:
        usable = (len(state.data.epoch_batches(state.pos.epoch)) // accum) * accum
        for _, batch in par.batches(state.data, state.pos.epoch, state.pos.batch_in_epoch, usable):
            if state.pos.step >= state.total_steps:
                break
            last_of_step = (state.pos.batch_in_epoch + 1) % accum == 0
            batch = to_device(batch, state.device)  # pinned, non-blocking on CUDA
            with par.micro_batch(last_of_step), computing():  # DDP: no_sync unless last; all-reduce in backward
                loss = forward_loss(state, batch)
                state.accelerator.backward(loss / accum)
            if copies is not None:
                copies.add_grads()
            part = loss.detach().float() / accum  # the step's loss stays on the device
            del loss  # its graph (what backward left of it) goes now, not when the next forward has run
            loss_sum = part if loss_sum is None else loss_sum + part
            state.pos.batch_in_epoch += 1
            if not last_of_step:
                continue
            where = {"step": state.pos.step + 1, "epoch": state.pos.epoch}
            if state.world > 1:  # every process: the step's mean loss and whether any was asked to stop
                loss_sum, stop = par.end_step(float(loss_sum), state.stop_wanted)
                _check_finite(state, loss_sum, where)  # before the optimizer touches the weights
            else:
                stop = state.stop_wanted
            state.stop_requested = state.stop_requested or stop
            optimizer_step(state)
            if copies is not None:
                copies.refresh()
            state.pos.step += 1
            if state.ema is not None:
                state.ema.after_optimizer_step(state.pos.step)
            report()  # the step before (one process), its work long done
            late.put(loss_sum, **where)
            loss_sum = None
            if state.world > 1:
                report()
            _after_step(state, report)  # a backup or sample never follows an unchecked loss
            resume_gc()  # paused during a fresh process's start-up (trainer/host/startup.py); no-op after
            fault_injection(state.rank, state.pos.step)
            if state.stop_requested:
                report()
                return _stop(state, bar)
        if state.pos.batch_in_epoch >= usable:
            state.pos.epoch += 1
            state.pos.batch_in_epoch = 0
            _after_epoch(state, report)
            if state.stop_requested:
                report()
                return _stop(state, bar)
    report()
    if bar is not None:
        bar.close()
    if cfg.sampling.at_end and cfg.sampling.prompts:
        sample(state)
    path = save_result(state)
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**20 if cuda else None  # what the card must have (less the context)
    ev.emit("finished", step=state.pos.step, path=str(path), message="training finished",
            peak_vram_mib=None if peak is None else round(peak, 1),
            peak_vram_reserved_mib=None if reserved is None else round(reserved, 1))
    log.info("finished: %s", path)
    return "finished"


def _progress_bar(state: RunState):
    if not state.show_progress:
        return None
    try:
        from tqdm import tqdm  # optional here: a run without it just has no bar
    except ImportError:
        return None
    return tqdm(total=state.total_steps, initial=state.pos.step, unit="step", dynamic_ncols=True,
                file=sys.stderr, disable=not sys.stderr.isatty())


def _check_finite(state: RunState, loss: float, where: dict) -> None:
    """A non-finite loss ends the run. One process reads it a step late (the weights have taken one more step, so
    nothing is saved from them: every backup and sample reads the pending loss first)."""
    if math.isfinite(loss):
        return
    kept = list_backups(state.run.path)
    raise TrainingError(
        f"The loss became {loss} at step {where['step']} (epoch {where['epoch'] + 1}). "
        + (f"Training stopped; the last backup ({kept[-1].name}) is intact. " if kept else
           "Training stopped before any backup was written. ")
        + "Try a lower learning rate, model.vae_dtype = fp32, or bf16 instead of fp16.")


def _report_step(state: RunState, loss: float, where: dict, t_start: float, steps_at_start: int, bar) -> None:
    """The step event, TensorBoard, the log line of the step ``where`` names (its loss read now)."""
    step = where["step"]
    elapsed = where["time"] - t_start
    done = step - steps_at_start
    it_s = done / elapsed if elapsed > 0 else 0.0
    eta = (state.total_steps - step) / it_s if it_s > 0 else None
    # Prodigy / D-Adaptation keep lr at ~1 and learn a step size d: log the LR they actually use
    lrs = {g.get("name", str(i)): g["lr"] * g["d"] if isinstance(g.get("d"), float) else g["lr"]
           for i, g in enumerate(state.optimizer.param_groups)}
    extra = {}
    if state.compiled and done == 1:  # the first step of this process compiled the blocks
        extra["first_step_s"] = round(elapsed, 2)
        now, before = cache_counts(), state.compile_counts or {}
        made, loaded = (now[k] - before.get(k, 0) for k in ("misses", "hits"))
        log.info("training.compile: the first step, compiles included, took %.1f s (graphs compiled: %d, loaded "
                 "from the kernel cache: %d)", extra["first_step_s"], made, loaded)
        warning = graph_break_warning(now["breaks"] - before.get("breaks", 0), graph_break_reasons(),
                                      state.cfg.training.get("compile_scope", "blocks"))
        if warning:
            state.warn(warning)
    state.run.events.emit("step", step=step, total_steps=state.total_steps, epoch=where["epoch"] + 1,
                          loss=loss, lr=lrs, it_s=round(it_s, 4), eta_s=None if eta is None else round(eta, 1),
                          **extra)
    if state.tb is not None:
        state.tb.add_scalar("loss", loss, step)
        for name, lr in lrs.items():
            state.tb.add_scalar(f"lr/{name}", lr, step)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", epoch=where["epoch"] + 1)
    if step % 10 == 0 or step == state.total_steps:
        log.info("step %d/%d epoch %d loss %.5f lr %s", step, state.total_steps, where["epoch"] + 1, loss,
                 {k: f"{v:.3g}" for k, v in lrs.items()})


def _after_step(state: RunState, before_any) -> None:
    """The component schedule; then validation, samples and backups due at this step (``before_any`` first:
    the pending loss is read, and checked, before anything is made from the weights)."""
    apply_component_schedule(state)
    step = state.pos.step
    s, b = state.cfg.sampling, state.cfg.backup
    v = state.cfg.training.validation_every_n_steps
    validating = bool(v and step % v == 0)
    sampling = bool((s.every_n_steps and step % s.every_n_steps == 0 and step < state.total_steps)
                    or _requested(state, "sample"))
    backing_up = bool((b.every_n_steps and step % b.every_n_steps == 0) or _requested(state, "backup"))
    if validating or sampling or backing_up:
        before_any()
    if validating:
        validate(state)
    if sampling:
        sample(state)
    if backing_up:
        backup(state)


def _requested(state: RunState, what: str) -> bool:
    """The UI asked for a sample or backup now (rank 0 sees the request; with FSDP every process takes part
    in either, so the strategy passes rank 0's answer on)."""
    return state.par.agree(state.run.control_requested(what))


def _after_epoch(state: RunState, before_any) -> None:
    """Validation, samples, backups and saves due at the end of an epoch (``before_any`` first, as after a step)."""
    e = state.pos.epoch
    s, b, o = state.cfg.sampling, state.cfg.backup, state.cfg.output
    last = state.pos.step >= state.total_steps
    validating = not state.cfg.training.validation_every_n_steps and bool(state.data.validation_batches())
    sampling = bool(s.every_n_epochs and e % s.every_n_epochs == 0 and not (last and s.at_end))
    backing_up = bool(b.every_n_epochs and e % b.every_n_epochs == 0 and state.last_backup_step != state.pos.step)
    saving = bool(o.save_every_n_epochs and e % o.save_every_n_epochs == 0 and not last)
    if validating or sampling or backing_up or saving:
        before_any()
    if validating:
        validate(state)
    if sampling:
        sample(state)
    if backing_up:
        backup(state)
    if saving:
        save_result(state, suffix=f"-epoch{e:04d}")


def _stop(state: RunState, bar) -> str:
    if bar is not None:
        bar.close()
    path = None
    if state.cfg.backup.on_stop and state.pos.step > 0:
        path = backup(state) if state.last_backup_step != state.pos.step else \
            (list_backups(state.run.path) or [None])[-1]
    state.run.events.emit("stopped", step=state.pos.step, backup=str(path) if path else None,
                          message="stopped by request")
    log.info("stopped at step %d", state.pos.step)
    return "stopped"


def install_signal_handlers(state: RunState) -> None:
    """SIGINT/SIGTERM (and Ctrl+Break on Windows) ask the run to stop after the current step."""
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)):
        if sig is not None:
            signal.signal(sig, lambda signum, frame: state.request_stop(f"signal {signum}", from_signal=True))


def run_training(cfg, run_dir: Path, resume: Optional[str] = None, progress: bool = True,
                 warnings: Optional[List[str]] = None) -> int:
    """Run a whole training; returns the process exit code (0 finished/stopped, 1 failed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rank, world = env_rank_world()
    setup_logging(run_dir, rank)
    if world > 1:
        rank_file(run_dir, rank, "error").unlink(missing_ok=True)  # a failure of an earlier attempt
        write_rank_info(run_dir, rank)
        record_crashes(run_dir, rank)
    trainer = RunState(cfg, run_dir, resume=resume, progress=progress)
    stop_sigs = [sig for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)) if sig is not None]
    previous_handlers = {sig: signal.getsignal(sig) for sig in stop_sigs}
    install_signal_handlers(trainer)
    watcher = None
    if rank == 0:  # the UI's Stop (control/stop); with several processes rank 0 passes it on at the next sync
        since = _launched_at()
        watcher = procs.StopFileWatcher(run_dir, trainer.request_stop, since=since).start()
    ev = trainer.run.events
    for w in warnings or []:
        ev.emit("warning", message=w)
    resources = contextlib.ExitStack()  # held until the run ends
    try:
        if cfg.training.get("compile", False):  # what it compiles, kept for the next run (not in the temp folder)
            kept = resources.enter_context(kernel_cache(cache_folder(cfg) / KERNEL_CACHE))
            log.info("training.compile: compiled graphs and kernels cached in %s", kept or
                     f"{os.environ.get(CACHE_ENV) or 'the default folder'} ({CACHE_ENV})")
        if rank == 0:  # after the event stream (and its reserve) is open: a full disk here still ends in `failed`
            save_config(cfg, run_dir / "config.yaml")
            (run_dir / "trainer.pid").write_text(json.dumps({"pid": os.getpid(), "pgid": procs.process_group_id(),
                                                             "started": time.time()}))
        setup(trainer)
        if cfg.data.only_cache:
            ev.emit("finished", step=0, message="caches are ready (data.only_cache); nothing trained")
            log.info("caches are ready; data.only_cache is on, so no training")
            return 0
        if trainer.stop_requested:
            ev.emit("stopped", step=0, message="stopped before training started")
            return 0
        train(trainer)
        trainer.ended_together = True
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
        if looks_like_write_failure(exc):  # caches, samples …: a full disk or a read-only folder, said plainly
            cache = cfg.data.get("cache_dir") or Path(cfg.general.workspace or ".") / "cache"
            msg = write_failure(exc, [run_dir, cache], "the run's files (caches, samples, results)",
                                list_backups(run_dir))
            tb = ""  # said in full: no traceback for the user to read
        elif "out of memory" in str(exc).lower():
            msg = ("The GPU ran out of memory. Lower training.batch_size or data.resolution, turn on "
                   "training.gradient_checkpointing, or use mixed precision / fp16-bf16 weights. (" + msg + ")")
        if tb:
            log.error("%s\n%s", msg, tb)
        else:
            log.error("%s", msg)
        try:
            ev.emit("error", message=msg, traceback=tb)
            _failed(trainer, msg, tb, peer_lost=isinstance(exc, PeerLost))
        except OSError as again:  # not even the reserve left room: say it where the user looks
            print(f"error: {msg}\n(the run folder's events.jsonl could not record it: {again})", file=sys.stderr)
        return 1
    finally:
        resources.close()
        if watcher is not None:
            watcher.close()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if trainer.tb is not None:
            trainer.tb.close()
        _end_process_group(together=trainer.ended_together)
        if world > 1:
            stop_recording_crashes(run_dir, rank)
        for h in list(log.handlers):
            h.close()
            log.removeHandler(h)


def _launched_at() -> float:
    """When the UI launched this trainer (a stop file older than that is a leftover), else when it started."""
    try:
        return float(os.environ.get("ATELIER_LAUNCHED_AT", ""))
    except ValueError:
        return _PROCESS_START


def _failed(trainer: RunState, message: str, tb: str, peer_lost: bool) -> None:
    """The ``failed`` event. Several processes: every failing rank writes rank-K-error.json; rank 0 names
    the rank that caused it (its own error, another rank's file, or a rank whose process is gone)."""
    if trainer.world == 1:
        trainer.run.events.emit("failed", step=trainer.pos.step, message=message)
        return
    write_rank_error(trainer.run.path, trainer.rank, message, tb)
    if not trainer.is_main:
        return
    rank, why = explain_failure(trainer.run.path, trainer.rank, message, peer_lost, trainer.world)
    crash, whole = crash_report(trainer.run.path, rank) if rank != trainer.rank else ("", "")
    if crash:
        log.error("rank %d crashed; the Python stacks of its threads:\n%s", rank, whole.rstrip())
    trainer.run.events.emit("failed", step=trainer.pos.step, rank=rank, world_size=trainer.world,
                            message=f"rank {rank} of {trainer.world}: {why}")


def _end_process_group(together: bool = False) -> None:
    """Leave the process group. After a run every rank finished (``together``), first wait for the others at a
    barrier: a rank that tore its group down while a peer was still saving the result aborted once below Python
    ("terminate called without an active exception" in a gloo thread, a failed launch after a good run)."""
    try:
        if dist.is_available() and dist.is_initialized():
            if together:
                with contextlib.suppress(Exception):  # a peer gone meanwhile: nothing to wait for
                    dist.barrier()
            dist.destroy_process_group()
    except Exception:  # a peer already gone: nothing to tidy
        pass
