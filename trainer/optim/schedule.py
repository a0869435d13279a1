"""Learning-rate schedules (``training.lr_scheduler``) from ``diffusers.optimization``, with our warm-up,
minimum-LR floor and REX on top as ``LambdaLR`` multipliers (so per-component LRs keep their ratios), and the
per-component training windows (``parts.<part>.stop_after_*``)."""

from __future__ import annotations

import inspect
import re
from typing import Callable, List

from diffusers import optimization as dopt
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainer.config.fields import part_of
from trainer.errors import ConfigError
from trainer.optim.build import check_optimizer_class, import_target, to_plain
from trainer.optim.registry import SCHEDULER_NAMES
from trainer.optim.rules import SCHEDULER_LIBRARIES, scheduler_path_problem

#: Components (param-group names): the model's part slots (parts.* in the config) and the embedding.
COMPONENTS = ("unet", "text_encoder", "text_encoder_2", "text_encoder_3", "embedding")


def _window(cfg, component: str) -> tuple:
    """(stop_after_steps, stop_after_epochs) of a component: parts.<part>.* or training.embedding_*."""
    if component == "embedding":
        t = cfg.training
        return int(t.embedding_stop_after_steps or 0), int(t.embedding_stop_after_epochs or 0)
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
        self.frozen_groups: set = set()  # id() of the groups frozen (a component may have two: LoRA+)

    def __bool__(self) -> bool:
        return any(self.stops.values())

    def apply(self, step: int) -> List[str]:
        """Freeze every component whose window ended at or before ``step``; returns the newly frozen names."""
        new = []
        for group in self.optimizer.param_groups:
            name = group.get("component", group.get("name"))  # a LoRA+ B group follows its component
            stop = self.stops.get(name, 0)
            if not stop or step < stop:
                continue
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            if name not in self.frozen:
                self.frozen.add(name)
                new.append(name)
            if id(group) not in self.frozen_groups:
                self.frozen_groups.add(id(group))
                for p in group["params"]:
                    p.requires_grad_(False)
                    p.grad = None
        return new


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
        from transformers.optimization import AdafactorSchedule  # transformers' optimization module only here
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


def _makes_schedulers(target) -> bool:
    """A scheduler class or a ``get_*`` schedule function of the allowed libraries (not something they import)."""
    module = getattr(target, "__module__", "") or ""
    if not any(module == lib or module.startswith(lib + ".") for lib in SCHEDULER_LIBRARIES):
        return False
    if inspect.isclass(target):
        return issubclass(target, LRScheduler) or "lr_scheduler" in module
    return inspect.isfunction(target) and target.__name__.startswith("get_")


def scheduler_target(cfg):
    """The class or function ``training.lr_scheduler_class`` names, refused before any import unless it comes
    from :data:`SCHEDULER_LIBRARIES`, and after the import unless it makes schedulers."""
    path = cfg.training.lr_scheduler_class.strip()
    key = "training.lr_scheduler_class"
    problem = scheduler_path_problem(path)
    if problem:
        raise ConfigError(problem, key=key, value=path)
    target = import_target(path, key, path)
    if not _makes_schedulers(target):
        raise ConfigError(f"{key} = {path!r} is not an LR scheduler class or get_* schedule function of "
                          f"'{getattr(target, '__module__', '?')}'; name a scheduler (e.g. "
                          "torch.optim.lr_scheduler:OneCycleLR).", key=key, value=path)
    return target


def scheduler_kwargs(target, cfg, total: int, warmup: int) -> dict:
    """training.lr_scheduler_args, plus the run's length and warm-up under the names the target takes
    (num_training_steps/total_steps/total_iters, num_warmup_steps/warmup_steps) when the args leave them out."""
    kwargs = to_plain(cfg.training.lr_scheduler_args) or {}
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    for arg, what in _AUTO_ARGS.items():
        if arg in params and arg not in kwargs:
            kwargs[arg] = total if what == "total" else warmup
    return kwargs


def check_scheduler_class(cfg) -> None:
    """A custom scheduler exists and takes its arguments: imported and its signature bound, nothing called."""
    if cfg.training.lr_scheduler != "custom":
        return
    target = scheduler_target(cfg)
    kwargs = scheduler_kwargs(target, cfg, 1000, 0)
    try:
        inspect.signature(target).bind(None, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"training.lr_scheduler_class = {cfg.training.lr_scheduler_class!r} with "
                          f"training.lr_scheduler_args = {to_plain(cfg.training.lr_scheduler_args) or {}}: {exc}",
                          key="training.lr_scheduler_args") from None


def check_classes(cfg) -> None:
    """What a config imports, checked without a model: the optimizer (built on a stand-in weight) and a custom
    scheduler (signature only). ``train`` runs it before loading; ``validate`` when the config names either."""
    check_optimizer_class(cfg)
    check_scheduler_class(cfg)


def _custom_scheduler(optimizer, cfg, total: int, warmup: int):
    """``package.module:Class(optimizer, **lr_scheduler_args)`` of an allowed library (see
    :func:`scheduler_target`, :func:`scheduler_kwargs`)."""
    path = cfg.training.lr_scheduler_class.strip()
    key = "training.lr_scheduler_class"
    target = scheduler_target(cfg)
    kwargs = scheduler_kwargs(target, cfg, total, warmup)
    try:
        sched = target(optimizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} = {path!r} with training.lr_scheduler_args = {kwargs}: {exc}",
                          key="training.lr_scheduler_args") from None
    if not (callable(getattr(sched, "step", None)) and callable(getattr(sched, "state_dict", None))):
        raise ConfigError(f"{key} = {path!r} did not make an LR scheduler (no step()/state_dict()): got "
                          f"{type(sched).__name__}.", key=key, value=path)
    return sched
