"""training.optimizer.name = prodigy: prodigyopt's Prodigy with its step taken by foreach ops and one read of the
device a step (trainer/optim/prodigy.py). It must be prodigyopt's optimizer: the same weights, step-size estimate
and state, step after step, for every setting; only the order in which the estimate's sums are added differs
(float32's rounding)."""

from __future__ import annotations

import copy

import pytest
import torch
from prodigyopt import Prodigy as Reference

from tests.optim_twins import step_both
from trainer.optim.prodigy import Prodigy

SETTINGS = [
    {},
    {"betas": (0.8, 0.99), "beta3": 0.5, "d_coef": 2.0, "d0": 1e-5, "growth_rate": 1.05, "use_bias_correction": True,
     "safeguard_warmup": True},
    {"weight_decay": 0.1, "decouple": False, "slice_p": 3},
    {"weight_decay": 0.05, "decouple": True, "betas": (0.0, 0.999)},  # beta1 = 0: no first moment
]


def weights(seed: int = 0):
    """A LoRA's kinds of weights: A (random), B (zeros at the start: prodigyopt keeps a zero scalar as its p0),
    a second component whose learning rate is 0 (a stopped text encoder), and one weight without a gradient."""
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(8, 16, generator=g) * 0.1)
    b = torch.nn.Parameter(torch.zeros(16, 8))
    c = torch.nn.Parameter(torch.randn(32, generator=g))
    idle = torch.nn.Parameter(torch.randn(4, generator=g))
    stopped = torch.nn.Parameter(torch.randn(6, 6, generator=g))
    return [a, b, c, idle], [stopped]


def gradients(step: int, params):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = None if p.shape == (4,) else torch.randn(p.shape, generator=g) * (0.5 + step * 0.1)


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "warmup-bias-growth", "coupled-decay-slice",
                                                     "no-beta1-decoupled"])
def test_prodigy_takes_prodigyopts_steps(settings):
    trained, stopped = weights()
    ours_params, ours_stopped = copy.deepcopy(trained), copy.deepcopy(stopped)
    groups = lambda ps, st: [{"params": ps, "lr": 1.0}, {"params": st, "lr": 0.0}]  # noqa: E731
    reference = Reference(groups(trained, stopped), **settings)
    ours = Prodigy(groups(ours_params, ours_stopped), **settings)
    for step in range(12):
        step_both(step, gradients, reference, ours, trained + stopped, ours_params + ours_stopped)
        theirs, mine = reference.param_groups[0], ours.param_groups[0]
        for key in ("d", "d_max", "k"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12, abs=0), key
        # the estimate d_hat = d_coef * numerator / denominator, whose numerator may cancel to near 0: float64's
        # rounding of the numerator's terms, added in another order, within 1e-12 of d
        assert mine.get("d_hat", 0.0) == pytest.approx(theirs.get("d_hat", 0.0), abs=1e-12 * theirs["d"])
        for p, q in zip(trained + stopped, ours_params + ours_stopped):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert reference.param_groups[0]["d_numerator"] != 0 and reference.param_groups[0]["d_hat"] != 1e-6  # estimated
    assert not torch.equal(trained[1], torch.zeros(16, 8))  # B moved
    # the same state, key for key: a backup of one resumes in the other
    theirs, mine = reference.state_dict(), ours.state_dict()
    for a, b in zip(theirs["param_groups"], mine["param_groups"]):
        assert set(a) == set(b)
        for key, value in a.items():
            assert b[key] == (pytest.approx(value, rel=1e-12, abs=1e-12 * a["d"]) if isinstance(value, float)
                              else value), key
    for i, state in theirs["state"].items():
        assert set(state) == set(mine["state"][i])
        for key, value in state.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(mine["state"][i][key], value, rtol=0, atol=0)
            else:
                assert mine["state"][i][key] == value
    resumed = Prodigy(groups(copy.deepcopy(trained), copy.deepcopy(stopped)), **settings)
    resumed.load_state_dict(theirs)
    assert resumed.param_groups[0]["d"] == reference.param_groups[0]["d"]


@pytest.mark.parametrize("cls, reads", [(Reference, 2 * 3), (Prodigy, 1)])
def test_a_step_reads_the_device_once_not_twice_per_weight(cls, reads, monkeypatch):
    """prodigyopt reads two numbers per weight with a gradient (``.item()``; 3 weights here), each a device sync
    on a GPU; this one reads the step's two sums together, once."""
    trained, stopped = weights()
    opt = cls([{"params": trained, "lr": 1.0}, {"params": stopped, "lr": 0.0}])
    gradients(0, trained + stopped)
    opt.step()  # the first step makes the state (prodigyopt reads whether each weight is all zeros)
    gradients(1, trained + stopped)
    counted = []
    for name in ("item", "tolist", "__float__", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name, **k: (
            counted.append(_name), _real(t, *a, **k))[1])
    opt.step()
    monkeypatch.undo()
    assert len(counted) == reads, counted
