"""Backups (everything a resume needs to continue exactly), resuming from one, and the run's result.

Exact resume: everything random in a step comes from state that a backup stores — a dedicated
``torch.Generator`` (noise, timesteps, latent sampling), the global torch RNG (dropout), and data
choices (order, captions, crops, flips) that are pure functions of (seed, epoch, position).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

import safetensors.torch  # save_file looked up at call time (a test fills the disk through it)
import torch
from omegaconf import OmegaConf

from trainer.config.load import migrate, to_container, to_yaml
from trainer.errors import ConfigError, TrainingError
from trainer.io import atomic_dir, write_failure
from trainer.optim.build import on_eval, on_train, portable_state, restore_kernels
from trainer.parallel.fsdp import full_tensor, load_full_into
from trainer.train.run_folder import RunFolder, list_backups, portable_paths
from trainer.train.state import Position, RunState
from trainer.train.step import apply_component_schedule, trained_params

log = logging.getLogger("atelier")

# Resume: settings whose change makes a backup meaningless (refused), and bookkeeping never compared.
# model.path may change (a moved or re-downloaded file): a warning, and the trainable weights must still fit.
RESUME_FIXED = ("model.family", "training.method", "parts.denoiser.train", "parts.text_encoder_1.train",
                "parts.text_encoder_2.train", "parts.text_encoder_3.train", "lora.type", "lora.rank", "lora.alpha",
                "parts.denoiser.lora_targets",
                "lora.custom_targets", "lora.conv_rank", "lora.conv_alpha", "lora.factor", "lora.decompose_both",
                "embedding.placeholder", "embedding.num_vectors", "embedding.train_alongside",
                "training.optimizer.name",
                "lora.lokr_full_matrix", "lora.loraplus_lr_ratio", "lora.loraplus_text_encoder_lr_ratio")
RESUME_IGNORED = ("general.workspace", "general.run_name", "version", "general.num_processes", "general.gpu_ids",
                  "training.batch_size")  # batch: the global batch is kept across process counts (see setup)


def _flat(node: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config as dotted keys (lists compared whole)."""
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def trainable_state(state: RunState) -> Dict[str, Any]:
    """Whole trained weights on the CPU (FSDP: gathered by every process, kept by rank 0)."""
    trained = trained_params(state)  # not requires_grad: components past their window stay in backups
    out = {}
    for name, m in state.method.modules.items():
        for pn, p in m.named_parameters():
            if id(p) in trained:
                full = full_tensor(p.detach())
                if state.is_main:
                    out[f"{name}.{pn}"] = full.cpu().contiguous()
    return out


def backup(state: RunState) -> Path:
    """``backups/backup-step<STEP>/``, written atomically; the oldest beyond ``backup.keep_last`` go."""
    target = state.run.backups / f"backup-step{state.pos.step:06d}"
    weights = optimizer_state = None
    if state.par.sharded:  # every process gathers its shards; rank 0 writes the same files as DDP
        weights = trainable_state(state)
        optimizer_state = state.par.full_optimizer_state(state.optimizer)
    if not state.is_main:  # DDP: every process holds the same weights and optimizer state: rank 0 writes
        state.last_backup_step = state.pos.step
        return None
    try:
        write_backup(state, target, weights, optimizer_state)
    except (OSError, RuntimeError) as exc:  # a full disk, a permission problem: one clear message
        raise TrainingError(write_failure(exc, state.run.backups, "a backup", list_backups(state.run.path))) from None
    state.last_backup_step = state.pos.step
    for old in list_backups(state.run.path)[:-state.cfg.backup.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    state.run.events.emit("backup", step=state.pos.step, path=str(target))
    log.info("backup written: %s", target)
    return target


def write_backup(state: RunState, target: Path, weights, optimizer_state) -> None:
    with atomic_dir(target) as tmp:
        tmp = Path(tmp)
        safetensors.torch.save_file(weights if weights is not None else trainable_state(state), str(tmp / "trainable.safetensors"))
        if state.ema is not None:
            state.ema.save(tmp)  # ema.safetensors + ema.json
        optimizer_state = optimizer_state if optimizer_state is not None else state.optimizer.state_dict()
        torch.save({"optimizer": portable_state(optimizer_state),
                    "scheduler": state.scheduler.state_dict(),
                    "grad_scaler": None if state.accelerator.scaler is None else state.accelerator.scaler.state_dict(),
                    "generator": state.generator.get_state(), "torch_rng": torch.get_rng_state(),
                    "device_generator": _device_generator_state(state),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    "mps_rng": torch.mps.get_rng_state() if state.device.type == "mps" else None,
                    "python_rng": random.getstate()}, tmp / "training_state.pt")
        (tmp / "config.yaml").write_text(to_yaml(state.cfg), encoding="utf-8")  # what resume compares with
        (tmp / "state.json").write_text(json.dumps({**asdict(state.pos), "time": time.time(),
                                                    "method": state.cfg.training.method,
                                                    "world_size": state.world,
                                                    "global_micro_batch": state.global_micro_batch,
                                                    "gradient_accumulation_steps":
                                                        state.cfg.training.gradient_accumulation_steps,
                                                    "model": state.cfg.model.path}))


def _device_generator_state(state: RunState):
    """The state of the generator the step draws its tensors with, when it is not the CPU one (a GPU's)."""
    gen = state.device_generator
    return None if gen is None or gen is state.generator else gen.get_state()


def resolve_resume(run: RunFolder, resume: str) -> Path:
    """The backup folder ``--resume`` names: ``last`` (the run's newest) or a folder with a state.json."""
    if resume == "last":
        found = list_backups(run.path)
        if not found:
            raise ConfigError(f"--resume last: no backup in {run.backups}. Start without --resume, "
                              "or give a backup folder.", key="resume")
        return found[-1]
    p = Path(resume)
    if not (p / "state.json").exists():
        raise ConfigError(f"--resume '{resume}' is not a backup folder (no state.json).", key="resume")
    return p


def load_backup(state: RunState, path: Path) -> None:
    """Continue where a backup stopped: trained weights, optimizer, schedule, loss scale, every RNG, position."""
    saved = json.loads((path / "state.json").read_text())
    if saved.get("method") != state.cfg.training.method:
        raise ConfigError(f"Backup {path} is from a {saved.get('method')} run; this config trains "
                          f"{state.cfg.training.method}.", key="training.method")
    compare_with_backup_config(state, path)
    weights = safetensors.torch.load_file(str(path / "trainable.safetensors"))
    trained = trained_params(state)
    params = {f"{name}.{pn}": p for name, m in state.method.modules.items()
              for pn, p in m.named_parameters() if id(p) in trained}
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ConfigError(f"Backup {path} does not match this config's trainable weights "
                          f"(e.g. {missing[0]} is missing): LoRA rank, targets or components changed.",
                          key="resume")
    with torch.no_grad():
        for k, p in params.items():
            load_full_into(p, weights[k])  # FSDP: each process takes its piece of the whole weight
    ts = torch.load(path / "training_state.pt", weights_only=False)
    try:
        state.optimizer.load_state_dict(ts["optimizer"])
        restore_kernels(state.optimizer)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"Backup {path}: its optimizer state does not fit this config's optimizer ({exc}). "
                          "Resume with the same training.optimizer and training.fused_backward settings.",
                          key="training.optimizer.name") from None
    state.par.shard_optimizer_state(state.optimizer)  # FSDP: each process keeps its pieces
    new_base_lrs = list(getattr(state.scheduler, "base_lrs", []))  # this config's learning rates
    state.scheduler.load_state_dict(ts["scheduler"])
    rebase_learning_rates(state, new_base_lrs)
    if ts.get("grad_scaler") and state.accelerator.scaler is not None:  # fp16: the loss scale reached
        state.accelerator.scaler.load_state_dict(ts["grad_scaler"])
    state.generator.set_state(ts["generator"])
    if ts.get("device_generator") is not None and _device_generator_state(state) is not None:
        try:
            state.device_generator.set_state(ts["device_generator"])
        except RuntimeError:  # a backup made on another kind of device: its draws go on from this seed
            state.warn(f"Backup {path.name} was made on another kind of device: the noise and timesteps drawn "
                       "from here on differ from an uninterrupted run's.")
    torch.set_rng_state(ts["torch_rng"])
    if ts.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ts["cuda_rng"])
    if ts.get("mps_rng") is not None and state.device.type == "mps":
        torch.mps.set_rng_state(ts["mps_rng"])
    random.setstate(ts["python_rng"])
    state.pos = Position(step=saved["step"], epoch=saved["epoch"], batch_in_epoch=saved["batch_in_epoch"])
    apply_component_schedule(state)  # freeze what the uninterrupted run had frozen by this step
    if state.ema is not None and not state.ema.load(path):
        state.warn(f"Backup {path.name} has no EMA weights (EMA was off): the EMA starts from the resumed "
                  "weights.")
    state.last_backup_step = state.pos.step
    log.info("resumed from %s at step %d", path, state.pos.step)


def compare_with_backup_config(state: RunState, path: Path) -> None:
    """Resume with changed settings: refuse what cannot change (the model, what trains and its shape),
    apply the rest with one ``warning`` event per change (learning rates, schedule, sampling, backups …)."""
    saved = path / "config.yaml"
    if not saved.is_file():
        return  # a backup from before backups carried their config
    try:
        old = _flat(to_container(migrate(OmegaConf.load(saved), str(saved))))  # a version-1 backup too
    except Exception:
        return
    new = _flat(to_container(state.cfg))
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
        state.warn(f"Resumed with a changed setting: {k} was {old.get(k)!r} in backup {path.name}, now "
                  f"{new.get(k)!r}; the new value applies from step {json.loads((path / 'state.json').read_text())['step'] + 1}.")


def rebase_learning_rates(state: RunState, new_base_lrs: list) -> None:
    """A resumed scheduler restores the backup's base learning rates; a changed training.*learning_rate
    must win (config.yaml and the file's metadata say the new one)."""
    old = list(getattr(state.scheduler, "base_lrs", []))
    if not new_base_lrs or len(old) != len(new_base_lrs) or old == new_base_lrs:
        return
    state.scheduler.base_lrs = list(new_base_lrs)
    for group, base in zip(state.optimizer.param_groups, new_base_lrs):
        group["initial_lr"] = base
    lambdas = getattr(state.scheduler, "lr_lambdas", None)  # LambdaLR (diffusers' schedules): lr = base × λ(step)
    if lambdas is not None:
        lrs = [base * fn(state.scheduler.last_epoch) for base, fn in zip(new_base_lrs, lambdas)]
    else:
        with warnings.catch_warnings():  # torch warns when get_lr is called outside step()
            warnings.simplefilter("ignore", UserWarning)
            closed = getattr(state.scheduler, "_get_closed_form_lr", None)
            lrs = closed() if closed is not None else state.scheduler.get_lr()
    for group, lr in zip(state.optimizer.param_groups, lrs):
        group["lr"] = lr
    state.scheduler._last_lr = list(lrs)


def result_path(state: RunState, suffix: str = "") -> Path:
    o = state.cfg.output
    folder = Path(o.path) if o.path else state.run.path
    name = (o.name or state.run.path.name) + suffix
    return folder / (name + state.method.result_suffix(o.format))


def save_result(state: RunState, suffix: str = "") -> Path:
    path = result_path(state, suffix)
    if not state.par.evaluates_here:
        return path
    state.par.weights_touched()
    if state.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"atelier_step": str(state.pos.step), "atelier_epoch": str(state.pos.epoch)}
    embed = state.cfg.output.get("config_metadata", "portable")
    if embed != "none":  # files are shared publicly: no home or data folders in them unless asked
        config = to_container(state.cfg)
        meta["atelier_config"] = json.dumps(config if embed == "full" else
                                            portable_paths(config, state.cfg.general.workspace))
    use_ema = state.ema is not None and state.cfg.ema.save_ema
    if use_ema:
        meta["atelier_ema"] = f"decay={state.cfg.ema.decay:g} updates={state.ema.optimization_step}"
    on_eval(state.optimizer)  # schedule-free optimizers: save the averaged weights
    try:
        with state.ema.applied() if use_ema else nullcontext(), state.par.whole_denoiser(state.model):
            if state.is_main:
                state.method.save(path, state.cfg.output.dtype, meta)
    except (OSError, RuntimeError) as exc:
        if "write" not in str(exc).lower() and not isinstance(exc, OSError):
            raise
        raise TrainingError(write_failure(exc, path.parent, f"the result {path.name}",
                                          list_backups(state.run.path))) from None
    finally:
        on_train(state.optimizer)
    if not state.is_main:
        return path
    state.run.events.emit("saved", step=state.pos.step, path=str(path), format=state.cfg.output.format)
    log.info("saved %s", path)
    return path
