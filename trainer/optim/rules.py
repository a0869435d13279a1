"""The rules of the optimizer and schedule settings (torch-free: ``validate`` and the UI's Check call them through
``trainer.config.checks``), and how each component's learning rate is resolved."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from typing import Dict

from trainer.config.fields import part_of
from trainer.config.schema_training import OptimizerConfig
from trainer.errors import ConfigError, Issue
from trainer.optim.registry import (
    DECAYING_SCHEDULERS,
    FUSED_OPTIMIZERS,
    OPTIMIZERS,
    WARMUP_SCHEDULERS,
    OptimizerSpec,
    optimizer_spec,
)

_CLASS_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*[:.][A-Za-z_]\w*$")

#: The only modules a custom LR scheduler (training.lr_scheduler_class) may come from: a config names a class,
#: never code of its own, so a config from anyone (the page's share link) cannot import and call what it likes.
SCHEDULER_LIBRARIES = ("torch.optim.lr_scheduler", "diffusers.optimization", "transformers.optimization",
                       "pytorch_optimizer")
_NUM = r"\s*(\d+(\.\d*)?|\.\d+)\s*"
_STEP_RULES = re.compile(rf"^({_NUM}:\s*\d+\s*,)*{_NUM}$")  # "1:100,0.5:200,0.1"


# ----------------------------------------------------------------------------------------------
# config rules (called from trainer.config.checks.validate / cross_field_warnings; torch-free)
# ----------------------------------------------------------------------------------------------

def resolved_learning_rates(cfg) -> dict:
    """LR of each component (optimizer param-group name); a blank component LR is the base LR."""
    t = cfg.training
    out = {}
    for comp in ("unet", "text_encoder", "text_encoder_2", "text_encoder_3", "embedding"):
        value = t.embedding_learning_rate if comp == "embedding" else part_of(cfg, comp).learning_rate
        out[comp] = value if value is not None else t.learning_rate
    return out


def _component_lrs(cfg) -> Dict[str, float]:
    """The LRs this config trains with, keyed by the field that sets each one.

    UNet and text encoder count when trained; text_encoder_2 and embedding LRs count when set (whether
    those components exist depends on the model and method); the base LR counts when a trained
    component falls back to it.
    """
    t = cfg.training
    parts = cfg.parts
    out: Dict[str, float] = {}
    uses_base = False
    for key, part, trained in (("parts.denoiser.learning_rate", parts.denoiser, parts.denoiser.train),
                               ("parts.text_encoder_1.learning_rate", parts.text_encoder_1, parts.text_encoder_1.train),
                               ("parts.text_encoder_2.learning_rate", parts.text_encoder_2, None),
                               ("parts.text_encoder_3.learning_rate", parts.text_encoder_3, None),
                               ("training.embedding_learning_rate", None, None)):
        value = part.learning_rate if part is not None else t.embedding_learning_rate
        if value is not None and trained is not False:
            out[key] = float(value)
        elif value is None and trained:
            uses_base = True
    if uses_base or not out:
        out = {"training.learning_rate": float(t.learning_rate), **out}
    return out


def validate_optim(cfg) -> None:
    """Hard rules on the optimizer and scheduler settings; raises ConfigError naming the field."""
    t = cfg.training
    o = t.optimizer
    spec = optimizer_spec(o.name)
    if spec.needs_momentum and not (o.momentum or 0) > 0:
        raise ConfigError(f"training.optimizer.name = {o.name} needs momentum > 0 (bitsandbytes has no "
                          f"momentum-free version): set training.optimizer.momentum (e.g. 0.9), or use "
                          f"{spec.fallback}.", key="training.optimizer.momentum", value=o.momentum)
    if o.name == "adafactor" and o.warmup_init and not o.relative_step:
        raise ConfigError("training.optimizer.warmup_init needs training.optimizer.relative_step = true "
                          "(Adafactor warms up its own relative step). Turn one on or the other off.",
                          key="training.optimizer.warmup_init", value=True)
    bad = [k for k in (o.extra_args or {}) if k in ("params", "lr")]
    if bad:
        raise ConfigError(f"training.optimizer.extra_args.{bad[0]} is set by Atelier itself (parameters and "
                          "learning rates come from training.*learning_rate); remove it.",
                          key=f"training.optimizer.extra_args.{bad[0]}")
    if t.lr_warmup_steps > 0 and t.lr_warmup_fraction > 0:
        raise ConfigError(f"Warm-up is given twice: training.lr_warmup_steps = {t.lr_warmup_steps} and "
                          f"training.lr_warmup_fraction = {t.lr_warmup_fraction}. Set one of them to 0.",
                          key="training.lr_warmup_fraction", value=t.lr_warmup_fraction)
    if t.lr_scheduler == "custom":
        path = (t.lr_scheduler_class or "").strip()
        if not path:
            raise ConfigError("training.lr_scheduler = custom needs training.lr_scheduler_class "
                              "('package.module:Class', e.g. torch.optim.lr_scheduler:OneCycleLR).",
                              key="training.lr_scheduler_class")
        if not _CLASS_PATH.match(path):
            raise ConfigError(f"training.lr_scheduler_class = {path!r} is not an import path; write "
                              "'package.module:Class' (e.g. torch.optim.lr_scheduler:CosineAnnealingLR).",
                              key="training.lr_scheduler_class", value=path)
        problem = scheduler_path_problem(path)
        if problem:
            raise ConfigError(problem, key="training.lr_scheduler_class", value=path)
    if t.lr_scheduler == "piecewise_constant" and not _STEP_RULES.match(t.lr_step_rules or ""):
        raise ConfigError(f"training.lr_step_rules = {t.lr_step_rules!r} must look like "
                          "'1:100,0.5:200,0.1' (multiplier until step, ..., final multiplier).",
                          key="training.lr_step_rules", value=t.lr_step_rules)
    if t.get("fused_backward"):
        check_fused(cfg, spec)
    if t.lr_scheduler == "adafactor" and not (o.name == "adafactor" and o.relative_step):
        raise ConfigError("training.lr_scheduler = adafactor reports Adafactor's own relative-step LR: it needs "
                          "training.optimizer.name = adafactor with relative_step = true. Pick another "
                          "schedule for this optimizer.", key="training.lr_scheduler", value="adafactor")


def class_check_needed(cfg) -> bool:
    """Whether ``validate`` imports the optimizer's library to check the config (see
    :func:`trainer.optim.schedule.check_classes`): a custom scheduler, extra_args, or an optimizer setting away
    from its default (which the constructor may refuse). Other configs stay torch-free; ``train`` always checks."""
    t = cfg.training
    o = t.optimizer
    if t.lr_scheduler == "custom" or o.get("extra_args"):
        return True
    defaults = {fld.name: fld.default for fld in dataclasses.fields(OptimizerConfig)}
    return any(o.get(setting) != defaults.get(setting) for setting in optimizer_spec(o.name).args)


def split_target(path: str) -> tuple:
    """('package.module', 'Name') of 'package.module:Name' or 'package.module.Name'."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    return module, attr


def scheduler_path_problem(path: str) -> str:
    """Why ``training.lr_scheduler_class = path`` may not be imported (not from one of
    :data:`SCHEDULER_LIBRARIES`, or a private name), or "". Decided from the text alone, before any import."""
    module, attr = split_target(path.strip())
    if not any(module == lib or module.startswith(lib + ".") for lib in SCHEDULER_LIBRARIES):
        return (f"training.lr_scheduler_class = {path!r}: a custom scheduler comes from "
                f"{', '.join(SCHEDULER_LIBRARIES)} (e.g. torch.optim.lr_scheduler:OneCycleLR); '{module}' is "
                "not one of them, and a config may not import other code. Pick a scheduler from those "
                "libraries or one of training.lr_scheduler's built-in schedules.")
    if attr.startswith("_"):
        return f"training.lr_scheduler_class = {path!r}: '{attr}' is a private name of '{module}'; name a scheduler."
    return ""


def check_fused(cfg, spec: OptimizerSpec) -> None:
    """training.fused_backward steps each weight inside backward(): refuse what that cannot do."""
    t = cfg.training
    key = "training.fused_backward"
    if not spec.fused_ok:
        raise ConfigError(f"training.fused_backward does not work with training.optimizer.name = "
                          f"{t.optimizer.name}: it needs an optimizer that updates each weight on its own "
                          f"({', '.join(FUSED_OPTIMIZERS)}). Pick one of those or turn fused_backward off.",
                          key=key, value=True)
    if t.gradient_accumulation_steps > 1:
        raise ConfigError(f"training.fused_backward steps each weight as soon as its gradient exists, so it cannot "
                          f"sum gradients over training.gradient_accumulation_steps = "
                          f"{t.gradient_accumulation_steps}. Set accumulation to 1 (raise batch_size instead) or "
                          "turn fused_backward off.", key=key, value=True)
    if t.max_grad_norm > 0:
        raise ConfigError(f"training.fused_backward cannot clip gradients (training.max_grad_norm = "
                          f"{t.max_grad_norm:g}): clipping needs all gradients at once, and fused backward frees "
                          "each one right after its update. Set max_grad_norm = 0 or turn fused_backward off.",
                          key="training.max_grad_norm", value=t.max_grad_norm)
    if t.mixed_precision == "fp16":
        raise ConfigError("training.fused_backward does not work with training.mixed_precision = fp16: the "
                          "loss scaler would have to unscale each gradient before its update. Use bf16 or no "
                          "mixed precision, or turn fused_backward off.", key=key, value=True)
    precision = cfg.get("precision")
    if precision is not None and precision.get("stochastic_rounding"):
        raise ConfigError("training.fused_backward cannot be combined with precision.stochastic_rounding (its "
                          "hooks wrap one optimizer step). Turn one of them off.", key=key, value=True)
    if t.lr_scheduler == "adafactor":
        raise ConfigError("training.fused_backward cannot report Adafactor's own LR (lr_scheduler = adafactor "
                          "reads one optimizer's state). Use lr_scheduler = constant: Adafactor with "
                          "relative_step still computes its own step size.", key="training.lr_scheduler",
                          value="adafactor")


def _num_processes(cfg) -> int:
    g = cfg.get("general")
    n = g.get("num_processes", 1) if g is not None else 1
    try:
        return max(1, int(n or 1))
    except (TypeError, ValueError):
        return 1


def lr_scale_factor(cfg) -> float:
    """training.scale_lr: the factor every component's LR is multiplied by (effective batch = batch_size x
    gradient_accumulation_steps x general.num_processes, when that field exists)."""
    t = cfg.training
    mode = t.get("scale_lr") or "none"
    if mode == "none":
        return 1.0
    batch = int(t.batch_size) * int(t.gradient_accumulation_steps) * _num_processes(cfg)
    return float(batch) if mode == "linear" else math.sqrt(batch)


def optim_warnings(cfg) -> list:
    """Community rules on optimizers and schedules: warnings (trainer.errors.Issue) shown before launch."""
    out = []
    t = cfg.training
    o = t.optimizer
    spec = OPTIMIZERS.get(o.name)
    if spec is None:
        return out
    warmup = t.lr_warmup_steps > 0 or t.lr_warmup_fraction > 0
    warmup_key = "training.lr_warmup_fraction" if t.lr_warmup_fraction > 0 else "training.lr_warmup_steps"
    if spec.adaptive_lr:
        lrs = _component_lrs(cfg)
        off = {k: v for k, v in lrs.items() if v != 1.0}
        if off:
            listed = ", ".join(f"{k} = {v:g}" for k, v in off.items())
            knob = "training.optimizer.d_coef" if "d_coef" in spec.args else "training.optimizer.growth_rate / d0"
            out.append(Issue(next(iter(off)),
                             f"{o.name} estimates its own step size and wants LR 1 on every trained component, "
                             f"but {listed}. Set them to 1 (blank component LRs use training.learning_rate); "
                             f"to make it stronger or weaker change {knob} instead."))
        if o.name == "prodigy" and warmup and not o.safeguard_warmup:
            out.append(Issue("training.optimizer.safeguard_warmup",
                             "Prodigy with an LR warm-up over-estimates its step size early: turn on "
                             "training.optimizer.safeguard_warmup."))
    if spec.schedule_free and t.lr_scheduler not in ("constant", "constant_with_warmup"):
        out.append(Issue("training.lr_scheduler",
                         f"{o.name} is schedule-free: it averages the weights itself and a decaying schedule "
                         f"({t.lr_scheduler}) fights it. Use constant or constant_with_warmup."))
    if o.name == "adafactor" and o.relative_step:
        if t.lr_scheduler != "adafactor":
            out.append(Issue("training.lr_scheduler",
                             "Adafactor with relative_step computes its own LR; training.learning_rate and the "
                             f"{t.lr_scheduler} schedule have no effect. Use lr_scheduler = adafactor (to log "
                             "the real LR), or turn relative_step and scale_parameter off for a fixed LR."))
    if spec.eight_bit and importlib.util.find_spec("bitsandbytes") is None:
        out.append(Issue("training.optimizer.name",
                         f"{o.name} needs bitsandbytes, which is not installed: install it, or pick "
                         f"{spec.fallback} (32-bit state) or adafactor/came for low memory.", level="error"))
    elif not spec.eight_bit and importlib.util.find_spec(spec.root) is None:
        out.append(Issue("training.optimizer.name",
                         f"{o.name} needs the Python package '{spec.library}', which is not installed: "
                         f"pip install {spec.library}, or pick another optimizer.", level="error"))
    if t.lr_scheduler == "rex" and warmup:
        out.append(Issue(warmup_key, "REX has its own shape and takes no warm-up: the warm-up is ignored. "
                                     f"Set {warmup_key} = 0, or use cosine/linear for a warm-up."))
    if t.lr_scheduler in ("constant", "piecewise_constant") and warmup:
        out.append(Issue(warmup_key, f"lr_scheduler = {t.lr_scheduler} ignores the warm-up; use "
                                     "constant_with_warmup (or a decaying schedule) to warm up."))
    for name, part in cfg.parts.items():
        on = bool(part.train) and t.method != "embedding"
        for unit in ("steps", "epochs"):
            if (part.get(f"stop_after_{unit}") or 0) > 0 and not on:
                out.append(Issue(f"parts.{name}.stop_after_{unit}",
                                 f"parts.{name}.stop_after_{unit} is set, but the {name} is not trained in "
                                 "this run: it is ignored."))
    if (t.get("scale_lr") or "none") != "none" and spec.adaptive_lr:
        out.append(Issue("training.scale_lr", f"{o.name} estimates its own step size and wants LR 1: "
                                              f"training.scale_lr = {t.scale_lr} moves it away from 1. Set "
                                              "scale_lr = none."))
    if t.lr_min_factor > 0 and t.lr_scheduler not in DECAYING_SCHEDULERS:
        out.append(Issue("training.lr_min_factor", f"lr_min_factor only applies to decaying schedules "
                                                   f"({', '.join(DECAYING_SCHEDULERS)}); {t.lr_scheduler} "
                                                   "ignores it."))
    if t.lr_scheduler in WARMUP_SCHEDULERS:
        if t.lr_warmup_fraction >= 1 or (t.max_steps and t.lr_warmup_steps >= t.max_steps):
            out.append(Issue(warmup_key, "The warm-up is as long as the whole run: the LR never reaches its "
                                         "full value. Shorten it."))
    if t.lr_scheduler != "custom" and (t.lr_scheduler_class or t.lr_scheduler_args):
        out.append(Issue("training.lr_scheduler_class", "lr_scheduler_class / lr_scheduler_args are only used "
                                                        "with lr_scheduler = custom; they are ignored."))
    return out
