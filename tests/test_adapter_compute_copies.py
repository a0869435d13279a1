"""bf16 compute copies of LoRA weights (training.adapter_compute_copies): the same losses, the same saved LoRA and
an exact resume as autocast's casts of the fp32 weights."""

from __future__ import annotations

import contextlib
import copy
import shutil

import pytest
import safetensors.torch
import torch

from conftest import train_quiet
from trainer.__main__ import main as cli
from trainer.events import read_events
from trainer.methods.compute_copies import ComputeCopies, plain_lora_weights

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# gradient accumulation 2: the second micro-batch's gradients are added into the first's; the text encoder
# trains too, so its LoRA takes the copies as well; dropout: the adapters' own dropout runs on the copies' inputs
COMMON = ("training.mixed_precision=bf16", "training.max_steps=2", "training.gradient_accumulation_steps=2",
          "parts.text_encoder_1.train=true", "sampling.prompts=[]", "lora.dropout=0.1")


def _losses(run) -> list:
    return [e["loss"] for e in read_events(run / "events.jsonl") if e["type"] == "step"]


def _result(run):
    return safetensors.torch.load_file(str(run / f"{run.name}.safetensors"))


def test_copies_give_the_losses_and_the_lora_of_autocasts_casts(tiny_workspace):
    old = train_quiet(tiny_workspace, "casts", "demo", *COMMON, "training.adapter_compute_copies=false")
    new = train_quiet(tiny_workspace, "copies", "demo", *COMMON, "training.adapter_compute_copies=true",
                      "backup.every_n_steps=1")
    assert "LoRA weights computed from bf16 copies" in (new / "train.log").read_text()
    assert "bf16 copies" not in (old / "train.log").read_text()
    assert _losses(new) == _losses(old) and len(_losses(new)) == 2
    a, b = _result(old), _result(new)
    assert set(a) == set(b) and any(k.startswith("lora_te") for k in a), sorted(a)[:3]
    for k in a:
        assert b[k].dtype == torch.float32  # the fp32 masters are saved
        assert torch.equal(a[k], b[k]), k
    # resumed from the backup of step 1, the run ends on the same weights
    resumed = tiny_workspace / "runs" / "resumed"
    shutil.copytree(new, resumed)
    assert cli(["train", str(resumed / "config.yaml"), "--run-dir", str(resumed), "--resume",
                str(resumed / "backups" / "backup-step000001"), "--no-progress"]) == 0
    assert _losses(resumed)[-1:] == _losses(new)[-1:]
    c = safetensors.torch.load_file(str(resumed / "resumed.safetensors"))
    for k in a:
        assert torch.equal(b[k], c[k]), k


def test_only_plain_lora_weights_take_copies_and_gradients_add_in_fp32():
    from peft import LoraConfig, inject_adapter_in_model
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"], init_lora_weights=False), net)
    dora = torch.nn.Sequential(torch.nn.Linear(16, 16))
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"], use_dora=True), dora)
    weights = plain_lora_weights([net, dora])
    assert [n for _, n, _ in weights] == ["weight", "weight"] and all(p.dtype == torch.float32 for *_, p in weights)
    twin = copy.deepcopy(net)  # the same LoRA, its fp32 weights cast by autocast
    copies = ComputeCopies(weights)
    copies.refresh()
    xs = [torch.randn(3, 16) for _ in range(2)]
    for x in xs:  # two micro-batches through the copies, and through autocast's casts
        with copies.computing(), torch.autocast("cpu", torch.bfloat16):
            assert net[0].lora_A["default"].weight.dtype == torch.bfloat16
            net(x).float().square().mean().backward()
        copies.add_grads()
        with torch.autocast("cpu", torch.bfloat16):
            twin(x).float().square().mean().backward()
    assert net[0].lora_A["default"].weight is weights[0][2]  # the masters are back between micro-batches
    ref = [twin[0].lora_A["default"].weight, twin[0].lora_B["default"].weight]
    for (*_, p), r in zip(weights, ref):
        assert p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
        assert torch.equal(p.grad, r.grad)


def _fp16_steps(use_copies: bool) -> tuple:
    """Six optimizer steps of a small LoRA under fp16 autocast with a grad scaler, as the training loop runs them
    (accumulation 2: scaled backward per micro-batch, the copies' gradients added, unscale, clip, the scaler's
    step, the copies refreshed); the first steps overflow (a large initial scale) and are skipped."""
    from peft import LoraConfig, inject_adapter_in_model
    from trainer.train.step import scaler_step
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    for p in net.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False), net)
    weights = plain_lora_weights([net])
    opt = torch.optim.AdamW([p for *_, p in weights], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, backoff_factor=1 / 64)
    copies = ComputeCopies(weights, torch.float16) if use_copies else None
    if copies is not None:
        copies.refresh()
    gen = torch.Generator().manual_seed(1)
    skipped = []
    for _ in range(6):
        for _ in range(2):
            x = torch.randn(4, 16, generator=gen)
            with copies.computing() if copies is not None else contextlib.nullcontext(), \
                    torch.autocast("cpu", torch.float16):
                loss = (net(x).float() - 1).square().mean()
                if copies is not None:
                    assert net[0].lora_A["default"].weight.dtype == torch.float16
                scaler.scale(loss / 2).backward()
            if copies is not None:
                copies.add_grads()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for *_, p in weights], 1.0)
        skipped.append(scaler_step(scaler, opt))
        if copies is not None:
            copies.refresh()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for *_, p in weights], skipped, scaler.get_scale()


def test_fp16_copies_step_as_autocasts_casts_with_the_grad_scaler():
    casts, skipped, scale = _fp16_steps(False)
    copies, skipped_copies, scale_copies = _fp16_steps(True)
    assert skipped == skipped_copies and skipped[0] and not all(skipped), skipped  # overflows skipped alike
    assert scale == scale_copies
    for a, b in zip(casts, copies):
        assert b.dtype == torch.float32 and torch.equal(a, b)


def test_copies_take_the_autocast_dtype_where_autocast_runs():
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from peft import LoraConfig, inject_adapter_in_model
    from trainer.methods.compute_copies import make_compute_copies
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), net)
    method = SimpleNamespace(name="lora", modules={"unet": net})

    def made(precision, device, world=1, **more):
        cfg = OmegaConf.create({"training": {"mixed_precision": precision, "compile": False, "fused_backward": False,
                                             **more}})
        copies = make_compute_copies(method, cfg, world, torch.device(device))
        return None if copies is None else copies.copies[0].dtype

    assert made("bf16", "cpu") == torch.bfloat16
    assert made("fp16", "cuda") == torch.float16
    assert made("fp16", "cpu") is None  # no fp16 autocast on the CPU: the layers compute in fp32 there
    assert made("no", "cuda") is None and made("bf16", "cuda", world=2) is None
    assert made("bf16", "cuda", adapter_compute_copies=False) is None
