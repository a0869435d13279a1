"""Optimizer and LR-scheduler registry: every optimizer steps, state round-trips, schedules match their
formulas, and bad settings give messages that name the field."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from trainer.config.checks import cross_field_warnings, load_config
from trainer.config.fields import field_info
from trainer.config.schema import AtelierConfig
from trainer.config.schema_training import OptimizerConfig
from trainer.errors import ConfigError
from trainer.optim import build as optim_build, registry as optim_registry, rules as optim_rules
from trainer.optim.build import build_optimizer, on_eval, on_train, param_groups
from trainer.optim.registry import OPTIMIZERS, SCHEDULER_NAMES
from trainer.optim.rules import resolved_learning_rates
from trainer.optim.schedule import build_scheduler, rex_factor

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported")

BASE = OmegaConf.structured(AtelierConfig)

# LRs that make a few steps of each kind visibly lower the loss on the tiny model
STEP_LR = {"sgd": 0.05, "sgd8bit": 0.05, "lars8bit": 0.05, "lars": 1.0, "adagrad": 0.05, "adagrad8bit": 0.05,
           "rmsprop": 1e-3, "rmsprop8bit": 1e-3, "lion": 1e-3, "lion8bit": 1e-3, "paged_lion8bit": 1e-3,
           "came": 1e-3}


def make_cfg(**training):
    """A schema config with training.* (and training.optimizer.* via 'optimizer') overrides, unvalidated."""
    cfg = BASE.copy()
    for k, v in training.pop("optimizer", {}).items():
        cfg.training.optimizer[k] = v
    for k, v in training.items():
        cfg.training[k] = v
    return cfg


def tiny_model():
    """Conv + a 16k-weight Linear (big enough for bitsandbytes' 8-bit state) as 'unet', a head as 'text_encoder'."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "unet": torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten(),
                                    torch.nn.Linear(256, 64), torch.nn.Tanh()),
        "text_encoder": torch.nn.Linear(64, 1)})


class FakeMethod:
    def __init__(self, modules):
        self.modules = dict(modules)


_g = torch.Generator().manual_seed(1)
X = torch.randn(32, 3, 8, 8, generator=_g)
Y = torch.randn(32, 1, generator=_g)


def loss_of(model):
    return ((model["text_encoder"](model["unet"](X)) - Y) ** 2).mean()


def train_steps(model, opt, sched, n):
    for _ in range(n):
        loss = loss_of(model)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def need(name):
    """Skip an optimizer whose optional package is missing (prodigy-plus-schedule-free)."""
    top = OPTIMIZERS[name].module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{name}: package {OPTIMIZERS[name].library} is not installed")


def cfg_for(name, **extra):
    need(name)
    spec = OPTIMIZERS[name]
    lr = 1.0 if spec.adaptive_lr else STEP_LR.get(name, 1e-2)
    o = {"name": name}
    if spec.needs_momentum or name == "sgd":
        o["momentum"] = 0.9
    sched = "adafactor" if name == "adafactor" else "constant"
    return make_cfg(learning_rate=lr, lr_scheduler=sched, optimizer=o, **extra), lr


# ----------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------

def test_choices_come_from_the_registry_and_fields_exist():
    fld, _ = field_info("training.optimizer.name")
    assert fld.metadata["choices"] == list(OPTIMIZERS)
    fld, _ = field_info("training.lr_scheduler")
    assert fld.metadata["choices"] == SCHEDULER_NAMES
    fields = set(OptimizerConfig.__dataclass_fields__)
    for name, spec in OPTIMIZERS.items():
        assert set(spec.args) <= fields, name
        assert all(k.split(".")[-1] in fields for k in optim_registry.optimizer_fields(name))
    for name in ("adamw", "adam", "sgd", "adagrad", "rmsprop", "lamb", "lars", "lion", "adamw8bit", "adam8bit",
                 "lion8bit", "sgd8bit", "rmsprop8bit", "adagrad8bit", "lamb8bit", "lars8bit", "ademamix8bit",
                 "paged_adamw8bit", "adafactor", "came", "prodigy", "dadapt_adam", "dadapt_adagrad",
                 "dadapt_adan", "dadapt_lion", "dadapt_sgd", "schedulefree_adamw", "schedulefree_sgd",
                 "prodigy_plus_schedulefree", "adopt"):
        assert name in OPTIMIZERS
    for name in ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                 "cosine_with_hard_restarts", "polynomial", "piecewise_constant", "rex", "adafactor", "custom"):
        assert name in SCHEDULER_NAMES
    # help text says which optimizers take a field
    fld, _ = field_info("training.optimizer.d_coef")
    assert "prodigy" in fld.metadata["help"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_mapped_setting_is_a_real_constructor_argument(name):
    """pytorch-optimizer swallows unknown **kwargs: a typo in the table would silently do nothing."""
    need(name)
    spec = OPTIMIZERS[name]
    cls = optim_build.import_target(spec.target, "k", name)
    params = inspect.signature(cls).parameters
    for setting, kw in spec.args.items():
        assert kw.split(".")[0] in params, f"{name}: {setting} → {kw} not in {spec.target}{list(params)}"


# ----------------------------------------------------------------------------------------------
# every optimizer steps; the standard ones lower the loss; state round-trips
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_and_resumes_exactly(name):
    cfg, lr = cfg_for(name)
    spec = OPTIMIZERS[name]
    model = tiny_model()
    groups = param_groups(FakeMethod(model), make_cfg(learning_rate=lr))
    opt = build_optimizer(groups, cfg)
    sched = build_scheduler(opt, cfg, 20)
    assert [g["name"] for g in opt.param_groups] == ["unet", "text_encoder"]
    before = [p.detach().clone() for p in model.parameters()]
    start = loss_of(model).item()
    train_steps(model, opt, sched, 3)

    # backup as the loop writes it
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "params": [p.detach().clone() for p in model.parameters()]}, buf)
    if spec.eight_bit:
        assert any(v.dtype == torch.uint8 for s in opt.state.values() for v in s.values()
                   if torch.is_tensor(v)), "no 8-bit state"
    last = train_steps(model, opt, sched, 3)
    reference = [p.detach().clone() for p in model.parameters()]
    on_eval(opt)  # schedule-free: judge the averaged weights
    end = loss_of(model).item()

    assert math.isfinite(last) and math.isfinite(end)
    assert any(not torch.equal(a, b) for a, b in zip(before, reference)), "the weights did not move"
    if not spec.adaptive_lr and spec.family != "schedule_free":
        assert end < start, f"{name}: loss {start:.4f} → {end:.4f}"

    # resume: fresh model and optimizer, load the backup, same 3 steps → the same weights
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    model2 = tiny_model()
    with torch.no_grad():
        for p, saved in zip(model2.parameters(), state["params"]):
            p.copy_(saved)
    opt2 = build_optimizer(param_groups(FakeMethod(model2), make_cfg(learning_rate=lr)), cfg)
    sched2 = build_scheduler(opt2, cfg, 20)
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    train_steps(model2, opt2, sched2, 3)
    for a, b in zip(reference, model2.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_schedule_free_switches_to_averaged_weights_for_eval():
    cfg, lr = cfg_for("schedulefree_adamw")
    model = tiny_model()
    opt = build_optimizer(param_groups(FakeMethod(model), make_cfg(learning_rate=lr)), cfg)
    train_steps(model, opt, build_scheduler(opt, cfg, 10), 4)
    train_w = [p.detach().clone() for p in model.parameters()]
    on_eval(opt)
    assert any(not torch.allclose(a, p) for a, p in zip(train_w, model.parameters()))
    on_train(opt)
    for a, p in zip(train_w, model.parameters()):
        torch.testing.assert_close(a, p.detach(), rtol=1e-5, atol=1e-6)
    on_eval(torch.optim.SGD(model.parameters(), lr=0.1))  # plain optimizers: a no-op


def test_settings_reach_the_constructor():
    model = tiny_model()
    cfg = make_cfg(learning_rate=1.0, optimizer={"name": "prodigy", "beta1": 0.8, "beta3": 0.5, "d_coef": 2.0,
                                                  "d0": 1e-5, "growth_rate": 1.02, "safeguard_warmup": True,
                                                  "use_bias_correction": True, "decouple": False,
                                                  "weight_decay": 0.1, "slice_p": 11})
    opt = build_optimizer([{"params": list(model.parameters()), "lr": 1.0}], cfg)
    g = opt.param_groups[0]
    assert g["betas"] == (0.8, 0.999) and g["beta3"] == 0.5 and g["d_coef"] == 2.0 and g["d"] == 1e-5
    assert g["growth_rate"] == 1.02 and g["safeguard_warmup"] and g["use_bias_correction"]
    assert not g["decouple"] and g["weight_decay"] == 0.1 and g["slice_p"] == 11
    # Adafactor low-memory mode: explicit LR; adaptive mode: no LR
    cfg = make_cfg(learning_rate=3e-4, optimizer={"name": "adafactor", "relative_step": False,
                                                   "scale_parameter": False, "eps2": 2e-3})
    opt = build_optimizer([{"params": list(model.parameters()), "lr": 3e-4}], cfg)
    assert opt.defaults["lr"] == 3e-4 and not opt.defaults["relative_step"] and opt.defaults["eps"] == (1e-30, 2e-3)
    cfg = make_cfg(optimizer={"name": "adafactor"})
    assert build_optimizer([{"params": list(model.parameters()), "lr": 1e-4}], cfg).defaults["lr"] is None
    # extra_args win and reach the constructor
    cfg = make_cfg(optimizer={"name": "adamw", "extra_args": {"betas": [0.5, 0.6], "maximize": False}})
    assert build_optimizer([{"params": list(model.parameters()), "lr": 1e-4}], cfg).defaults["betas"] == (0.5, 0.6)


def test_param_groups_per_component_lr_blank_falls_back():
    mods = {n: torch.nn.Linear(2, 2) for n in ("unet", "text_encoder", "text_encoder_2", "embedding", "other")}
    mods["frozen"] = torch.nn.Linear(2, 2).requires_grad_(False)
    cfg = make_cfg(learning_rate=1e-4, embedding_learning_rate=5e-3)
    cfg.parts.denoiser.learning_rate, cfg.parts.text_encoder_2.learning_rate = 2e-4, 3e-5
    groups = param_groups(FakeMethod(mods), cfg)
    assert {g["name"]: g["lr"] for g in groups} == {"unet": 2e-4, "text_encoder": 1e-4, "text_encoder_2": 3e-5,
                                                     "embedding": 5e-3, "other": 1e-4}
    assert resolved_learning_rates(cfg)["text_encoder"] == 1e-4
    with pytest.raises(ConfigError, match="Nothing to train"):
        param_groups(FakeMethod({"frozen": mods["frozen"]}), cfg)


# ----------------------------------------------------------------------------------------------
# schedules: LR at chosen steps matches the formula, for two groups with different LRs
# ----------------------------------------------------------------------------------------------

def lr_curve(total=100, steps=(0, 5, 10, 11, 30, 55, 99, 100), **training):
    cfg = make_cfg(**training)
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.5}], lr=1.0)
    sched = build_scheduler(opt, cfg, total)
    out = {}
    for s in range(max(steps) + 1):
        if s in steps:
            lr1, lr2 = (g["lr"] for g in opt.param_groups)
            assert lr2 == pytest.approx(lr1 / 2, abs=1e-12), "per-group LR ratio lost"
            out[s] = lr1
        opt.step()
        sched.step()
    return out, sched, opt


COS = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731


@pytest.mark.parametrize("training, formula", [
    (dict(lr_scheduler="constant"), lambda s: 1.0),
    (dict(lr_scheduler="constant", lr_warmup_steps=10), lambda s: 1.0),  # ignores warm-up (warned)
    (dict(lr_scheduler="constant_with_warmup", lr_warmup_steps=10), lambda s: s / 10 if s < 10 else 1.0),
    (dict(lr_scheduler="linear", lr_warmup_steps=10), lambda s: s / 10 if s < 10 else (100 - s) / 90),
    (dict(lr_scheduler="linear", lr_warmup_fraction=0.1), lambda s: s / 10 if s < 10 else (100 - s) / 90),
    (dict(lr_scheduler="linear", lr_warmup_steps=10, lr_min_factor=0.25),
     lambda s: s / 10 if s < 10 else 0.25 + 0.75 * (100 - s) / 90),
    (dict(lr_scheduler="cosine", lr_warmup_fraction=0.1), lambda s: s / 10 if s < 10 else COS((s - 10) / 90)),
    (dict(lr_scheduler="cosine", lr_min_factor=0.1), lambda s: 0.1 + 0.9 * COS(s / 100)),
    (dict(lr_scheduler="cosine_with_restarts", lr_cycles=2),
     lambda s: 0.5 * (1 + math.cos(2 * math.pi * 2 * s / 100))),
    (dict(lr_scheduler="cosine_with_hard_restarts", lr_cycles=3, lr_warmup_steps=10),
     lambda s: s / 10 if s < 10 else (0.0 if s >= 100 else COS((3 * (s - 10) / 90) % 1.0))),
    (dict(lr_scheduler="polynomial", lr_power=2.0, lr_min_factor=0.1, lr_warmup_steps=10),
     lambda s: s / 10 if s < 10 else 0.1 + 0.9 * (1 - (s - 10) / 90) ** 2),
    (dict(lr_scheduler="rex"), lambda s: (1 - s / 100) / (1 - s / 200)),
    (dict(lr_scheduler="rex", lr_min_factor=0.2, lr_warmup_steps=10),  # warm-up ignored (warned)
     lambda s: 0.2 + 0.8 * (1 - s / 100) / (1 - s / 200)),
    (dict(lr_scheduler="piecewise_constant", lr_step_rules="1:10, 0.5:30,0.1"),
     lambda s: 1.0 if s < 10 else 0.5 if s < 30 else 0.1),
    (dict(lr_scheduler="custom", lr_scheduler_class="torch.optim.lr_scheduler:StepLR",
          lr_scheduler_args={"step_size": 10, "gamma": 0.5}), lambda s: 0.5 ** (s // 10)),
    (dict(lr_scheduler="custom", lr_scheduler_class="diffusers.optimization:get_cosine_schedule_with_warmup",
          lr_warmup_steps=10), lambda s: s / 10 if s < 10 else COS((s - 10) / 90)),  # steps filled in
])
def test_schedule_matches_formula(training, formula):
    got, _, _ = lr_curve(**training)
    for s, lr in got.items():
        assert lr == pytest.approx(formula(s), abs=1e-9), (s, lr, formula(s))


def test_schedules_agree_with_the_libraries():
    from diffusers.optimization import get_polynomial_decay_schedule_with_warmup
    from pytorch_optimizer import REXScheduler
    rex = REXScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), total_steps=100)
    for s in (0, 1, 37, 99, 100, 120):
        rex.step_t = s
        assert rex_factor(s, 100) == pytest.approx(rex.get_linear_lr())
    p = torch.nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.SGD([p], lr=1.0)
    ref = get_polynomial_decay_schedule_with_warmup(ref_opt, 10, 100, lr_end=0.1, power=2.0)
    ours, _, _ = lr_curve(lr_scheduler="polynomial", lr_power=2.0, lr_min_factor=0.1, lr_warmup_steps=10,
                          steps=tuple(range(0, 101, 7)))
    for s in range(0, 101):
        if s in ours:
            assert ours[s] == pytest.approx(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()


def test_scheduler_state_round_trips():
    _, sched, opt = lr_curve(lr_scheduler="cosine", lr_min_factor=0.3, lr_warmup_steps=5, steps=(40,))
    state = sched.state_dict()
    cfg = make_cfg(lr_scheduler="cosine", lr_min_factor=0.3, lr_warmup_steps=5)
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt2 = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.5}], lr=1.0)
    opt2.load_state_dict(opt.state_dict())
    sched2 = build_scheduler(opt2, cfg, 100)
    sched2.load_state_dict(state)
    for _ in range(7):
        opt.step(), sched.step(), opt2.step(), sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in opt.param_groups])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3 + 0.7 * COS((48 - 5) / 95))


def test_adafactor_schedule_reports_adafactors_own_lr():
    model = tiny_model()
    cfg = make_cfg(lr_scheduler="adafactor", optimizer={"name": "adafactor"})
    opt = build_optimizer(param_groups(FakeMethod(model), cfg), cfg)
    sched = build_scheduler(opt, cfg, 10)
    train_steps(model, opt, sched, 3)
    loss_of(model).backward()  # AdafactorSchedule reads groups that have gradients
    for group in opt.param_groups:
        want = opt._get_lr(group, opt.state[group["params"][0]])
        assert want == pytest.approx(sched.get_lr()[opt.param_groups.index(group)])
    assert 0 < opt.param_groups[0]["lr"] <= 1e-2


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, words", [
    (["training.optimizer.name=adamw9bit"], ["training.optimizer.name", "adamw9bit", "adamw8bit", "prodigy"]),
    (["training.optimizer.beta1=1.5"], ["training.optimizer.beta1", "out of range"]),
    (["training.optimizer.momentum=abc"], ["training.optimizer.momentum", "'abc'", "number"]),
    (["training.optimizer.d_coef=-1"], ["training.optimizer.d_coef", "out of range"]),
    (["training.optimizer.slice_p=0"], ["training.optimizer.slice_p", "out of range"]),
    (["training.optimizer.decay_rate=0.5"], ["training.optimizer.decay_rate", "out of range"]),
    (["training.optimizer.nesterov=maybe"], ["training.optimizer.nesterov"]),
    (["training.optimizer.name=sgd8bit"], ["training.optimizer.momentum", "sgd8bit", "> 0"]),
    (["training.lr_warmup_steps=10", "training.lr_warmup_fraction=0.1"],
     ["training.lr_warmup_steps", "training.lr_warmup_fraction", "one of them"]),
    (["training.lr_warmup_fraction=1.5"], ["training.lr_warmup_fraction", "out of range"]),
    (["training.lr_min_factor=-0.1"], ["training.lr_min_factor", "out of range"]),
    (["training.lr_scheduler=custom"], ["training.lr_scheduler_class", "package.module:Class"]),
    (["training.lr_scheduler=custom", "training.lr_scheduler_class=not a path"], ["lr_scheduler_class", "import path"]),
    (["training.lr_scheduler=piecewise_constant", "training.lr_step_rules=1:x"], ["training.lr_step_rules"]),
    (["training.lr_scheduler=adafactor"], ["training.lr_scheduler", "adafactor", "relative_step"]),
    (["training.optimizer.name=adafactor", "training.optimizer.relative_step=false",
      "training.optimizer.warmup_init=true"], ["training.optimizer.warmup_init", "relative_step"]),
    (["training.optimizer.extra_args={lr: 0.1}"], ["training.optimizer.extra_args.lr"]),
])
def test_bad_settings_name_the_field(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(preset="demo", overrides=override)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_bad_settings_found_at_build_time():
    model = tiny_model()
    groups = lambda: [{"params": list(model.parameters()), "lr": 1e-3}]  # noqa: E731
    with pytest.raises(ConfigError, match=r"extra_args.foo.*takes no 'foo'.*amsgrad"):
        build_optimizer(groups(), make_cfg(optimizer={"name": "adamw", "extra_args": {"foo": 1}}))
    with pytest.raises(ConfigError, match=r"training.optimizer.name = adamw: .*beta"):
        build_optimizer(groups(), make_cfg(optimizer={"name": "adamw", "beta1": 1.0}))  # in range, torch refuses
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cannot import 'pytorch_optimizer.no_such_mod'"):
        build_scheduler(opt, make_cfg(lr_scheduler="custom", lr_scheduler_class="pytorch_optimizer.no_such_mod:Sched"), 10)
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        build_scheduler(opt, make_cfg(lr_scheduler="custom", lr_scheduler_class="torch.optim.lr_scheduler:Nope"), 10)
    with pytest.raises(ConfigError, match="lr_scheduler_args"):
        build_scheduler(opt, make_cfg(lr_scheduler="custom", lr_scheduler_class="torch.optim.lr_scheduler:StepLR",
                                      lr_scheduler_args={"bogus": 1}), 10)


def _validate_cli(*overrides):
    from trainer.__main__ import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["validate", "--preset", "demo", "--json", *[a for o in overrides for a in ("--set", o)]])
    return rc, json.loads(out.getvalue())


def test_a_config_imports_nothing_outside_the_scheduler_libraries(tmp_path, monkeypatch):
    """training.lr_scheduler_class is a name from torch/diffusers/transformers/pytorch_optimizer, refused before
    any import otherwise: a module of the user's (or os, torch.save) is never imported or called."""
    (tmp_path / "evil_sched.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\nclass S: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("evil_sched:S", "os:system", "torch:save", "torch.optim.lr_scheduler:_LRScheduler",
                 "builtins.eval"):
        with pytest.raises(ConfigError) as err:
            load_config(preset="demo", overrides=["training.lr_scheduler=custom", f"training.lr_scheduler_class={path}"])
        assert err.value.key == "training.lr_scheduler_class", path
        assert "torch.optim.lr_scheduler" in str(err.value) or "private" in str(err.value), str(err.value)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with pytest.raises(ConfigError):  # the build path refuses it too (a config written past validate)
            build_scheduler(opt, make_cfg(lr_scheduler="custom", lr_scheduler_class=path), 10)
    assert not (tmp_path / "ran").exists()
    # a name the allowed module merely imports is no scheduler
    with pytest.raises(ConfigError, match="not an LR scheduler"):
        build_scheduler(opt, make_cfg(lr_scheduler="custom", lr_scheduler_class="torch.optim.lr_scheduler:Optimizer"), 10)


@pytest.mark.parametrize("overrides, key, words", [
    (["training.optimizer.extra_args={foo: 1}"], "training.optimizer.extra_args.foo", ["takes no 'foo'"]),
    (["training.optimizer.beta1=1.0"], "training.optimizer.name", ["rejected", "beta"]),
    (["training.lr_scheduler=custom", "training.lr_scheduler_class=torch.optim.lr_scheduler:Nope"],
     "training.lr_scheduler_class", ["has no 'Nope'"]),
    (["training.lr_scheduler=custom", "training.lr_scheduler_class=torch.optim.lr_scheduler:StepLR"],
     "training.lr_scheduler_args", ["step_size"]),
    (["training.lr_scheduler=custom", "training.lr_scheduler_class=torch.optim.lr_scheduler:StepLR",
      "training.lr_scheduler_args={step_size: 2, bogus: 1}"], "training.lr_scheduler_args", ["bogus"]),
])
def test_validate_checks_the_classes_a_config_names(overrides, key, words):
    """What train's constructors would refuse, validate names first (the classes imported, only the optimizer built
    on a stand-in weight, the scheduler's signature bound)."""
    rc, out = _validate_cli(*overrides)
    assert rc == 1 and [e["key"] for e in out["errors"]] == [key], out
    for w in words:
        assert w in out["errors"][0]["message"], out
    rc, out = _validate_cli("training.lr_scheduler=custom", "training.lr_scheduler_class=torch.optim.lr_scheduler:StepLR",
                            "training.lr_scheduler_args={step_size: 2}", "training.optimizer.beta1=0.8")
    assert rc == 0 and out["errors"] == [], out


def test_eight_bit_when_bitsandbytes_cannot_run(monkeypatch):
    monkeypatch.setitem(optim_build._BNB_PROBLEM, "cpu", "RuntimeError: no CPU kernel in this build")
    model = tiny_model()
    with pytest.raises(ConfigError) as err:
        build_optimizer([{"params": list(model.parameters()), "lr": 1e-3}],
                        make_cfg(optimizer={"name": "lion8bit"}))
    msg = str(err.value)
    assert err.value.key == "training.optimizer.name"
    for w in ("lion8bit", "bitsandbytes", "cannot run", "no CPU kernel", "Pick lion"):
        assert w in msg, msg
    # not installed at all: an error-level issue before launch
    real = optim_rules.importlib.util.find_spec
    monkeypatch.setattr(optim_rules.importlib.util, "find_spec",
                        lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    issues = cross_field_warnings(load_config(preset="demo", overrides=["training.optimizer.name=adamw8bit"]))
    assert any(i.key == "training.optimizer.name" and i.level == "error" and "adamw (32-bit" in i.message
               for i in issues)


def test_bitsandbytes_runs_here():
    assert optim_build.bitsandbytes_problem("cpu") is None


def warnings_for(*overrides):
    return {i.key: i.message for i in cross_field_warnings(load_config(preset="demo", overrides=list(overrides)))}


def test_warnings_prodigy_rex_schedule_free_adafactor():
    w = warnings_for("training.optimizer.name=prodigy")  # demo LR 1e-3
    assert "LR 1" in w["training.learning_rate"] and "d_coef" in w["training.learning_rate"]
    w = warnings_for("training.optimizer.name=dadapt_adam", "training.learning_rate=1",
                     "training.train_text_encoder=true", "training.text_encoder_learning_rate=0.5")
    assert "parts.text_encoder_1.learning_rate = 0.5" in w["parts.text_encoder_1.learning_rate"]
    assert "training.learning_rate" not in w
    w = warnings_for("training.optimizer.name=prodigy", "training.learning_rate=1",
                     "training.train_text_encoder=true", "training.unet_learning_rate=1",
                     "training.text_encoder_learning_rate=1")
    assert not any("LR 1" in m for m in w.values()), w
    w = warnings_for("training.optimizer.name=prodigy", "training.learning_rate=1", "training.lr_warmup_steps=5",
                     "training.lr_scheduler=cosine")
    assert "training.optimizer.safeguard_warmup" in w
    w = warnings_for("training.lr_scheduler=rex", "training.lr_warmup_fraction=0.1")
    assert "REX" in w["training.lr_warmup_fraction"] and "no warm-up" in w["training.lr_warmup_fraction"]
    w = warnings_for("training.optimizer.name=schedulefree_adamw", "training.lr_scheduler=cosine")
    assert "schedule-free" in w["training.lr_scheduler"]
    w = warnings_for("training.optimizer.name=adafactor", "training.lr_scheduler=cosine")
    assert "relative_step" in w["training.lr_scheduler"]
    w = warnings_for("training.lr_scheduler=constant", "training.lr_warmup_steps=5", "training.lr_min_factor=0.1")
    assert "constant_with_warmup" in w["training.lr_warmup_steps"] and "training.lr_min_factor" in w
    w = warnings_for("training.lr_scheduler=linear", "training.max_steps=10", "training.lr_warmup_steps=10")
    assert "whole run" in w["training.lr_warmup_steps"]
    assert warnings_for() == {}


def test_custom_scheduler_args_from_the_command_line():
    cfg = load_config(preset="demo", overrides=["training.lr_scheduler=custom",
                                                "training.lr_scheduler_class=torch.optim.lr_scheduler:StepLR",
                                                "training.lr_scheduler_args={step_size: 3, gamma: 0.1}"])
    assert cfg.training.lr_scheduler_args == {"step_size": 3, "gamma": 0.1}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(3):
        opt.step(), sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("name,kernel", [("adamw", "fused"), ("sgd", "fused"), ("lion", None)])
def test_torch_optimizers_step_cpu_weights_with_their_fused_kernel_unless_told(name, kernel):
    """On the CPU torch's optimizers default to a Python loop over the tensors; Atelier asks for the fused kernel
    (or foreach) where the class takes it. extra_args that choose either are kept; other libraries' classes are left
    alone."""
    cfg, lr = cfg_for(name)
    model = tiny_model()
    opt = build_optimizer(param_groups(FakeMethod(model), make_cfg(learning_rate=lr)), cfg)
    if kernel is None:
        assert "fused" not in opt.defaults or not opt.defaults["fused"]
    else:
        assert opt.defaults[kernel] is True
    cfg.training.optimizer.extra_args = {"foreach": False}
    opt = build_optimizer(param_groups(FakeMethod(tiny_model()), make_cfg(learning_rate=lr)), cfg)
    assert opt.defaults["foreach"] is False and not opt.defaults.get("fused")


def test_a_backup_leaves_out_the_kernel_choice_and_a_resumed_optimizer_keeps_its_own():
    """One CPU process fuses, FSDP's sharded weights cannot: a backup resumes under either, so its optimizer state
    carries no fused/foreach, and the loaded optimizer steps with the kernels it was built with."""
    cfg, lr = cfg_for("adamw")
    opt = build_optimizer(param_groups(FakeMethod(tiny_model()), make_cfg(learning_rate=lr)), cfg)
    saved = optim_build.portable_state(opt.state_dict())
    assert all("fused" not in g and "foreach" not in g for g in saved["param_groups"])
    assert all(g["fused"] is True for g in opt.state_dict()["param_groups"])  # the live optimizer's choice is kept
    opt.load_state_dict(saved)
    optim_build.restore_kernels(opt)
    assert all(g["fused"] is True for g in opt.param_groups)
