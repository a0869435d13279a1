"""The optimizer and learning-rate scheduler registry: config names → constructors from real libraries.

``OPTIMIZERS`` is the single source of truth: each entry names its constructor by import path (so this
module imports nothing heavy: the schema reads its choices from here), the schema fields of
``training.optimizer`` it takes, and its family. The web UI can show only the settings of the chosen
optimizer with :func:`optimizer_fields`. Imports nothing of Atelier but its errors.

Schedules come from ``diffusers.optimization`` (``trainer.optim.schedule``: our warm-up, minimum-LR floor and
REX on top, as ``LambdaLR`` multipliers so per-component LRs keep their ratios), Adafactor's own from
``transformers``, and any ``package.module:Class`` for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping

from trainer.errors import ConfigError

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
    def root(self) -> str:
        """The package the optimizer comes from (trainer.optim.prodigy: prodigyopt's Prodigy, trainer.optim.adafactor:
        transformers' Adafactor, each with a host-light step)."""
        return _OWN_STEPS.get(self.module, self.module.split(".")[0])

    @property
    def library(self) -> str:
        return {"torch": "torch", "bitsandbytes": "bitsandbytes", "prodigyopt": "prodigyopt",
                "pytorch_optimizer": "pytorch-optimizer", "transformers": "transformers",
                "prodigyplus": "prodigy-plus-schedule-free"}.get(self.root, self.module)

    @property
    def module(self) -> str:
        return self.target.rsplit(".", 1)[0]


# Atelier's subclasses that take a library's optimizer step without its device reads: the library they come from
_OWN_STEPS = {"trainer.optim.prodigy": "prodigyopt", "trainer.optim.adafactor": "transformers"}


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
    "prodigy": OptimizerSpec("trainer.optim.prodigy.Prodigy", "adaptive",
                             {**_ADAM, "beta3": "beta3", "decouple": "decouple",
                              "use_bias_correction": "use_bias_correction", "safeguard_warmup": "safeguard_warmup",
                              "d0": "d0", "d_coef": "d_coef", "growth_rate": "growth_rate", "slice_p": "slice_p"},
                             "Prodigy (prodigyopt's, its step taken with foreach ops and one device read): "
                             "finds its own step size; keep LR = 1 on every component, scale with d_coef.",
                             adaptive_lr=True),
    "prodigy_plus_schedulefree": OptimizerSpec(
        "prodigyplus.ProdigyPlusScheduleFree", "adaptive",
        {**_ADAM, "beta3": "beta3", "use_bias_correction": "use_bias_correction", "d0": "d0", "d_coef": "d_coef",
         "d_limiter": "d_limiter", "prodigy_steps": "prodigy_steps", "split_groups": "split_groups",
         "factored": "factored", "use_stableadamw": "use_stableadamw"},
        "Prodigy + schedule-free (prodigy-plus-schedule-free): LR = 1, constant schedule.",
        adaptive_lr=True, schedule_free=True),
    # --- transformers --------------------------------------------------------------------------
    "adafactor": OptimizerSpec("trainer.optim.adafactor.Adafactor", "adafactor",
                               {"beta1": "beta1", "eps": "eps.0", "eps2": "eps.1", "weight_decay": "weight_decay",
                                "relative_step": "relative_step", "scale_parameter": "scale_parameter",
                                "warmup_init": "warmup_init", "clip_threshold": "clip_threshold",
                                "decay_rate": "decay_rate"},
                               "Adafactor (transformers', its step size kept on the device): adaptive mode "
                               "(relative_step on: own LR, lr_scheduler = adafactor) or low-memory AdamW-like "
                               "mode (relative_step, scale_parameter and warmup_init off, an explicit LR, constant "
                               "schedule)."),
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
