"""Optimizer and learning-rate scheduler registry: config names → constructors from real libraries.

``OPTIMIZERS`` is the single source of truth: each entry names its constructor by import path (so this
module, and ``trainer.config`` that reads the choices from it, import nothing heavy), the schema fields
of ``training.optimizer`` it takes, and its family. The web UI can show only the settings of the chosen
optimizer with :func:`optimizer_fields`. Nothing here imports ``trainer.config`` at module level:
``config.py`` imports this module to build its choices.

Schedules come from ``diffusers.optimization`` (with our warm-up, minimum-LR floor and REX on top, as
``LambdaLR`` multipliers so per-component LRs keep their ratios), Adafactor's own from ``transformers``,
and any ``package.module:Class`` for the rest.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional

log = logging.getLogger("atelier")


# ----------------------------------------------------------------------------------------------
# the optimizer table
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: where it lives, which schema fields it takes, and what kind it is.

    ``args`` maps a field of ``training.optimizer`` to the constructor's keyword; ``"betas.1"`` is the
    second item of the ``betas`` tuple (unset items keep the constructor's own default).
    """
    target: str
    family: str
    args: Mapping[str, str]
    help: str
    eight_bit: bool = False
    fallback: str = ""             # what to pick instead when bitsandbytes cannot run
    needs_momentum: bool = False   # bitsandbytes SGD8bit/LARS8bit fail with momentum 0
    schedule_free: bool = False    # needs optimizer.train()/eval() around sampling and saving
    adaptive_lr: bool = False      # Prodigy / D-Adaptation: the LR multiplies an estimated step size
    fused_ok: bool = False         # each weight's update depends on that weight only: fused backward works

    @property
    def library(self) -> str:
        return {"torch": "torch", "bitsandbytes": "bitsandbytes", "prodigyopt": "prodigyopt",
                "pytorch_optimizer": "pytorch-optimizer", "transformers": "transformers",
                "prodigyplus": "prodigy-plus-schedule-free"}.get(self.module.split(".")[0], self.module)

    @property
    def module(self) -> str:
        return self.target.rsplit(".", 1)[0]


def _betas(n: int) -> Dict[str, str]:
    return {f"beta{i + 1}": f"betas.{i}" for i in range(n)}


_ADAM = {**_betas(2), "eps": "eps", "weight_decay": "weight_decay"}
_DECOUPLE = {"decouple": "weight_decouple"}  # pytorch_optimizer's name for AdamW-style decay

OPTIMIZERS: Dict[str, OptimizerSpec] = {
    # --- torch ---------------------------------------------------------------------------------
    "adamw": OptimizerSpec("torch.optim.AdamW", "adam", {**_ADAM, "amsgrad": "amsgrad"},
                           "AdamW: the default; LR about 1e-4 for LoRA."),
    "adam": OptimizerSpec("torch.optim.Adam", "adam", {**_ADAM, "amsgrad": "amsgrad"},
                          "Adam with L2 weight decay."),
    "nadam": OptimizerSpec("torch.optim.NAdam", "adam", {**_ADAM},
                           "Adam with Nesterov momentum."),
    "radam": OptimizerSpec("torch.optim.RAdam", "adam", {**_ADAM},
                           "Rectified Adam (built-in warm-up of the second moment)."),
    "sgd": OptimizerSpec("torch.optim.SGD", "sgd",
                         {"momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"},
                         "Plain SGD (with optional momentum); needs a much higher LR than Adam."),
    "adagrad": OptimizerSpec("torch.optim.Adagrad", "adagrad", {"eps": "eps", "weight_decay": "weight_decay"},
                             "Adagrad."),
    "rmsprop": OptimizerSpec("torch.optim.RMSprop", "rmsprop",
                             {"rmsprop_alpha": "alpha", "eps": "eps", "weight_decay": "weight_decay",
                              "momentum": "momentum", "centered": "centered"}, "RMSprop."),
    # --- pytorch-optimizer ---------------------------------------------------------------------
    "lamb": OptimizerSpec("pytorch_optimizer.Lamb", "lamb", {**_ADAM, **_DECOUPLE},
                          "LAMB: Adam with a layer-wise trust ratio."),
    "lars": OptimizerSpec("pytorch_optimizer.LARS", "lars",
                          {"momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay",
                           "lars_trust_coefficient": "trust_coefficient"},
                          "LARS: SGD with a layer-wise trust ratio."),
    "lion": OptimizerSpec("pytorch_optimizer.Lion", "lion",
                          {**_betas(2), "weight_decay": "weight_decay", **_DECOUPLE},
                          "Lion: sign updates; use an LR 3-10x lower than AdamW and more weight decay."),
    "came": OptimizerSpec("pytorch_optimizer.CAME", "came",
                          {**_betas(3), "eps": "eps1", "eps2": "eps2", "weight_decay": "weight_decay",
                           **_DECOUPLE, "clip_threshold": "clip_threshold"},
                          "CAME: Adafactor-like memory with Adam-like stability (often paired with REX)."),
    "adopt": OptimizerSpec("pytorch_optimizer.ADOPT", "adam", {**_ADAM, **_DECOUPLE},
                           "ADOPT: Adam variant that converges with any beta2."),
    "dadapt_adam": OptimizerSpec("pytorch_optimizer.DAdaptAdam", "adaptive",
                                 {**_ADAM, **_DECOUPLE, "d0": "d0", "growth_rate": "growth_rate",
                                  "use_bias_correction": "bias_correction"},
                                 "D-Adaptation Adam: finds its own step size; keep LR = 1.", adaptive_lr=True),
    "dadapt_adagrad": OptimizerSpec("pytorch_optimizer.DAdaptAdaGrad", "adaptive",
                                    {"momentum": "momentum", "eps": "eps", "weight_decay": "weight_decay",
                                     **_DECOUPLE, "d0": "d0", "growth_rate": "growth_rate"},
                                    "D-Adaptation AdaGrad; keep LR = 1.", adaptive_lr=True),
    "dadapt_adan": OptimizerSpec("pytorch_optimizer.DAdaptAdan", "adaptive",
                                 {**_betas(3), "eps": "eps", "weight_decay": "weight_decay", **_DECOUPLE,
                                  "d0": "d0", "growth_rate": "growth_rate"},
                                 "D-Adaptation Adan; keep LR = 1.", adaptive_lr=True),
    "dadapt_lion": OptimizerSpec("pytorch_optimizer.DAdaptLion", "adaptive",
                                 {**_betas(2), "weight_decay": "weight_decay", **_DECOUPLE, "d0": "d0"},
                                 "D-Adaptation Lion; keep LR = 1.", adaptive_lr=True),
    "dadapt_sgd": OptimizerSpec("pytorch_optimizer.DAdaptSGD", "adaptive",
                                {"momentum": "momentum", "weight_decay": "weight_decay", **_DECOUPLE,
                                 "d0": "d0", "growth_rate": "growth_rate"},
                                "D-Adaptation SGD; keep LR = 1.", adaptive_lr=True),
    "schedulefree_adamw": OptimizerSpec("pytorch_optimizer.ScheduleFreeAdamW", "schedule_free",
                                        {**_ADAM}, "Schedule-free AdamW: no decay schedule needed "
                                        "(use constant, with warm-up).", schedule_free=True),
    "schedulefree_sgd": OptimizerSpec("pytorch_optimizer.ScheduleFreeSGD", "schedule_free",
                                      {"momentum": "momentum", "eps": "eps", "weight_decay": "weight_decay"},
                                      "Schedule-free SGD.", schedule_free=True),
    "schedulefree_radam": OptimizerSpec("pytorch_optimizer.ScheduleFreeRAdam", "schedule_free", {**_ADAM},
                                        "Schedule-free RAdam (no warm-up needed).", schedule_free=True),
    # --- prodigy -------------------------------------------------------------------------------
    "prodigy": OptimizerSpec("prodigyopt.Prodigy", "adaptive",
                             {**_ADAM, "beta3": "beta3", "decouple": "decouple",
                              "use_bias_correction": "use_bias_correction", "safeguard_warmup": "safeguard_warmup",
                              "d0": "d0", "d_coef": "d_coef", "growth_rate": "growth_rate", "slice_p": "slice_p"},
                             "Prodigy: finds its own step size; keep LR = 1 on every component, "
                             "scale with d_coef.", adaptive_lr=True),
    "prodigy_plus_schedulefree": OptimizerSpec(
        "prodigyplus.ProdigyPlusScheduleFree", "adaptive",
        {**_ADAM, "beta3": "beta3", "use_bias_correction": "use_bias_correction", "d0": "d0", "d_coef": "d_coef",
         "d_limiter": "d_limiter", "prodigy_steps": "prodigy_steps", "split_groups": "split_groups",
         "factored": "factored", "use_stableadamw": "use_stableadamw"},
        "Prodigy + schedule-free (prodigy-plus-schedule-free): LR = 1, constant schedule.",
        adaptive_lr=True, schedule_free=True),
    # --- transformers --------------------------------------------------------------------------
    "adafactor": OptimizerSpec("transformers.optimization.Adafactor", "adafactor",
                               {"beta1": "beta1", "eps": "eps.0", "eps2": "eps.1", "weight_decay": "weight_decay",
                                "relative_step": "relative_step", "scale_parameter": "scale_parameter",
                                "warmup_init": "warmup_init", "clip_threshold": "clip_threshold",
                                "decay_rate": "decay_rate"},
                               "Adafactor: adaptive mode (relative_step on: own LR, lr_scheduler = adafactor) or "
                               "low-memory AdamW-like mode (relative_step, scale_parameter and warmup_init off, "
                               "an explicit LR, constant schedule)."),
}

_BNB_ADAM = {**_ADAM}
_BNB = "bitsandbytes.optim."
for _name, _cls, _fam, _args, _fallback, _extra in [
    ("adamw8bit", "AdamW8bit", "adam", _BNB_ADAM, "adamw", {}),
    ("adam8bit", "Adam8bit", "adam", _BNB_ADAM, "adam", {}),
    ("lion8bit", "Lion8bit", "lion", {**_betas(2), "weight_decay": "weight_decay"}, "lion", {}),
    ("sgd8bit", "SGD8bit", "sgd", {"momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"},
     "sgd", {"needs_momentum": True}),
    ("rmsprop8bit", "RMSprop8bit", "rmsprop", {"rmsprop_alpha": "alpha", "eps": "eps", "weight_decay": "weight_decay",
                                                "momentum": "momentum", "centered": "centered"}, "rmsprop", {}),
    ("adagrad8bit", "Adagrad8bit", "adagrad", {"eps": "eps", "weight_decay": "weight_decay"}, "adagrad", {}),
    ("lamb8bit", "LAMB8bit", "lamb", {**_BNB_ADAM, "use_bias_correction": "bias_correction"}, "lamb", {}),
    ("lars8bit", "LARS8bit", "lars", {"momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"},
     "lars", {"needs_momentum": True}),
    ("ademamix8bit", "AdEMAMix8bit", "ademamix", {**_betas(3), "ademamix_alpha": "alpha", "eps": "eps",
                                                  "weight_decay": "weight_decay"}, "adamw", {}),
    ("paged_adamw8bit", "PagedAdamW8bit", "adam", _BNB_ADAM, "adamw", {}),
    ("paged_adam8bit", "PagedAdam8bit", "adam", _BNB_ADAM, "adam", {}),
    ("paged_lion8bit", "PagedLion8bit", "lion", {**_betas(2), "weight_decay": "weight_decay"}, "lion", {}),
    ("paged_ademamix8bit", "PagedAdEMAMix8bit", "ademamix", {**_betas(3), "ademamix_alpha": "alpha", "eps": "eps",
                                                             "weight_decay": "weight_decay"}, "adamw", {}),
]:
    paged = " Paged: optimizer state can spill to CPU RAM on CUDA (plain 8-bit elsewhere)." \
        if _name.startswith("paged_") else ""
    OPTIMIZERS[_name] = OptimizerSpec(_BNB + _cls, _fam, _args,
                                      f"{_cls} (bitsandbytes): 8-bit optimizer state, about a quarter of the "
                                      f"memory of {_fallback}.{paged}", eight_bit=True, fallback=_fallback, **_extra)

#: Optimizers whose update of one tensor needs only that tensor's gradient and state, so one optimizer per
#: tensor stepped from its gradient hook (training.fused_backward) is the same optimizer. Prodigy and
#: D-Adaptation share one step-size estimate over all tensors; schedule-free ones swap weights in
#: train()/eval(); bitsandbytes' 8-bit ones manage paged/quantised state per optimizer: not fused.
FUSED_OPTIMIZERS = ("adamw", "adam", "nadam", "radam", "sgd", "adagrad", "rmsprop", "lion", "came", "adafactor")
for _name in FUSED_OPTIMIZERS:
    OPTIMIZERS[_name] = replace(OPTIMIZERS[_name], fused_ok=True)

OPTIMIZER_NAMES: List[str] = list(OPTIMIZERS)

#: Optimizer settings that are not constructor arguments of one optimizer but apply to all.
GENERAL_OPTIMIZER_FIELDS = ("name", "extra_args")


def optimizer_spec(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        from trainer.config import ConfigError
        raise ConfigError(f"training.optimizer.name = {name!r} is not known; one of {', '.join(OPTIMIZER_NAMES)}.",
                          key="training.optimizer.name", value=name) from None


def optimizer_fields(name: str) -> List[str]:
    """The ``training.optimizer.*`` keys that matter for optimizer ``name`` (for the UI to show)."""
    spec = OPTIMIZERS.get(name)
    own = list(spec.args) if spec else []
    name_key, extra_key = GENERAL_OPTIMIZER_FIELDS
    return [f"training.optimizer.{k}" for k in (name_key, *own, extra_key)]


def used_by(setting: str) -> str:
    """A short 'which optimizers take this' phrase for a field's help text, from the table."""
    users = [n for n, s in OPTIMIZERS.items() if setting in s.args]
    if not users:
        return ""
    if len(users) > len(OPTIMIZERS) * 0.6:
        others = [n for n in OPTIMIZERS if n not in users]
        return f"[all optimizers except {', '.join(others)}]" if others else "[all optimizers]"
    return f"[{', '.join(users)}]"


# ----------------------------------------------------------------------------------------------
# the scheduler table
# ----------------------------------------------------------------------------------------------

SCHEDULERS: Dict[str, str] = {
    "constant": "The same LR throughout (warm-up ignored).",
    "constant_with_warmup": "Linear warm-up, then constant.",
    "linear": "Warm-up, then linear decay to lr_min_factor x LR.",
    "cosine": "Warm-up, then half a cosine down to lr_min_factor x LR.",
    "cosine_with_restarts": "Warm-up, then lr_cycles smooth cosine waves (down and back up).",
    "cosine_with_hard_restarts": "Warm-up, then lr_cycles cosine decays, each jumping back to the full LR "
                                 "(kohya's 'cosine_with_restarts').",
    "polynomial": "Warm-up, then (1 - progress)^lr_power decay to lr_min_factor x LR.",
    "piecewise_constant": "Constant pieces: lr_step_rules 'multiplier:step,...,last_multiplier'.",
    "rex": "REX: rational decay (1-p)/(1-p/2) to lr_min_factor x LR; takes no warm-up.",
    "adafactor": "Adafactor's own relative-step LR (needs optimizer adafactor with relative_step).",
    "custom": "Any scheduler class or factory: lr_scheduler_class 'package.module:Class' with "
              "lr_scheduler_args.",
}
SCHEDULER_NAMES: List[str] = list(SCHEDULERS)
#: Schedules that shrink the LR over the run (lr_min_factor applies to them).
DECAYING_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "cosine_with_hard_restarts", "polynomial", "rex")
#: Schedules that accept a warm-up.
WARMUP_SCHEDULERS = ("constant_with_warmup",) + tuple(s for s in DECAYING_SCHEDULERS if s != "rex")

_CLASS_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*[:.][A-Za-z_]\w*$")
_NUM = r"\s*(\d+(\.\d*)?|\.\d+)\s*"
_STEP_RULES = re.compile(rf"^({_NUM}:\s*\d+\s*,)*{_NUM}$")  # "1:100,0.5:200,0.1"


# ----------------------------------------------------------------------------------------------
# config rules (called from trainer.config.validate / cross_field_warnings; torch-free)
# ----------------------------------------------------------------------------------------------

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


def _check_extra_args(name: str, spec: Any, cls: Any, extra: dict, warn: bool = False) -> None:
    from trainer.config import ConfigError
    try:
        sig = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        sig = {}
    named = {n for n, p in sig.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"params", "self"}
    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.values())
    unknown = [k for k in extra if k not in named]
    if unknown and not open_kwargs:
        raise ConfigError(f"training.optimizer.extra_args.{unknown[0]}: {name} ({spec.target}) takes no "
                          f"'{unknown[0]}'. It takes: {', '.join(sorted(named))}.",
                          key=f"training.optimizer.extra_args.{unknown[0]}")
    if unknown and warn:
        log.warning("training.optimizer.extra_args %s are not named parameters of %s; passed through as "
                    "**kwargs (check the spelling)", unknown, spec.target)


def check_optimizer_class(cfg) -> None:
    """The optimizer's package and extra_args, checked by ``train`` before the model loads (this imports
    the optimizer's library, so ``validate``, which stays torch-free, leaves it to train)."""
    o = cfg.training.optimizer
    spec = optimizer_spec(o.name)
    cls = _import(spec.target, "training.optimizer.name", o.name,
                  f" Install the '{spec.library}' package or pick another optimizer.")
    extra = _plain(o.extra_args) or {}
    if extra:
        _check_extra_args(o.name, spec, cls, extra)


def validate_optim(cfg) -> None:
    """Hard rules on the optimizer and scheduler settings; raises ConfigError naming the field."""
    from trainer.config import ConfigError
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
    if t.lr_scheduler == "piecewise_constant" and not _STEP_RULES.match(t.lr_step_rules or ""):
        raise ConfigError(f"training.lr_step_rules = {t.lr_step_rules!r} must look like "
                          "'1:100,0.5:200,0.1' (multiplier until step, ..., final multiplier).",
                          key="training.lr_step_rules", value=t.lr_step_rules)
    if t.get("fused_backward"):
        _check_fused(cfg, spec)
    if t.lr_scheduler == "adafactor" and not (o.name == "adafactor" and o.relative_step):
        raise ConfigError("training.lr_scheduler = adafactor reports Adafactor's own relative-step LR: it needs "
                          "training.optimizer.name = adafactor with relative_step = true. Pick another "
                          "schedule for this optimizer.", key="training.lr_scheduler", value="adafactor")


def _check_fused(cfg, spec: OptimizerSpec) -> None:
    """training.fused_backward steps each weight inside backward(): refuse what that cannot do."""
    from trainer.config import ConfigError
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


#: Components (param-group names): the model's part slots (parts.* in the config) and the embedding.
COMPONENTS = ("unet", "text_encoder", "text_encoder_2", "text_encoder_3", "embedding")


def _window(cfg, component: str) -> tuple:
    """(stop_after_steps, stop_after_epochs) of a component: parts.<part>.* or training.embedding_*."""
    if component == "embedding":
        t = cfg.training
        return int(t.embedding_stop_after_steps or 0), int(t.embedding_stop_after_epochs or 0)
    from trainer.config import part_of
    part = part_of(cfg, component)
    return int(part.stop_after_steps or 0), int(part.stop_after_epochs or 0)


def stop_step(cfg, component: str, steps_per_epoch: int) -> int:
    """The optimizer step after which ``component`` stops training: the smaller of
    parts.<part>.stop_after_steps and ..._epochs x steps_per_epoch; 0 = never."""
    limits = []
    steps, epochs = _window(cfg, component)
    if steps > 0:
        limits.append(steps)
    if epochs > 0:
        limits.append(epochs * max(1, int(steps_per_epoch)))
    return min(limits) if limits else 0


class ComponentSchedule:
    """Per-component training windows (parts.<part>.stop_after_steps/_epochs, training.embedding_stop_after_*).

    After its last step a component is frozen: its weights get ``requires_grad = False`` (no gradients,
    no backward work through it; the optimizer skips weights without a gradient) and its param group gets
    lr = 0 and weight_decay = 0, so no optimizer moves it. LR schedulers write ``lr`` again at every step,
    so :meth:`apply` runs after each ``scheduler.step()`` (and after loading a backup: a resumed run
    freezes what the uninterrupted run had frozen at that step).
    """

    def __init__(self, optimizer, cfg, steps_per_epoch: int):
        self.optimizer = optimizer
        self.stops = {name: stop_step(cfg, name, steps_per_epoch) for name in COMPONENTS}
        self.frozen: set = set()

    def __bool__(self) -> bool:
        return any(self.stops.values())

    def apply(self, step: int) -> List[str]:
        """Freeze every component whose window ended at or before ``step``; returns the newly frozen names."""
        new = []
        for group in self.optimizer.param_groups:
            name = group.get("name")
            stop = self.stops.get(name, 0)
            if not stop or step < stop:
                continue
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            if name not in self.frozen:
                self.frozen.add(name)
                new.append(name)
                for p in group["params"]:
                    p.requires_grad_(False)
                    p.grad = None
        return new


def optim_warnings(cfg) -> list:
    """Community rules on optimizers and schedules: warnings (trainer.config.Issue) shown before launch."""
    from trainer.config import Issue
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
    elif not spec.eight_bit and importlib.util.find_spec(spec.module.split(".")[0]) is None:
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


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------

def param_groups(method, cfg) -> List[Dict[str, Any]]:
    """One group per trained component, each with its own learning rate (blank → base LR).

    Group names are the method's module names ("unet", "text_encoder", "text_encoder_2", "embedding");
    a name without its own LR field uses ``training.learning_rate``.
    """
    from trainer.config import ConfigError, resolved_learning_rates
    lrs = resolved_learning_rates(cfg)
    scale = lr_scale_factor(cfg)  # training.scale_lr
    groups = []
    for name, module in method.modules.items():
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": lrs.get(name, cfg.training.learning_rate) * scale,
                           "name": name})
    if not groups:
        raise ConfigError("Nothing to train: no trainable parameters (check parts.denoiser.train / "
                          "parts.text_encoder_1.train).", key="parts.denoiser.train")
    return groups


def _import(path: str, key: str, what: str, hint: str = "") -> Any:
    """Import 'package.module.Name' or 'package.module:Name'."""
    from trainer.config import ConfigError
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key} = {what!r}: cannot import '{module_name}' ({exc}).{hint}", key=key,
                          value=what) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key} = {what!r}: '{module_name}' has no '{attr}'.{hint}", key=key, value=what) from None


_BNB_PROBLEM: Dict[str, Optional[str]] = {}


def bitsandbytes_problem(device: Any = "cpu") -> Optional[str]:
    """Why bitsandbytes' 8-bit optimizers cannot run on ``device`` here, or None when they can.

    Imports bitsandbytes and takes one 8-bit step on a small tensor (once per device type): an import that
    works is not enough, a build without a kernel for the device fails at the first step.
    """
    kind = getattr(device, "type", str(device)).split(":")[0]
    if kind in _BNB_PROBLEM:
        return _BNB_PROBLEM[kind]
    problem = None
    try:
        import torch
        import bitsandbytes.optim as bnb_optim
        p = torch.nn.Parameter(torch.zeros(4096, device=device))
        p.grad = torch.ones_like(p)
        bnb_optim.AdamW8bit([p], lr=1e-3).step()
        if not torch.isfinite(p).all():
            problem = "a test step gave non-finite values"
    except Exception as exc:  # ImportError, missing native library, unsupported device, ...
        problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    _BNB_PROBLEM[kind] = problem
    return problem


def _plain(value: Any) -> Any:
    """OmegaConf containers → plain Python (lists → tuples, which optimizers expect for betas)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def optimizer_kwargs(spec: OptimizerSpec, cls: Any, o) -> Dict[str, Any]:
    """Constructor keywords from the schema fields this optimizer takes (blank fields keep its default)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs: Dict[str, Any] = {}
    tuples: Dict[str, Dict[int, Any]] = {}
    for setting, kw in spec.args.items():
        value = o.get(setting)
        if value is None:
            continue
        if "." in kw:
            name, idx = kw.split(".")
            tuples.setdefault(name, {})[int(idx)] = value
        else:
            kwargs[kw] = value
    for name, items in tuples.items():
        default = params[name].default if name in params else inspect.Parameter.empty
        if default is inspect.Parameter.empty or not isinstance(default, (tuple, list)):
            default = (None,) * (max(items) + 1)
        value = list(default)
        for i, v in items.items():
            if i < len(value):
                value[i] = v
        kwargs[name] = tuple(value)
    return kwargs


def build_optimizer(groups: List[Dict[str, Any]], cfg):
    """The optimizer named by ``training.optimizer.name``, with its settings, over ``groups``."""
    from trainer.config import ConfigError
    t = cfg.training
    o = t.optimizer
    spec = optimizer_spec(o.name)
    key = "training.optimizer.name"
    if spec.eight_bit:
        device = groups[0]["params"][0].device if groups and groups[0]["params"] else "cpu"
        problem = bitsandbytes_problem(device)
        if problem:
            raise ConfigError(f"{key} = {o.name} needs bitsandbytes, which cannot run on this machine "
                              f"({device}): {problem}. Pick {spec.fallback} instead (the same optimizer with "
                              "32-bit state, more memory), or adafactor / came for low memory without "
                              "bitsandbytes.", key=key, value=o.name)
    cls = _import(spec.target, key, o.name, f" Install the '{spec.library}' package or pick another optimizer.")
    kwargs = optimizer_kwargs(spec, cls, o)
    extra = _plain(o.extra_args) or {}
    if extra:
        _check_extra_args(o.name, spec, cls, extra, warn=True)
        kwargs.update(extra)
    if o.name == "adafactor" and kwargs.get("relative_step", True):
        kwargs["lr"] = None  # transformers refuses a manual LR with relative_step
    else:
        kwargs["lr"] = t.learning_rate
    try:
        if t.get("fused_backward"):
            _check_fused(cfg, spec)
            optimizer = fused_backward_optimizer(groups, cls, kwargs)
        else:
            optimizer = cls(groups, **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        shown = {k: v for k, v in kwargs.items() if k != "lr"}
        raise ConfigError(f"{key} = {o.name}: {spec.target} rejected its settings {shown}: {exc}",
                          key=key, value=o.name) from None
    on_train(optimizer)
    return optimizer


_FUSED_CLASS: Any = None


def fused_backward_optimizer(groups: List[Dict[str, Any]], cls: Any, kwargs: Dict[str, Any]):
    """training.fused_backward: one ``cls`` optimizer per weight, stepped from the weight's
    ``register_post_accumulate_grad_hook`` during backward, its gradient freed right after (kohya's fused
    backward pass, generalised from Adafactor to any per-weight optimizer).

    The returned object is a ``torch.optim.Optimizer`` over the same param groups, so LR schedulers drive
    it as usual: each hook copies its group's current settings (lr, weight_decay, betas, ...) into the
    weight's own optimizer before stepping. Its ``step()`` does nothing (the weights were updated during
    backward); ``state_dict()`` holds every per-weight optimizer's state for backups.
    """
    global _FUSED_CLASS
    if _FUSED_CLASS is None:
        import torch

        class FusedBackwardOptimizer(torch.optim.Optimizer):
            fused_backward = True

            def __init__(self, groups, cls, kwargs):
                self.per_param: List[Any] = []  # (group index, weight, its optimizer)
                for gi, g in enumerate(groups):
                    options = {k: v for k, v in g.items() if k != "params"}
                    for p in g["params"]:
                        self.per_param.append((gi, p, cls([{"params": [p], **options}], **kwargs)))
                defaults = dict(self.per_param[0][2].defaults) if self.per_param else {}
                super().__init__(groups, defaults)
                self.optimizer_class = cls
                #: several processes: averages one weight's gradient over them before its update
                #: (set by the trainer; every process runs the same hooks in the same order)
                self.grad_reduce: Optional[Callable[[Any], None]] = None
                self._handles = [p.register_post_accumulate_grad_hook(self._hook(gi, opt))
                                 for gi, p, opt in self.per_param]

            def _hook(self, gi: int, opt):
                def step_now(p) -> None:
                    if p.grad is None:
                        return
                    if self.grad_reduce is not None:
                        self.grad_reduce(p)
                    inner = opt.param_groups[0]
                    for k, v in self.param_groups[gi].items():  # the scheduler's current values
                        if k != "params" and k in inner:
                            inner[k] = v
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                return step_now

            @torch.no_grad()
            def step(self, closure=None):
                """Nothing to do: every weight was updated while its gradient was made."""
                if closure is not None:
                    with torch.enable_grad():
                        return closure()
                return None

            def state_dict(self) -> Dict[str, Any]:
                return {"fused_backward": True,
                        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                        "per_param": [opt.state_dict() for _, _, opt in self.per_param]}

            def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
                if not state_dict.get("fused_backward"):
                    raise ValueError("the saved optimizer state is from a run without training.fused_backward")
                if len(state_dict["per_param"]) != len(self.per_param) or \
                        len(state_dict["param_groups"]) != len(self.param_groups):
                    raise ValueError(f"the saved state has {len(state_dict['per_param'])} weights in "
                                     f"{len(state_dict['param_groups'])} groups, this optimizer "
                                     f"{len(self.per_param)} in {len(self.param_groups)}")
                for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                    group.update(saved)
                for (_, _, opt), saved in zip(self.per_param, state_dict["per_param"]):
                    opt.load_state_dict(saved)

            def remove_hooks(self) -> None:
                for h in self._handles:
                    h.remove()
                self._handles = []

        _FUSED_CLASS = FusedBackwardOptimizer
    return _FUSED_CLASS(groups, cls, kwargs)


def is_schedule_free(optimizer) -> bool:
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def on_train(optimizer) -> None:
    """Before training steps: schedule-free optimizers switch the weights back to their training point."""
    if optimizer is not None and is_schedule_free(optimizer):
        optimizer.train()


def on_eval(optimizer) -> None:
    """Before sampling or saving: schedule-free optimizers switch the weights to their average (the result)."""
    if optimizer is not None and is_schedule_free(optimizer):
        optimizer.eval()


# --- schedules ---------------------------------------------------------------------------------

def warmup_steps(cfg, total_steps: int) -> int:
    """Warm-up length in optimizer steps: lr_warmup_fraction of the run when set, else lr_warmup_steps."""
    t = cfg.training
    if t.lr_warmup_fraction > 0:
        return min(total_steps, int(round(t.lr_warmup_fraction * total_steps)))
    return min(total_steps, int(t.lr_warmup_steps))


def rex_factor(step: int, total_steps: int) -> float:
    """REX (Chen et al. 2021): (1 - p) / (1 - p/2) with p = step / total, 1 at the start, 0 at the end.

    The same curve as ``pytorch_optimizer.REXScheduler.get_linear_lr`` with max_lr=1, min_lr=0; used as a
    LambdaLR multiplier because REXScheduler sets one LR for every group (losing per-component LRs) and
    starts at min_lr.
    """
    p = min(max(step, 0) / max(total_steps, 1), 1.0)
    return (1.0 - p) / (1.0 - p / 2.0)


def _with_floor(fn: Callable[[int], float], warmup: int, min_factor: float) -> Callable[[int], float]:
    """Lift a decay multiplier so it never goes below ``min_factor`` after the warm-up."""
    def lr_lambda(step: int) -> float:
        value = fn(step)
        return value if step < warmup else min_factor + (1.0 - min_factor) * value
    return lr_lambda


def build_scheduler(optimizer, cfg, total_steps: int):
    """The LR schedule of ``training.lr_scheduler``, stepped once per optimizer step."""
    from diffusers import optimization as dopt
    from torch.optim.lr_scheduler import LambdaLR

    from trainer.config import ConfigError
    t = cfg.training
    name = t.lr_scheduler
    total = max(int(total_steps), 1)
    warmup = warmup_steps(cfg, total)
    if name == "constant":
        return dopt.get_constant_schedule(optimizer)
    if name == "constant_with_warmup":
        return dopt.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if name == "piecewise_constant":
        rules = re.sub(r"\s+", "", t.lr_step_rules or "")
        try:
            return dopt.get_piecewise_constant_schedule(optimizer, step_rules=rules)
        except (ValueError, IndexError) as exc:
            raise ConfigError(f"training.lr_step_rules = {t.lr_step_rules!r}: {exc}", key="training.lr_step_rules")
    if name == "adafactor":
        from transformers.optimization import AdafactorSchedule
        return AdafactorSchedule(optimizer, initial_lr=t.learning_rate)
    if name == "custom":
        return _custom_scheduler(optimizer, cfg, total, warmup)

    if name == "linear":
        sched = dopt.get_linear_schedule_with_warmup(optimizer, warmup, total)
    elif name == "cosine":
        sched = dopt.get_cosine_schedule_with_warmup(optimizer, warmup, total)
    elif name == "cosine_with_restarts":
        sched = dopt.get_cosine_schedule_with_warmup(optimizer, warmup, total, num_cycles=float(t.lr_cycles))
    elif name == "cosine_with_hard_restarts":
        sched = dopt.get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, warmup, total,
                                                                       num_cycles=int(t.lr_cycles))
    elif name == "polynomial":
        # diffusers' polynomial ends at an absolute lr_end over optimizer.defaults["lr"]; a multiplier that
        # ends at 0 and the floor below give lr_min_factor x each group's own LR instead.
        def poly(step: int, w=warmup, n=total, power=float(t.lr_power)) -> float:
            if step < w:
                return step / max(1, w)
            return (1.0 - min(step - w, n - w) / max(1, n - w)) ** power
        sched = LambdaLR(optimizer, poly)
    elif name == "rex":
        sched = LambdaLR(optimizer, lambda step, n=total: rex_factor(step, n))
        warmup = 0  # REX takes no warm-up (cross_field_warnings says so)
    else:
        raise ConfigError(f"training.lr_scheduler = {name!r} is not known; one of {', '.join(SCHEDULER_NAMES)}.",
                          key="training.lr_scheduler", value=name)
    if t.lr_min_factor > 0:
        sched.lr_lambdas = [_with_floor(fn, warmup, float(t.lr_min_factor)) for fn in sched.lr_lambdas]
        # the first LR was set by the unfloored multiplier; set it again
        for group, base, fn in zip(optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in optimizer.param_groups]
    return sched


_AUTO_ARGS = {"num_training_steps": "total", "total_steps": "total", "total_iters": "total",
              "num_warmup_steps": "warmup", "warmup_steps": "warmup"}


def _custom_scheduler(optimizer, cfg, total: int, warmup: int):
    """``package.module:Class(optimizer, **lr_scheduler_args)``; the run's length and warm-up are passed
    as num_training_steps/total_steps/total_iters and num_warmup_steps/warmup_steps when it takes them
    and lr_scheduler_args does not set them."""
    from trainer.config import ConfigError
    t = cfg.training
    path = t.lr_scheduler_class.strip()
    key = "training.lr_scheduler_class"
    target = _import(path, key, path)
    kwargs = _plain(t.lr_scheduler_args) or {}
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    for arg, what in _AUTO_ARGS.items():
        if arg in params and arg not in kwargs:
            kwargs[arg] = total if what == "total" else warmup
    try:
        sched = target(optimizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} = {path!r} with training.lr_scheduler_args = {kwargs}: {exc}",
                          key="training.lr_scheduler_args") from None
    if not (callable(getattr(sched, "step", None)) and callable(getattr(sched, "state_dict", None))):
        raise ConfigError(f"{key} = {path!r} did not make an LR scheduler (no step()/state_dict()): got "
                          f"{type(sched).__name__}.", key=key, value=path)
    return sched


__all__ = ["OPTIMIZERS", "OPTIMIZER_NAMES", "SCHEDULERS", "SCHEDULER_NAMES", "OptimizerSpec", "optimizer_spec",
           "optimizer_fields", "used_by", "validate_optim", "optim_warnings", "param_groups", "build_optimizer",
           "build_scheduler", "bitsandbytes_problem", "on_train", "on_eval", "warmup_steps", "rex_factor",
           "DECAYING_SCHEDULERS", "WARMUP_SCHEDULERS", "FUSED_OPTIMIZERS", "fused_backward_optimizer",
           "ComponentSchedule", "stop_step", "lr_scale_factor", "COMPONENTS"]
