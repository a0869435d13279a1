"""Issue 5, the rest of the knobs: per-component training windows, LR/batch scaling, fused backward pass."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from trainer.config.checks import cross_field_warnings
from trainer.config.schema import AtelierConfig
from trainer.errors import ConfigError
from trainer.optim.schedule import ComponentSchedule, build_scheduler, stop_step
from trainer.optim.build import build_optimizer, param_groups
from trainer.optim.rules import lr_scale_factor, validate_optim

pytestmark = pytest.mark.slow

BASE = OmegaConf.structured(AtelierConfig)


def make_cfg(**training):
    """training.* settings; the per-part ones by their version-1 names (train_text_encoder, ...)."""
    from omegaconf import OmegaConf

    from trainer.config.load import renamed_key
    cfg = BASE.copy()
    for k, v in training.pop("optimizer", {}).items():
        cfg.training.optimizer[k] = v
    for k, v in training.items():
        for key in renamed_key(f"training.{k}"):
            OmegaConf.update(cfg, key, v, merge=False)
    return cfg


class FakeMethod:
    def __init__(self, modules):
        self.modules = dict(modules)


def tiny_model(width=64):
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "unet": torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16)),
        "text_encoder": torch.nn.Linear(16, 16)})


_g = torch.Generator().manual_seed(1)
X = torch.randn(8, 16, generator=_g)
Y = torch.randn(8, 16, generator=_g)


def loss_of(model, i=0):
    x = X.roll(i, 0)
    return ((model["unet"](model["text_encoder"](x)) - Y) ** 2).mean()


def train(model, optimizer, scheduler, steps, start=0, components=None):
    """The loop's order: backward, optimizer step, scheduler step, zero_grad, component windows."""
    for i in range(start, start + steps):
        loss_of(model, i).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if components is not None:
            components.apply(i + 1)


def build(cfg, model, total=10):
    opt = build_optimizer(param_groups(FakeMethod(model), cfg), cfg)
    return opt, build_scheduler(opt, cfg, total)


def flat(module):
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


# --- LR / batch scaling -------------------------------------------------------------------------

@pytest.mark.parametrize("mode,factor", [("none", 1.0), ("linear", 8.0), ("sqrt", 8 ** 0.5)])
def test_scale_lr_multiplies_every_component_by_the_effective_batch(mode, factor):
    cfg = make_cfg(batch_size=4, gradient_accumulation_steps=2, scale_lr=mode, learning_rate=1e-4,
                   text_encoder_learning_rate=5e-5, train_text_encoder=True)
    assert lr_scale_factor(cfg) == pytest.approx(factor)
    groups = {g["name"]: g["lr"] for g in param_groups(FakeMethod(tiny_model()), cfg)}
    assert groups["unet"] == pytest.approx(1e-4 * factor)
    assert groups["text_encoder"] == pytest.approx(5e-5 * factor)


def test_scale_lr_counts_processes_when_the_schema_has_them():
    cfg = make_cfg(batch_size=2, scale_lr="linear")
    plain = OmegaConf.create(OmegaConf.to_container(cfg))
    plain.general.num_processes = 3
    assert lr_scale_factor(plain) == 6.0


def test_scale_lr_with_prodigy_warns():
    cfg = make_cfg(scale_lr="linear", learning_rate=1.0, optimizer={"name": "prodigy"})
    assert any(i.key == "training.scale_lr" for i in cross_field_warnings(cfg))


# --- per-component training windows ------------------------------------------------------------

def test_stop_step_takes_the_earlier_of_steps_and_epochs():
    cfg = make_cfg(text_encoder_stop_after_steps=7, text_encoder_stop_after_epochs=2)
    assert stop_step(cfg, "text_encoder", 3) == 6
    assert stop_step(cfg, "text_encoder", 5) == 7
    assert stop_step(cfg, "unet", 5) == 0
    assert stop_step(make_cfg(text_encoder_2_stop_after_epochs=1), "text_encoder_2", 4) == 4


def test_text_encoder_stops_changing_after_its_window_even_with_weight_decay():
    cfg = make_cfg(train_text_encoder=True, text_encoder_stop_after_steps=2, lr_scheduler="cosine",
                   learning_rate=1e-2, optimizer={"name": "adamw", "weight_decay": 0.5})
    model = tiny_model()
    opt, sched = build(cfg, model)
    comps = ComponentSchedule(opt, cfg, steps_per_epoch=5)
    train(model, opt, sched, 2, components=comps)
    te, unet = flat(model["text_encoder"]), flat(model["unet"])
    assert comps.frozen == {"text_encoder"}
    assert not any(p.requires_grad for p in model["text_encoder"].parameters())
    train(model, opt, sched, 3, start=2, components=comps)
    assert torch.equal(flat(model["text_encoder"]), te)
    assert not torch.equal(flat(model["unet"]), unet)
    lrs = {g["name"]: (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert lrs["text_encoder"] == (0.0, 0.0) and lrs["unet"][0] > 0


def test_resumed_run_refreezes_and_matches_the_uninterrupted_one():
    cfg = make_cfg(train_text_encoder=True, text_encoder_stop_after_steps=2, lr_scheduler="linear",
                   learning_rate=1e-2, optimizer={"name": "adamw", "weight_decay": 0.1})
    a = tiny_model()
    opt, sched = build(cfg, a)
    train(a, opt, sched, 6, components=ComponentSchedule(opt, cfg, 10))

    b = tiny_model()
    opt, sched = build(cfg, b)
    train(b, opt, sched, 3, components=ComponentSchedule(opt, cfg, 10))
    saved = ({k: v.clone() for k, v in b.state_dict().items()}, opt.state_dict(), sched.state_dict())
    c = tiny_model()  # a fresh process: everything trainable again
    c.load_state_dict(saved[0])
    opt, sched = build(cfg, c)
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    comps = ComponentSchedule(opt, cfg, 10)
    assert comps.apply(3) == ["text_encoder"]
    train(c, opt, sched, 3, start=3, components=comps)
    for (k, x), y in zip(a.state_dict().items(), c.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=0, atol=0, msg=k)


def test_a_window_on_an_untrained_component_warns():
    cfg = make_cfg(train_text_encoder=False, text_encoder_stop_after_epochs=1)
    assert any(i.key == "parts.text_encoder_1.stop_after_epochs" for i in cross_field_warnings(cfg))


# --- fused backward pass -----------------------------------------------------------------------

FUSED_CASES = {
    "adamw": {"weight_decay": 0.1},
    "sgd": {"momentum": 0.9},
    "adafactor": {"relative_step": False, "scale_parameter": False, "warmup_init": False},
    "lion": {},
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_backward_equals_the_ordinary_optimizer(name):
    common = dict(train_text_encoder=True, text_encoder_learning_rate=3e-3, learning_rate=1e-2,
                  lr_scheduler="cosine", lr_warmup_steps=2, max_grad_norm=0.0,
                  optimizer={"name": name, **FUSED_CASES[name]})
    a, b = tiny_model(), tiny_model()
    opt_a, sched_a = build(make_cfg(**common), a)
    opt_b, sched_b = build(make_cfg(fused_backward=True, **common), b)
    assert getattr(opt_b, "fused_backward", False)
    for i in range(6):
        loss_of(a, i).backward()
        opt_a.step()
        sched_a.step()
        opt_a.zero_grad(set_to_none=True)
        scheduled = [g["lr"] for g in opt_b.param_groups]
        loss_of(b, i).backward()
        assert all(p.grad is None for p in b.parameters())  # stepped and freed during backward
        # the scheduler's LR of each group reached every per-weight optimizer
        assert all(inner.param_groups[0]["lr"] == scheduled[gi] for gi, _, inner in opt_b.per_param)
        opt_b.step()
        sched_b.step()
        opt_b.zero_grad(set_to_none=True)
        assert [g["lr"] for g in opt_b.param_groups] == pytest.approx([g["lr"] for g in opt_a.param_groups])
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=k)


def test_fused_backward_state_round_trips_for_exact_resume():
    cfg = make_cfg(fused_backward=True, max_grad_norm=0.0, lr_scheduler="linear", learning_rate=1e-2,
                   train_text_encoder=True, text_encoder_stop_after_steps=2)
    a = tiny_model()
    opt, sched = build(cfg, a)
    train(a, opt, sched, 5, components=ComponentSchedule(opt, cfg, 10))

    b = tiny_model()
    opt, sched = build(cfg, b)
    train(b, opt, sched, 3, components=ComponentSchedule(opt, cfg, 10))
    saved = ({k: v.clone() for k, v in b.state_dict().items()}, opt.state_dict(), sched.state_dict())
    opt.remove_hooks()
    c = tiny_model()
    c.load_state_dict(saved[0])
    opt, sched = build(cfg, c)
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    comps = ComponentSchedule(opt, cfg, 10)
    comps.apply(3)
    train(c, opt, sched, 2, start=3, components=comps)
    for (k, x), y in zip(a.state_dict().items(), c.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=0, atol=0, msg=k)
    plain = build_optimizer(param_groups(FakeMethod(tiny_model()), make_cfg()), make_cfg())
    with pytest.raises(ValueError, match="fused_backward"):
        opt.load_state_dict(plain.state_dict())


@pytest.mark.parametrize("setting,key", [
    ({"gradient_accumulation_steps": 2, "max_grad_norm": 0.0}, "training.fused_backward"),
    ({"max_grad_norm": 1.0}, "training.max_grad_norm"),
    ({"max_grad_norm": 0.0, "optimizer": {"name": "prodigy"}}, "training.fused_backward"),
    ({"max_grad_norm": 0.0, "optimizer": {"name": "schedulefree_adamw"}}, "training.fused_backward"),
    ({"max_grad_norm": 0.0, "mixed_precision": "fp16"}, "training.fused_backward"),
])
def test_fused_backward_refuses_what_it_cannot_do(setting, key):
    cfg = make_cfg(fused_backward=True, **setting)
    with pytest.raises(ConfigError) as err:
        validate_optim(cfg)
    assert err.value.key == key and "fused_backward" in str(err.value)


def _peak_grad_bytes(fused: bool) -> int:
    """Largest number of gradient bytes alive at once during one backward + step."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"unet": torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])})
    cfg = make_cfg(fused_backward=fused, max_grad_norm=0.0)
    params = list(model.parameters())
    peak = [0]

    def count(_p):
        peak[0] = max(peak[0], sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))
    handles = [p.register_post_accumulate_grad_hook(count) for p in params]  # before the fused step's hook
    opt = build_optimizer(param_groups(FakeMethod(model), cfg), cfg)
    model["unet"](torch.randn(4, 256)).square().mean().backward()
    count(None)
    opt.step()
    for h in handles:
        h.remove()
    return peak[0]


def test_fused_backward_keeps_one_gradient_alive_at_a_time():
    plain, fused = _peak_grad_bytes(False), _peak_grad_bytes(True)
    assert plain == 8 * (256 * 256 + 256) * 4
    assert 0 < fused <= (256 * 256 + 256) * 4 < plain / 4


# --- end to end on the tiny model --------------------------------------------------------------

def test_run_with_a_text_encoder_window_fused_and_scaled_resumes_exactly(tiny_workspace):
    from safetensors.torch import load_file

    from trainer.__main__ import main as cli
    from trainer.events import read_events
    ws = tiny_workspace
    common = ["training.epochs=2", "sampling.prompts=[]", "backup.every_n_steps=1", "backup.keep_last=10",
              "training.train_text_encoder=true", "training.text_encoder_stop_after_steps=3",
              "training.fused_backward=true", "training.max_grad_norm=0", "training.scale_lr=linear",
              "training.batch_size=2", "training.learning_rate=1e-3", "training.lr_scheduler=cosine",
              "output.dtype=fp32", "general.tensorboard=false"]
    opts = lambda run: ["--set", f"general.workspace={ws}", "--set", f"general.run_name={run}", "--no-progress",
                        *[x for e in common for x in ("--set", e)]]
    assert cli(["train", "--preset", "demo", *opts("window")]) == 0
    run = ws / "runs" / "window"
    steps = [e for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert len(steps) == 8
    assert steps[0]["lr"]["text_encoder"] > 0 and steps[1]["lr"]["text_encoder"] > 0
    assert all(s["lr"]["text_encoder"] == 0 for s in steps[2:])
    # scale_lr = linear: 2 x 1e-3, on the cosine curve (the event shows the LR after the first step)
    assert steps[0]["lr"]["unet"] == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi / 8)))
    assert steps[-2]["lr"]["unet"] > 0
    te = lambda f: {k: v for k, v in load_file(str(f)).items() if k.startswith("text_encoder.")}
    at3, at8 = te(run / "backups" / "backup-step000003" / "trainable.safetensors"), \
        te(run / "backups" / "backup-step000008" / "trainable.safetensors")
    assert at3 and all(torch.equal(at3[k], at8[k]) for k in at3)
    at2 = te(run / "backups" / "backup-step000002" / "trainable.safetensors")
    assert any(not torch.equal(at2[k], at3[k]) for k in at3)

    # resume a copy from step 5 (the text encoder already frozen): the same result
    copy = ws / "runs" / "window-resumed"
    copy.mkdir()
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    (copy / "backups").mkdir()
    shutil.copytree(run / "backups" / "backup-step000005", copy / "backups" / "backup-step000005")
    assert cli(["train", str(copy / "config.yaml"), "--run-dir", str(copy), "--resume", "last",
                "--no-progress"]) == 0
    a, b = load_file(str(run / "window.safetensors")), load_file(str(copy / "window-resumed.safetensors"))
    assert set(a) == set(b) and any("lora_te" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


def test_prodigy_step_events_log_the_effective_learning_rate(tiny_workspace):
    """Prodigy's group lr stays 1; the events and TensorBoard show d * lr, the step size it uses."""
    from trainer.__main__ import main as cli
    from trainer.events import read_events
    ws = tiny_workspace
    args = ["train", "--preset", "demo", "--no-progress"]
    for s in (f"general.workspace={ws}", "general.run_name=prodigy-lr", "training.max_steps=3",
              "training.optimizer.name=prodigy", "training.learning_rate=1", "sampling.prompts=[]",
              "training.optimizer.d0=1e-6"):
        args += ["--set", s]
    assert cli(args) == 0
    steps = [e for e in read_events(ws / "runs" / "prodigy-lr" / "events.jsonl") if e["type"] == "step"]
    assert steps and all(0 < e["lr"]["unet"] < 1e-3 for e in steps), [e["lr"] for e in steps]
