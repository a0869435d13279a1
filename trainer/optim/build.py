"""Building the optimizer a config names: its parameter groups (one per trained component, each with its own
learning rate), the constructor from its library with the settings it takes, fused backward, and the
schedule-free train/eval switch."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.errors import ConfigError
from trainer.optim.registry import OptimizerSpec, optimizer_spec
from trainer.optim.rules import check_fused, lr_scale_factor, resolved_learning_rates, split_target

log = logging.getLogger("atelier")


def _check_extra_args(name: str, spec: Any, cls: Any, extra: dict, warn: bool = False) -> None:
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
    """The optimizer's package, its settings and extra_args, checked before the model loads by ``train`` and, when
    extra_args are set, by ``validate`` (this imports the optimizer's library): the optimizer is built on one
    stand-in weight, so settings its constructor refuses (a beta of 1, a key it does not take) fail here."""
    o = cfg.training.optimizer
    spec = optimizer_spec(o.name)
    key = "training.optimizer.name"
    cls = import_target(spec.target, key, o.name, f" Install the '{spec.library}' package or pick another optimizer.")
    extra = to_plain(o.extra_args) or {}
    if extra:
        _check_extra_args(o.name, spec, cls, extra)
    kwargs = {**optimizer_kwargs(spec, cls, o), **extra}
    if o.name == "adafactor" and kwargs.get("relative_step", True):
        kwargs["lr"] = None
    else:
        kwargs["lr"] = cfg.training.learning_rate
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        shown = {k: v for k, v in kwargs.items() if k != "lr"}
        raise ConfigError(f"{key} = {o.name}: {spec.target} rejected its settings {shown}: {exc}",
                          key=key, value=o.name) from None


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------

def param_groups(method, cfg) -> List[Dict[str, Any]]:
    """One group per trained component, each with its own learning rate (blank → base LR).

    Group names are the method's module names ("unet", "text_encoder", "text_encoder_2", "embedding");
    a name without its own LR field uses ``training.learning_rate``.
    """
    lrs = resolved_learning_rates(cfg)
    scale = lr_scale_factor(cfg)  # training.scale_lr
    groups = []
    for name, module in method.modules.items():
        lr = lrs.get(name, cfg.training.learning_rate) * scale
        ratio = loraplus_ratio(cfg, name)
        plus = [p for n, p in module.named_parameters() if p.requires_grad and ratio and LORAPLUS_B in n]
        params = [p for p in module.parameters() if p.requires_grad and not any(p is q for q in plus)]
        if params:
            groups.append({"params": params, "lr": lr, "name": name})
        if plus:  # LoRA+: its own group, frozen with its component (``component``) by the training windows
            groups.append({"params": plus, "lr": lr * ratio, "name": f"{name}.lora_up", "component": name})
    if not groups:
        raise ConfigError("Nothing to train: no trainable parameters (check parts.denoiser.train / "
                          "parts.text_encoder_1.train).", key="parts.denoiser.train")
    return groups


LORAPLUS_B = ".lora_B."  # peft's name of B (kohya's lora_up) in a parameter's path


def loraplus_ratio(cfg, component: str) -> Optional[float]:
    """LoRA+'s learning-rate multiplier for B in one component's adapters, as kohya sd-scripts' networks/lora.py
    ``prepare_optimizer_params`` sets it: the text encoders' ratio (else the general one) for a text encoder, the
    general one for the denoiser; None when off (no LoRA, the embedding)."""
    if cfg.training.method != "lora" or component == "embedding":
        return None
    lora = cfg.lora
    general = lora.get("loraplus_lr_ratio", None)
    if component.startswith("text_encoder"):
        return lora.get("loraplus_text_encoder_lr_ratio", None) or general
    return general


def import_target(path: str, key: str, what: str, hint: str = "") -> Any:
    """Import 'package.module.Name' or 'package.module:Name'."""
    module_name, attr = split_target(path)
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
        import bitsandbytes.optim as bnb_optim  # only when an 8-bit optimizer is asked for (trainer.host.startup)
        p = torch.nn.Parameter(torch.zeros(4096, device=device))
        p.grad = torch.ones_like(p)
        bnb_optim.AdamW8bit([p], lr=1e-3).step()
        if not torch.isfinite(p).all():
            problem = "a test step gave non-finite values"
    except Exception as exc:  # ImportError, missing native library, unsupported device, ...
        problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    _BNB_PROBLEM[kind] = problem
    return problem


def to_plain(value: Any) -> Any:
    """OmegaConf containers → plain Python (lists → tuples, which optimizers expect for betas)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, list):
        return tuple(to_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
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


KERNEL_KEYS = ("fused", "foreach")  # how an optimizer steps, not what it learned: chosen per machine and layout


def portable_state(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state for a backup without its kernel choice (``fused``/``foreach`` depend on the device and
    the process layout that resumes it: one CPU process fuses, FSDP's sharded weights cannot)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list):
        return state_dict
    return {**state_dict, "param_groups": [{k: v for k, v in g.items() if k not in KERNEL_KEYS} for g in groups]}


def restore_kernels(optimizer: Any) -> None:
    """After ``load_state_dict`` of a backup: each group steps with the kernels this optimizer was built with."""
    defaults = getattr(optimizer, "defaults", None) or {}
    for group in getattr(optimizer, "param_groups", []):
        for key in KERNEL_KEYS:
            if key in defaults:
                group[key] = defaults[key]


def _on_cpu(groups: List[Dict[str, Any]]) -> bool:
    """Every weight is a plain tensor on the CPU (FSDP's sharded DTensors have no fused kernels: left alone)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cpu" and not hasattr(p, "device_mesh") for p in params)


def _on_cuda(groups: List[Dict[str, Any]]) -> bool:
    """Every weight is a plain floating tensor on a CUDA device (what torch's fused kernels take)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cuda" and not hasattr(p, "device_mesh") and p.is_floating_point()
                                for p in params)


def _parameters(cls: Any) -> set:
    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def build_optimizer(groups: List[Dict[str, Any]], cfg):
    """The optimizer named by ``training.optimizer.name``, with its settings, over ``groups``."""
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
    cls = import_target(spec.target, key, o.name, f" Install the '{spec.library}' package or pick another optimizer.")
    kwargs = optimizer_kwargs(spec, cls, o)
    extra = to_plain(o.extra_args) or {}
    if extra:
        _check_extra_args(o.name, spec, cls, extra, warn=True)
        kwargs.update(extra)
    if not {"foreach", "fused"} & set(kwargs) and _on_cpu(groups):
        # torch's optimizers take their per-tensor Python loop on the CPU unless told otherwise (foreach and fused
        # are their defaults on CUDA only): AdamW's fused CPU kernel steps 220 small tensors in 1.3 ms against 7.2 ms
        # (foreach: 4.5 ms)
        takes = _parameters(cls)
        if "fused" in takes:
            kwargs["fused"] = True
        elif "foreach" in takes:
            kwargs["foreach"] = True
    elif not {"foreach", "fused"} & set(kwargs) and _on_cuda(groups) and cls.__module__.startswith("torch.optim") \
            and "fused" in _parameters(cls):
        # on CUDA torch defaults to foreach (a few kernels per group of tensors); fused is one kernel per group and
        # takes the GradScaler's scale and inf flag on the device (bitsandbytes' 8-bit optimizers are fused already)
        kwargs["fused"] = True
    if o.name == "adafactor" and kwargs.get("relative_step", True):
        kwargs["lr"] = None  # transformers refuses a manual LR with relative_step
    else:
        kwargs["lr"] = t.learning_rate
    try:
        if t.get("fused_backward"):
            check_fused(cfg, spec)
            optimizer = fused_backward_optimizer(groups, cls, kwargs)
        else:
            optimizer = cls(groups, **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        shown = {k: v for k, v in kwargs.items() if k != "lr"}
        raise ConfigError(f"{key} = {o.name}: {spec.target} rejected its settings {shown}: {exc}",
                          key=key, value=o.name) from None
    on_train(optimizer)
    return optimizer


def fused_backward_optimizer(groups: List[Dict[str, Any]], cls: Any, kwargs: Dict[str, Any]):
    """training.fused_backward: one ``cls`` optimizer per weight, stepped from the weight's
    ``register_post_accumulate_grad_hook`` during backward, its gradient freed right after (kohya's fused
    backward pass, generalised from Adafactor to any per-weight optimizer).

    The returned object is a ``torch.optim.Optimizer`` over the same param groups, so LR schedulers drive
    it as usual: each hook copies its group's current settings (lr, weight_decay, betas, ...) into the
    weight's own optimizer before stepping. Its ``step()`` does nothing (the weights were updated during
    backward); ``state_dict()`` holds every per-weight optimizer's state for backups.
    """
    return FusedBackwardOptimizer(groups, cls, kwargs)


class FusedBackwardOptimizer(torch.optim.Optimizer):
    """See :func:`fused_backward_optimizer`."""

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
