"""Command line: ``python -m trainer train|validate|presets|config-help|make-tiny|estimate-vram …`` and the
model tools ``convert|merge|resize|sample`` (trainer/tools/).

Only the ``train`` path imports torch; ``--help``, ``validate`` and ``config-help`` stay fast.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

from trainer.config.checks import check_config, cross_field_warnings, issue_line, load_config
from trainer.config.fields import all_keys, field_info
from trainer.config.load import preset_names, resolve_preset
from trainer.config.paths import outside
from trainer.data.report import print_report
from trainer.errors import ConfigError, Issue, every_error
from trainer.events import EventWriter, read_events, run_state
from trainer.host.devices import enable_mps_fallback
from trainer.host.paths import Confinement, confine
from trainer.host.procs import stop_signals
from trainer.host.startup import pause_gc, start_train_imports
from trainer.memory.estimate_report import add_arguments as add_estimate_arguments
from trainer.optim.rules import class_check_needed
from trainer.parallel.launch import check_devices, dead_ranks, launch_argv, rank_errors
from trainer.parallel.plan import env_rank_world, launched
from trainer.tools.cli import COMMANDS as TOOL_COMMANDS, add_parsers, run as run_tool
from trainer.train.runlock import RunFolderBusy, acquire, release


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Atelier: train LoRA and fine-tunes "
                                "of text-to-image diffusion models.")
    sub = p.add_subparsers(dest="command", required=True)

    def add_config_args(sp):
        sp.add_argument("config", nargs="?", help="Run config YAML (may name a preset with 'base:').")
        sp.add_argument("--preset", help="Start from a built-in preset (see 'presets').")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override one setting, e.g. --set training.epochs=20 (repeatable).")
        sp.add_argument("--allowed-root", action="append", default=[], metavar="FOLDER",
                        help="Confine the run to these folders (repeatable; the web UI passes its folders): every "
                             "path of the config, after links are resolved, must lie below one, and images whose "
                             "links lead elsewhere are skipped.")
        sp.add_argument("--read-only-root", action="append", default=[], metavar="FOLDER",
                        help="With --allowed-root: a folder the run may read but not write (Atelier's presets).")

    t = sub.add_parser("train", help="Train (writes a run folder under <workspace>/runs/).")
    add_config_args(t)
    t.add_argument("--run-dir", help="Use this run folder instead of <workspace>/runs/<run_name>.")
    t.add_argument("--resume", metavar="last|BACKUP_DIR",
                   help="Continue from the newest backup of --run-dir ('last') or from a backup folder.")
    t.add_argument("--no-progress", action="store_true", help="No progress bar on the terminal.")
    t.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="Train with N processes (one per GPU; sets general.num_processes). More than 1 "
                        "launches through accelerate. Inside accelerate launch / torchrun this is not needed.")

    v = sub.add_parser("validate", help="Check a config: errors and warnings, without loading a model.")
    add_config_args(v)
    v.add_argument("--json", action="store_true", help="Print the result as JSON.")

    c = sub.add_parser("cache", help="Fill the latent and text caches, then stop (no training).")
    add_config_args(c)
    c.add_argument("--run-dir", help="Run folder for the caching job's events and log.")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--resume", default=None, help=argparse.SUPPRESS)

    dr = sub.add_parser("data-report", help="Scan the concepts and report what training would see.")
    add_config_args(dr)
    dr.add_argument("--json", action="store_true", help="Print the report as JSON.")

    sub.add_parser("presets", help="List the built-in presets.")
    h = sub.add_parser("config-help", help="List every setting with its default and help text.")
    h.add_argument("--json", action="store_true")
    mt = sub.add_parser("make-tiny", help="Build the tiny offline models (diffusers folder + single file).")
    mt.add_argument("--workspace", default="workspace")
    ev = sub.add_parser("estimate-vram", help="Estimate a run's peak GPU memory (no GPU, no weights: fake tensors).",
                        description="Estimate the peak GPU memory of a config's or preset's training, and whether it "
                                    "fits a card, without a GPU and without weights (1-2 minutes for SDXL on a CPU).")
    add_estimate_arguments(ev)
    add_parsers(sub)  # convert, merge, resize, sample
    return p


def _load(args):
    if not args.config and not args.preset:
        raise SystemExit("error: give a config file or --preset NAME (see 'python -m trainer presets').")
    return load_config(args.config, args.overrides, preset=args.preset)


def _run_dir(cfg, given: Optional[str]) -> Path:
    if given:
        return Path(given)
    name = cfg.general.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    return Path(cfg.general.workspace) / "runs" / name


def _effective_batch(cfg) -> str:
    t = cfg.training
    n = int(cfg.general.get("num_processes", 1) or 1)
    return (f"effective batch: {t.batch_size} per process x {t.gradient_accumulation_steps} accumulation x "
            f"{n} process(es) = {t.batch_size * t.gradient_accumulation_steps * n}")


def _one_gpu(cfg, apply: bool) -> Optional[str]:
    """One process on a chosen GPU (``general.gpu_ids`` = one id): make it the only one this process sees,
    as accelerate's ``--gpu_ids`` does for several. Returns an error message for a list that cannot work."""
    g = cfg.general
    ids = [s.strip() for s in str(g.get("gpu_ids", "") or "").split(",") if s.strip()]
    if int(g.get("num_processes", 1) or 1) != 1 or not ids or g.device == "cpu":
        return None
    if len(ids) > 1:
        return (f"general.gpu_ids lists {len(ids)} GPUs ({','.join(ids)}) but general.num_processes = 1: set "
                f"num_processes = {len(ids)} to train on all of them, or list one GPU.")
    if not ids[0].isdigit():
        return f"general.gpu_ids = {ids[0]!r} is not a GPU number (0, 1, ...)."
    if apply:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        if seen:  # already narrowed: the id counts within what this process may see
            visible = [s.strip() for s in seen.split(",") if s.strip()]
            if int(ids[0]) >= len(visible):
                return (f"general.gpu_ids = {ids[0]}, but CUDA_VISIBLE_DEVICES={seen} leaves GPUs 0..{len(visible) - 1}.")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(ids[0])]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[0]
    return None


def _launch(cfg, argv: List[str], run_dir: Path) -> int:
    """Run this same command under ``accelerate launch`` with general.num_processes processes, wait,
    and make sure the run ends with a terminal event naming the failed rank (a rank can die too hard
    to write one itself)."""

    rest = [a for a in argv]
    if "--run-dir" not in rest:
        rest += ["--run-dir", str(run_dir)]
    cmd = launch_argv(cfg, rest, sys.executable)
    print(f"launching {cfg.general.num_processes} processes: {' '.join(cmd)}", file=sys.stderr)
    handlers = {s: signal.signal(s, lambda *_: None) for s in stop_signals() if s != getattr(signal, "SIGHUP", None)}  # ranks stop
    try:
        rc = subprocess.call(cmd, env=dict(os.environ, ATELIER_LAUNCHED="1"))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    if rc != 0 and run_state(events) not in ("failed", "stopped", "finished"):
        errs = rank_errors(run_dir)
        dead = dead_ranks(run_dir, int(cfg.general.num_processes))
        if errs:
            rank, why = int(errs[0]["rank"]), str(errs[0].get("message", ""))
        elif dead:
            rank, why = dead[0], "the process ended without a Python error (killed, out of memory, or exited)"
        else:
            rank, why = -1, "the launcher failed before or while starting the processes"
        step = max([e.get("step", 0) for e in events if e.get("type") == "step"] or [0])
        EventWriter(run_dir / "events.jsonl").emit(
            "failed", step=step, rank=rank, world_size=int(cfg.general.num_processes),
            message=(f"rank {rank}: " if rank >= 0 else "") + f"{why} (launcher exit code {rc})")
    if run_state(events) in ("stopped", "finished"):  # a stop: the launcher may exit non-zero after it
        return 0
    return 0 if rc == 0 else 1


def main(argv: Optional[List[str]] = None, fresh_process: bool = False) -> int:
    """The CLI. ``fresh_process``: this is its own ``python -m trainer`` process (start-up trims apply)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if fresh_process and args.command == "train":
        # a crash below Python (a segfault in a native library, an abort in a collective) prints every
        # thread's Python stack to stderr, which the run's log and torchrun keep
        faulthandler.enable(all_threads=True)
        pause_gc()  # until set-up is done (see trainer/host/startup.py)
    enable_mps_fallback()  # Apple Silicon: before torch loads, or operations MPS lacks fail instead of running on the CPU

    if args.command == "presets":
        for name in preset_names():
            first = resolve_preset(name).read_text(encoding="utf-8").splitlines()[:1]
            print(f"{name:24s} {first[0].lstrip('# ') if first else ''}")
        return 0
    if args.command == "config-help":
        rows = []
        for key in all_keys():
            fld, tp = field_info(key)
            rows.append({"key": key, "default": None if callable(getattr(fld, "default_factory", None))
                         and fld.default is fld.default_factory else repr(fld.default), **fld.metadata})
        if args.json:
            print(json.dumps(rows, indent=1, default=str))
        else:
            for r in rows:
                extra = f" [{', '.join(r['choices'])}]" if "choices" in r else ""
                print(f"{r['key']}: {r['help']}{extra}")
        return 0
    if args.command == "make-tiny":
        from trainer.families.common.sd_kit.tiny import TINY_NAMES, ensure_tiny_model  # torch: this command only
        for name in TINY_NAMES:
            paths = ensure_tiny_model(name, Path(args.workspace) / "models")
            print(name, paths["diffusers"], paths["single_file"])
        return 0
    if args.command == "estimate-vram":
        from trainer.memory.estimate import run_command as estimate_vram  # torch: only this command loads it
        return estimate_vram(args)
    if args.command in TOOL_COMMANDS:
        return run_tool(args)

    if args.command == "validate":
        return _validate(args)
    try:
        if getattr(args, "num_processes", None):
            args.overrides.append(f"general.num_processes={args.num_processes}")
        cfg = _load(args)
    except ConfigError as exc:
        for error in every_error(exc):
            print(f"Config error: {error}", file=sys.stderr)
        return 2 if args.command == "train" else 1
    if args.command == "data-report":
        return print_report(cfg, as_json=args.json)
    issues = cross_field_warnings(cfg)
    if args.allowed_root:  # from the page: nothing outside its folders
        confinement = Confinement(args.allowed_root, args.read_only_root)
        confine(confinement)
        issues = outside(cfg, Path.cwd(), confinement) + issues
        if args.command in ("train", "cache") and getattr(args, "run_dir", None) and \
                not confinement.allows(args.run_dir, write=True):
            issues.insert(0, Issue("general.run_name", f"the run folder '{args.run_dir}' is outside the folders this "
                                   f"run may write ({confinement.describe(True)}).", "error"))
    errors = [i for i in issues if i.level == "error"]
    if args.command == "cache":
        OmegaConf.update(cfg, "data.only_cache", True)
        if not args.run_dir:
            args.run_dir = str(Path(cfg.general.workspace) / "runs" / time.strftime("cache-%Y%m%d-%H%M%S"))
    # train
    for i in issues:
        print(f"{i.level}: {i.key}: {i.message}", file=sys.stderr)
    if errors:
        return 2
    rank, world = env_rank_world()
    if world > 1 and not args.run_dir and not cfg.general.run_name:
        print("Config error: with several processes give --run-dir or general.run_name, so that every process "
              "writes to the same run folder.", file=sys.stderr)
        return 2
    run_dir = _run_dir(cfg, args.run_dir)
    if int(cfg.general.get("num_processes", 1) or 1) > 1 and not launched():
        problem = check_devices(cfg)
        if problem:
            print(f"Config error: {problem}", file=sys.stderr)
            return 2
        print(_effective_batch(cfg), file=sys.stderr)
    if args.resume and not run_dir.exists() and args.resume == "last":
        print(f"Config error: --resume last needs an existing run folder; {run_dir} does not exist.",
              file=sys.stderr)
        return 2
    trains_here = not (int(cfg.general.get("num_processes", 1) or 1) > 1 and not launched())
    if rank == 0 and trains_here:  # one trainer per run folder, before anything in it is read or written
        try:
            acquire(run_dir)
        except RunFolderBusy as exc:
            print(f"Config error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"Error: cannot create or write the run folder {run_dir} ({exc.strerror or exc}). Pick a "
                  "folder you can write (general.workspace, general.run_name or --run-dir).", file=sys.stderr)
            return 2
        try:
            return _train_locked(args, argv, cfg, issues, run_dir, rank, fresh_process)
        finally:
            release(run_dir)
    return _train_locked(args, argv, cfg, issues, run_dir, rank, fresh_process)


def _validate(args) -> int:
    """``validate``: every problem of the config in one run (unknown keys, types, values, rules, files), one line
    each naming its field once; exit status 1 when any is an error."""
    if not args.config and not args.preset:
        raise SystemExit("error: give a config file or --preset NAME (see 'python -m trainer presets').")
    try:
        cfg, issues = check_config(args.config, args.overrides, preset=args.preset)
    except ConfigError as exc:  # the file cannot be read at all
        issues, cfg = [Issue(e.key or "", str(e), "error") for e in every_error(exc)], None
    if cfg is not None and args.allowed_root:  # from the page: nothing outside its folders
        confinement = Confinement(args.allowed_root, args.read_only_root)
        confine(confinement)
        issues = outside(cfg, Path.cwd(), confinement) + issues
    errors = [i for i in issues if i.level == "error"]
    if cfg is not None and not errors and class_check_needed(cfg):
        from trainer.optim.schedule import check_classes  # torch: only for a config naming classes or their args
        try:
            check_classes(cfg)
        except ConfigError as exc:
            issues.append(Issue(exc.key or "", str(exc), "error"))
            errors = [i for i in issues if i.level == "error"]
    if args.json:
        print(json.dumps({"errors": [i.__dict__ for i in errors],
                          "warnings": [i.__dict__ for i in issues if i.level != "error"]}))
        return 1 if errors else 0
    for i in sorted(issues, key=lambda i: i.level != "error"):  # the errors first
        print(issue_line(i))
    if cfg is not None:
        print(_effective_batch(cfg))
    print("config is valid" if not errors else "config has errors")
    return 1 if errors else 0


def _restartable(run_dir: Path) -> bool:
    """A run folder with no complete backup whose run did not finish (so it wrote no result): restarting
    it in place loses nothing. Torch-free."""
    backups = run_dir / "backups"
    if backups.is_dir() and any(p.is_dir() and not p.name.startswith(".") and (p / "state.json").is_file()
                                for p in backups.iterdir()):
        return False
    # "running" with no trainer holding the folder (this process has its lock): one that died (kill -9)
    return run_state(read_events(run_dir / "events.jsonl")) in ("stopped", "failed", "running", "new")


def _train_locked(args, argv, cfg, issues, run_dir: Path, rank: int, fresh_process: bool) -> int:
    """The rest of ``train``/``cache`` once this process holds the run folder (rank 0)."""
    if rank == 0 and not args.resume and (run_dir / "events.jsonl").exists():
        if _restartable(run_dir):  # stopped or failed before its first backup: nothing to resume, nothing to lose
            print(f"note: {run_dir} holds a run that ended before its first backup; it starts again in place.",
                  file=sys.stderr)
        else:
            print(f"Config error: the run folder {run_dir} already holds a run. Continue it with --resume last, "
                  "or pick another general.run_name.", file=sys.stderr)
            return 2
    problem = None if launched() else _one_gpu(cfg, apply=fresh_process)
    if problem:
        print(f"Config error: {problem}", file=sys.stderr)
        return 2
    try:  # needs the optimizer's library (torch): checked here, before any model loads
        start_train_imports(cfg, fresh_process)
    except ConfigError as exc:
        print(f"Config error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    if int(cfg.general.get("num_processes", 1) or 1) > 1 and not launched() and args.command == "train":
        return _launch(cfg, argv, run_dir)
    from trainer.train.loop import run_training  # torch: after start-up chose what to import
    return run_training(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                        warnings=[f"{i.key}: {i.message}" for i in issues])


if __name__ == "__main__":
    sys.exit(main(fresh_process=True))
