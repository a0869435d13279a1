"""fp16 mixed precision on a GPU: accelerate's backward multiplies the loss by a GradScaler's scale, and the
trainer (whose optimizer is its own, not accelerator.prepare'd) must unscale before clipping and stepping,
skip a step whose gradients overflowed, and keep the scale in backups. CPU runs have no scaler, so a CPU
GradScaler is put where accelerate keeps its own."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_quiet

SGD = ["training.optimizer.name=sgd", "training.optimizer.momentum=0", "training.learning_rate=0.05",
       "training.max_steps=3", "training.max_grad_norm=1.0", "sampling.prompts=[]", "general.dataloader_workers=0"]


@pytest.fixture
def scaled(monkeypatch):
    """Give every Accelerator a CPU GradScaler with the given initial scale."""
    import accelerate
    holder = {}

    def use(init_scale: float):
        original = accelerate.Accelerator.__init__

        def init(self, *a, **k):
            original(self, *a, **k)
            self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
            holder["scaler"] = self.scaler
        monkeypatch.setattr(accelerate.Accelerator, "__init__", init)
        return holder
    return use


def test_scaled_gradients_are_unscaled_before_clipping_and_the_step(tiny_workspace, scaled, one_thread):
    plain = load_file(str(train_quiet(tiny_workspace, "scaler-plain", "demo", *SGD) / "scaler-plain.safetensors"))
    holder = scaled(2.0 ** 14)
    run = train_quiet(tiny_workspace, "scaler-fp16", "demo", *SGD)
    got = load_file(str(run / "scaler-fp16.safetensors"))
    assert holder["scaler"].get_scale() == 2.0 ** 17  # three good steps, growth every step: the scaler was used
    changed = [k for k in plain if not torch.equal(plain[k], torch.zeros_like(plain[k]))]
    assert changed  # training moved the weights
    for k in plain:
        torch.testing.assert_close(got[k], plain[k], rtol=0, atol=1e-6)


def test_a_step_whose_gradients_overflow_is_skipped(tiny_workspace, scaled, one_thread):
    untrained = load_file(str(train_quiet(tiny_workspace, "scaler-none", "demo", *SGD,
                                          "training.learning_rate=0") / "scaler-none.safetensors"))
    scaled(float("inf"))  # every gradient overflows
    run = train_quiet(tiny_workspace, "scaler-inf", "demo", *SGD[:-3], "training.max_steps=1",
                      "sampling.prompts=[]", "general.dataloader_workers=0")
    got = load_file(str(run / "scaler-inf.safetensors"))
    for k in untrained:  # the overflowing step changed nothing
        torch.testing.assert_close(got[k], untrained[k], rtol=0, atol=0)


def _step_lrs(run) -> list:
    import json
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [list(e["lr"].values())[0] for e in events if e["type"] == "step"]


def test_skipped_steps_do_not_advance_the_learning_rate_schedule(tiny_workspace, scaled, one_thread):
    import warnings
    plain = train_quiet(tiny_workspace, "sched-plain", "demo", *SGD, "training.lr_scheduler=linear")
    assert _step_lrs(plain)[0] < 0.05  # without overflows the linear schedule moves after every step
    scaled(float("inf"))  # every step overflows: the schedule must stay where it starts
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step.*")
        run = train_quiet(tiny_workspace, "scaler-sched", "demo", *SGD, "training.lr_scheduler=linear")
    assert _step_lrs(run) == [0.05, 0.05, 0.05]
