"""Run diffusers' ``examples/text_to_image/train_text_to_image_lora.py`` as the equivalent of an Atelier run.

The bench (``bench_train.py --diffusers-script PATH``) calls, in order:

1. :func:`check_script` and :func:`check_interpreter` — fail before anything runs, naming the path and
   what is missing (the script needs torchvision and datasets, which Atelier does not);
2. :func:`prepare_inputs` — the same base model as a diffusers folder (built-in tiny models are built
   by Atelier; single files are converted once with Atelier's own loader) and the same images and
   captions laid out as a ``datasets`` "imagefolder" (symlinks + ``metadata.jsonl`` with a ``text``
   column, which is what the script reads with ``--train_data_dir``);
3. :func:`script_args` — the same settings (resolution, batch, steps, LoRA rank, LR and schedule,
   seed, precision, AdamW settings, grad clipping …), plus the list of what cannot be made equal;
4. :func:`measure_diffusers` — run it as a child and read the figures from its progress bar.

The script is never modified. Step times come from its tqdm bar ("Steps: …| n/N"), read with
timestamps; ``TQDM_MININTERVAL=0``/``TQDM_MINITERS=1`` in the child's environment (tqdm ≥ 4.66 reads
them) make it redraw after every step, and the rate uses the step numbers, so a skipped redraw does
not bias it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from childproc import loop_rate, run_child, steady_rate

REQUIRED_MODULES = ("torch", "torchvision", "datasets", "diffusers", "transformers", "accelerate", "peft")
SCRIPT_RELPATH = "examples/text_to_image/train_text_to_image_lora.py"
# diffusers.optimization.get_scheduler names that mean the same as Atelier's
SAME_SCHEDULERS = {"constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"}
_BAR = re.compile(r"Steps:.*?\|\s*(\d+)/(\d+)\s*\[")


class BenchError(SystemExit):
    """A problem the user must fix; printed without a traceback."""

    def __init__(self, message: str):
        super().__init__(f"bench: {message}")


# --------------------------------------------------------------------------------------------------
# 1. checks
# --------------------------------------------------------------------------------------------------

def check_script(path: str | os.PathLike) -> Tuple[Path, Dict[str, Any]]:
    """The script's path (a diffusers checkout folder is accepted too) and what it says of itself."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / SCRIPT_RELPATH).is_file():
        p = p / SCRIPT_RELPATH
    if not p.exists():
        raise BenchError(f"--diffusers-script {path}: no such file. Give the path to diffusers' "
                         f"{SCRIPT_RELPATH} (from a diffusers checkout, ideally the tag matching the "
                         "installed diffusers), or the checkout's top folder.")
    if not p.is_file():
        raise BenchError(f"--diffusers-script {path}: is a folder without {SCRIPT_RELPATH} in it.")
    text = p.read_text(encoding="utf-8", errors="replace")
    if "--train_data_dir" not in text or "--rank" not in text:
        raise BenchError(f"--diffusers-script {p}: this does not look like train_text_to_image_lora.py "
                         "(no --train_data_dir / --rank arguments).")
    if "LoraConfig" not in text:
        raise BenchError(f"--diffusers-script {p}: an old version of the script (LoRA through attention "
                         "processors, before diffusers 0.26), which does not train with current diffusers. "
                         "Use the one from a checkout matching the installed diffusers.")
    m = re.search(r'check_min_version\("([^"]+)"\)', text)
    return p.resolve(), {"path": str(p.resolve()), "min_version": m.group(1) if m else None,
                         "has_interpolation_mode": "--image_interpolation_mode" in text}


_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0], "versions": {}, "errors": {}}
for name in sys.argv[1:]:
    try:
        mod = __import__(name)
        out["versions"][name] = getattr(mod, "__version__", "?")
    except BaseException as exc:
        out["errors"][name] = (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:300]
print(json.dumps(out))
"""


def check_interpreter(python: str, modules: Tuple[str, ...] = REQUIRED_MODULES,
                      script: Optional[Path] = None) -> Dict[str, Any]:
    """Import ``modules`` in ``python``; return their versions or fail naming each missing one."""
    exe = shutil.which(python) if os.sep not in python else python
    if not exe or not Path(exe).exists():
        raise BenchError(f"--diffusers-python {python}: no such interpreter.")
    try:
        proc = subprocess.run([exe, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"--diffusers-python {exe}: could not run it ({exc}).") from None
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BenchError(f"--diffusers-python {exe}: the import check printed nothing usable "
                         f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}") from None
    if info["errors"]:
        what = script.name if script else "train_text_to_image_lora.py"
        lines = "\n".join(f"  {name}: {err}" for name, err in info["errors"].items())
        raise BenchError(
            f"{exe} cannot import {', '.join(info['errors'])}, which {what} needs:\n{lines}\n"
            f"Install them into that environment (e.g. `{exe} -m pip install torchvision datasets`; "
            "torchvision must be the build made for its torch), or pass --diffusers-python with an "
            "interpreter that has them. See docs/performance.md, 'Against diffusers' "
            "train_text_to_image_lora.py'.")
    info["executable"] = exe
    return info


# --------------------------------------------------------------------------------------------------
# 2. inputs
# --------------------------------------------------------------------------------------------------

def prepare_dataset(cfg: Any, dest: Path, base_dir: Path) -> Dict[str, Any]:
    """The run's training images as an imagefolder: ``dest/NNNNN.ext`` (symlinks) + metadata.jsonl.

    Captions are the ones Atelier found for each image (several candidates → a list, from which the
    script picks one at random per step, as Atelier does per epoch). Validation concepts are left out."""
    from trainer.data.concepts import scan_concepts
    items, _ = scan_concepts(cfg.data, warn=lambda m: None, base_dir=base_dir)
    items = [it for it in items if not it.validation]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    rows = []
    for i, it in enumerate(items):
        name = f"{i:05d}{it.path.suffix.lower()}"
        try:
            os.symlink(it.path.resolve(), dest / name)
        except OSError:
            shutil.copy2(it.path, dest / name)
        caps = list(it.captions) or [""]
        rows.append({"file_name": name, "text": caps[0] if len(caps) == 1 else caps})
    with open(dest / "metadata.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {"train_data_dir": str(dest), "images": len(rows)}


def prepare_model(cfg: Any, dest: Path) -> Dict[str, Any]:
    """``--pretrained_model_name_or_path`` for the script: the same weights as a diffusers folder."""
    from trainer.families.sources import classify_source, detect_source_family
    source = classify_source(cfg.model.path, cfg.general.workspace)
    family = cfg.model.family if cfg.model.family != "auto" else detect_source_family(source, cfg.model)
    if family and (family.startswith("sdxl") or family.endswith("-inpaint")):
        raise BenchError(f"model.path {cfg.model.path} is a {family} model; train_text_to_image_lora.py trains "
                         "SD 1.x/2.x text-to-image models only (diffusers' SDXL script, "
                         "train_text_to_image_lora_sdxl.py, is not driven by this bench yet).")
    if source.kind in ("folder", "hub"):
        return {"model": source.location, "kind": source.kind, "family": family}
    # a single .safetensors/.ckpt: convert once with Atelier's own loader (same config choice)
    stamp = dest / ".atelier-bench-source"
    key = f"{Path(source.location).resolve()}|{Path(source.location).stat().st_mtime_ns}|{cfg.model.config_path}"
    if not (stamp.exists() and stamp.read_text() == key):
        from diffusers import StableDiffusionPipeline

        from trainer.families.sources import load_pipeline
        pipe = load_pipeline(StableDiffusionPipeline, source, cfg.model, cfg.general.workspace,
                             family=family or "sd15")
        if dest.exists():
            shutil.rmtree(dest)
        pipe.save_pretrained(dest, safe_serialization=True)
        stamp.write_text(key)
    return {"model": str(dest), "kind": "converted single file", "family": family}


def prepare_inputs(cfg: Any, workdir: Path, base_dir: Path) -> Dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    out = prepare_model(cfg, workdir / "model")
    out.update(prepare_dataset(cfg, workdir / "data", base_dir))
    return out


# --------------------------------------------------------------------------------------------------
# 3. settings
# --------------------------------------------------------------------------------------------------

def script_args(cfg: Any, inputs: Dict[str, Any], steps: int, output_dir: Path, cache_dir: Path,
                script_info: Optional[Dict[str, Any]] = None) -> Tuple[List[str], List[str]]:
    """The script's arguments for the run ``cfg`` describes, and what could not be made the same."""
    from trainer.data.buckets import training_side
    from trainer.optim.rules import resolved_learning_rates
    from trainer.data.buckets import parse_resolution
    t, opt, lora, loss, data = cfg.training, cfg.training.optimizer, cfg.lora, cfg.loss, cfg.data
    notes: List[str] = []
    sizes = parse_resolution(data.resolution)
    side = training_side(cfg)
    if len(sizes) > 1 or sizes[0][0] != sizes[0][1]:
        notes.append(f"data.resolution {data.resolution}: the script trains {side}x{side} squares only")
    elif data.aspect_buckets:
        notes.append("Atelier buckets by aspect ratio; the script resizes the short side and crops squares "
                     "(the same for square images)")
    lr = resolved_learning_rates(cfg)["unet"]
    warmup = t.lr_warmup_steps or int(round(t.lr_warmup_fraction * steps))
    sched = t.lr_scheduler
    if sched == "constant" and warmup:
        sched = "constant_with_warmup"
    if sched not in SAME_SCHEDULERS:
        notes.append(f"training.lr_scheduler {t.lr_scheduler}: not in the script; it runs 'constant'")
        sched = "constant"
    args = [
        "--pretrained_model_name_or_path", str(inputs["model"]),
        "--train_data_dir", str(inputs["train_data_dir"]),
        "--image_column", "image", "--caption_column", "text",
        "--resolution", str(side),
        "--train_batch_size", str(t.batch_size),
        "--max_train_steps", str(steps),
        "--gradient_accumulation_steps", str(t.gradient_accumulation_steps),
        "--learning_rate", repr(float(lr)),
        "--lr_scheduler", sched, "--lr_warmup_steps", str(warmup),
        "--max_grad_norm", repr(float(t.max_grad_norm or 1e9)),
        "--rank", str(lora.rank),
        "--seed", str(cfg.general.seed),
        "--mixed_precision", t.mixed_precision,
        "--dataloader_num_workers", "0",
        "--checkpointing_steps", str(steps + 1),  # Atelier's comparison run writes no backup either
        "--output_dir", str(output_dir),
        "--cache_dir", str(cache_dir),
        "--report_to", "tensorboard",
    ]
    if data.center_crop:
        args.append("--center_crop")
    if data.random_flip:
        args.append("--random_flip")
    if t.gradient_checkpointing:
        args.append("--gradient_checkpointing")
    if t.noise_offset:
        args += ["--noise_offset", repr(float(t.noise_offset))]
    if loss.min_snr_gamma:
        args += ["--snr_gamma", repr(float(loss.min_snr_gamma))]
    if cfg.model.prediction_type != "auto":
        args += ["--prediction_type", cfg.model.prediction_type]
    if opt.name in ("adamw", "adamw8bit"):
        if opt.name == "adamw8bit":
            args.append("--use_8bit_adam")
        for key, flag in (("weight_decay", "--adam_weight_decay"), ("beta1", "--adam_beta1"),
                          ("beta2", "--adam_beta2"), ("eps", "--adam_epsilon")):
            if opt.get(key) is not None:
                args += [flag, repr(float(opt[key]))]
    else:
        notes.append(f"optimizer {opt.name}: the script has AdamW (or 8-bit AdamW) only; it runs AdamW")
    # what the script cannot do the same way
    if t.method != "lora" or lora.type != "lora":
        notes.append(f"training.method={t.method}, lora.type={lora.type}: the script trains a plain LoRA")
    if float(lora.alpha) != float(lora.rank):
        notes.append(f"lora.alpha {lora.alpha} != rank {lora.rank}: the script uses alpha = rank")
    if cfg.parts.denoiser.lora_targets != "attn":
        notes.append(f"parts.denoiser.lora_targets {cfg.parts.denoiser.lora_targets}: the script adapts "
                     "to_q/to_k/to_v/to_out.0 only")
    if cfg.parts.text_encoder_1.train:
        notes.append("parts.text_encoder_1.train: the script trains the UNet only")
    if loss.type != "mse":
        notes.append(f"loss.type {loss.type}: the script uses MSE")
    if cfg.ema.enabled:
        notes.append("ema.enabled: the script keeps no EMA")
    if data.cache_latents or data.cache_text:
        notes.append("Atelier caches VAE latents / text-encoder outputs; the script runs the VAE encoder and the "
                     "text encoder on every batch")
    if any(float(c.repeats) != 1.0 for c in data.concepts if c.enabled):
        notes.append("concept repeats: the script sees each image once per epoch (steps are equal anyway)")
    return args, notes


# --------------------------------------------------------------------------------------------------
# 4. the run
# --------------------------------------------------------------------------------------------------

class BarWatcher:
    """Collects ``(step, time)`` the first time the tqdm bar shows each step, and a few log landmarks."""

    def __init__(self) -> None:
        self.marks: List[Tuple[int, float]] = []
        self.total: Optional[int] = None
        self.started: Optional[float] = None   # "***** Running training *****": set-up done
        self.device: Optional[str] = None

    def __call__(self, text: str, t: float) -> None:
        for m in _BAR.finditer(text):
            n, total = int(m.group(1)), int(m.group(2))
            self.total = total
            if n > 0 and (not self.marks or n > self.marks[-1][0]):
                self.marks.append((n, t))
        if self.started is None and "Running training" in text:
            self.started = t
        if self.device is None:
            m = re.search(r"^\s*Device:\s*(\S+)", text)
            if m:
                self.device = m.group(1)


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({"TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1", "PYTHONUNBUFFERED": "1",
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    env.update(extra or {})
    return env


def measure_diffusers(python: str, script: Path, args: List[str], workdir: Path, run_name: str,
                      hub_offline: bool = True, threads: Optional[int] = None) -> Dict[str, Any]:
    """Run the script once and return the same figures as the Atelier measurement."""
    out_dir = Path(args[args.index("--output_dir") + 1])
    if out_dir.exists():
        shutil.rmtree(out_dir)
    watcher = BarWatcher()
    extra = {"HF_HUB_OFFLINE": "1"} if hub_offline else {}
    if threads:
        extra.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env = child_env(extra)
    res = run_child([python, str(script), *args], cwd=workdir, env=env, watch=watcher,
                    log_path=workdir / f"{run_name}.log")
    if res.returncode != 0 or not watcher.marks:
        why = "exited with code %d" % res.returncode if res.returncode else "showed no training step"
        raise BenchError(f"diffusers' {script.name} {why}; log: {res.log_path}\n" + "\n".join(res.tail[-25:]))
    marks = watcher.marks
    steps = marks[-1][0]
    return {
        "trainer": "diffusers",
        "steps": steps,
        "batch_size": int(args[args.index("--train_batch_size") + 1]),
        "device": watcher.device,
        "time_to_first_step_s": round(marks[0][1] - res.t0, 2),
        "first_step_exact": marks[0][0] == 1,
        "time_to_started_s": round(watcher.started - res.t0, 2) if watcher.started else None,
        "loop_steps_per_s": loop_rate(marks),
        "steady_steps_per_s": steady_rate(marks),
        "process_steps_per_s": round(steps / res.wall_s, 2),
        "wall_s": round(res.wall_s, 2),
        "end_s_after_last_step": None,  # no event stream: see exit_s_after_last_step
        "exit_s_after_last_step": round(res.t0 + res.wall_s - marks[-1][1], 2),  # saving the LoRA, teardown
        "peak_ram_mib": res.max_rss_mib,
        "peak_vram_mib": None,
        "cache": None,
        "caching_images_per_s": None,  # no cache: the VAE encodes every batch inside the loop
        "log": str(res.log_path),
    }
