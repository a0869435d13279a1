"""training.optimizer.name = adafactor: transformers' Adafactor with its step size kept on the device
(trainer/optim/adafactor.py). It must be transformers' optimizer: the same weights and state, step after step, for
every mode; only a step with both weight decay and scale_parameter multiplies instead of reading (float rounding)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.optimization import Adafactor as Reference

from tests.optim_twins import step_both
from trainer.optim.adafactor import Adafactor

# (settings, exact): transformers' defaults are the adaptive mode (relative_step, scale_parameter, no LR)
SETTINGS = [
    ({"lr": None}, True),
    ({"lr": None, "warmup_init": True, "clip_threshold": 0.5, "decay_rate": -0.6, "beta1": 0.9}, True),
    ({"lr": 1e-2, "relative_step": False, "scale_parameter": False, "warmup_init": False}, True),  # the presets'
    ({"lr": 1e-2, "relative_step": False, "scale_parameter": False, "beta1": 0.9, "weight_decay": 0.01,
      "eps": (1e-30, 2e-3)}, True),
    ({"lr": 1e-2, "relative_step": False, "scale_parameter": True, "weight_decay": 0.1}, False),
    ({"lr": None, "weight_decay": 0.05}, False),
]
IDS = ["adaptive", "adaptive-warmup-beta1", "fixed-lr", "fixed-lr-beta1-decay", "fixed-lr-scaled-decay",
       "adaptive-decay"]


def weights(seed: int = 0):
    """A LoRA's kinds of weights: A (random), B (zeros at the start: its RMS is below eps2), a vector (Adafactor does
    not factor it), a bf16 weight (updated through a float32 copy), one weight without a gradient, and a second
    component whose learning rate is 0 in the fixed-LR modes (a stopped text encoder)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(8, 16, generator=g) * 0.1)
    b = torch.nn.Parameter(torch.zeros(16, 8))
    c = torch.nn.Parameter(torch.randn(32, generator=g))
    half = torch.nn.Parameter((torch.randn(12, 6, generator=g) * 0.2).bfloat16())
    idle = torch.nn.Parameter(torch.randn(4, generator=g))
    stopped = torch.nn.Parameter(torch.randn(6, 6, generator=g))
    return [a, b, c, half, idle], [stopped]


def gradients(step: int, params):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        skipped = p.shape == (4,) or (p.shape == (32,) and step == 3)  # the vector misses a step: its count lags
        p.grad = None if skipped else (torch.randn(p.shape, generator=g) * (0.5 + step * 0.1)).to(p.dtype)


def groups(trained, stopped, settings):
    second = {"params": stopped} if settings["lr"] is None else {"params": stopped, "lr": 0.0}
    return [{"params": trained}, second]


@pytest.mark.parametrize("settings, exact", SETTINGS, ids=IDS)
def test_adafactor_takes_transformers_steps(settings, exact):
    trained, stopped = weights()
    ours_params, ours_stopped = copy.deepcopy(trained), copy.deepcopy(stopped)
    reference = Reference(groups(trained, stopped, settings), **settings)
    ours = Adafactor(groups(ours_params, ours_stopped, settings), **settings)
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 2e-6, "atol": 1e-7}
    start = [p.detach().clone() for p in trained]
    for step in range(12):
        step_both(step, gradients, reference, ours, trained + stopped, ours_params + ours_stopped)
        for p, q in zip(trained + stopped, ours_params + ours_stopped):
            assert q.dtype == p.dtype
            torch.testing.assert_close(q, p, **tolerance)
    # every float32 weight with a gradient moved (warmup_init's steps are below the bf16 weight's resolution)
    assert all(not torch.equal(p, s) for p, s in zip(trained[:3], start[:3]))
    assert torch.equal(trained[4], start[4])
    # the same state, key for key (RMS only where the step uses it): a backup of one resumes in the other
    theirs, mine = reference.state_dict(), ours.state_dict()
    for i, state in theirs["state"].items():
        keys = set(state) - ({"RMS"} if not settings.get("scale_parameter", True) else set())
        assert keys <= set(mine["state"][i])
        for key in keys:
            if torch.is_tensor(state[key]):
                torch.testing.assert_close(mine["state"][i][key], state[key], **tolerance)
            else:
                assert mine["state"][i][key] == state[key]
    resumed = Adafactor(groups(copy.deepcopy(trained), copy.deepcopy(stopped), settings), **settings)
    resumed.load_state_dict(copy.deepcopy(theirs))  # its tensors are the reference's own, which its step changes
    gradients(12, trained + stopped)
    for p, q in zip(trained + stopped, resumed.param_groups[0]["params"] + resumed.param_groups[1]["params"]):
        q.grad = None if p.grad is None else p.grad.clone()
    reference.step()
    resumed.step()
    for p, q in zip(trained, resumed.param_groups[0]["params"]):
        torch.testing.assert_close(q, p, **tolerance)


class _Reads(TorchDispatchMode):
    """Counts the step's reads of a tensor's value on the host (every .item(), bool(t), float(t) ends in
    aten::_local_scalar_dense): on a GPU each one waits for the queue to drain."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cls, reads", [(Reference, 5), (Adafactor, 0)])
def test_the_adaptive_step_reads_nothing_from_the_device(cls, reads):
    """transformers' adaptive mode compares each weight's RMS with eps2 in Python (4 weights with a gradient here,
    and the stopped one); this one picks the larger on the device."""
    trained, stopped = weights()
    opt = cls(groups(trained, stopped, {"lr": None}), lr=None)
    gradients(0, trained + stopped)
    opt.step()
    gradients(1, trained + stopped)
    with _Reads() as counted:
        opt.step()
    assert counted.reads == reads


def test_the_trainer_builds_this_adafactor():
    from trainer.config.checks import load_config
    from trainer.optim.build import build_optimizer
    cfg = load_config(preset="demo", overrides=["training.optimizer.name=adafactor", "training.lr_scheduler=adafactor",
                                                 "training.learning_rate=1e-4"])
    opt = build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(3, 3))], "lr": 1e-4}], cfg)
    assert type(opt) is Adafactor and opt.defaults["relative_step"] and opt.defaults["lr"] is None
