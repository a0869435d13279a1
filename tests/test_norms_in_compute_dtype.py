"""training.norms_in_compute_dtype: the denoiser's RMSNorms (torch's and diffusers') computed as one F.rms_norm outside
autocast when their weights have the input's dtype: the norms' own values, in the input's dtype, and runs that train
as before."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from torch.overrides import TorchFunctionMode

from conftest import train_quiet
from trainer.events import read_events
from trainer.train.norms import norms_in_compute_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

NORMS = {"torch": lambda: torch.nn.RMSNorm(64, eps=1e-6), "diffusers": lambda: DiffusersRMSNorm(64, eps=1e-6)}


def _pair(kind: str, dtype):
    torch.manual_seed(0)
    norm = NORMS[kind]().to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    swapped = copy.deepcopy(norm)
    assert norms_in_compute_dtype(swapped) == 1
    return norm, swapped


class _AutocastAtRmsNorm(TorchFunctionMode):
    """Whether CPU autocast was on at each F.rms_norm call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.rms_norm:
            self.seen.append(torch.is_autocast_enabled("cpu"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_swapped_norm_gives_the_norms_values_and_gradients_in_the_inputs_dtype(kind, dtype):
    norm, swapped = _pair(kind, dtype)
    norm.weight.requires_grad_(True)
    swapped.weight.requires_grad_(True)
    x = torch.randn(2, 12, 3, 64, dtype=dtype) * 3
    outs, grads = [], []
    for m in (norm, swapped):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y.float() * torch.linspace(-1, 1, 64)).square().sum().backward()
        outs.append(y)
        grads.append((xi.grad, m.weight.grad))
    assert outs[1].dtype == outs[0].dtype == dtype
    # fp32: the same formula; bf16: diffusers rounds twice (x·r, then ·w), the fused norm once
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
    gtol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a.float(), b.float(), **gtol)
    assert swapped.state_dict().keys() == norm.state_dict().keys()


@pytest.mark.parametrize("kind", list(NORMS))
def test_under_autocast_a_norm_in_the_compute_dtype_runs_outside_it(kind):
    """CUDA's autocast runs rms_norm in fp32 (an fp32 output, the input cast up and kept for backward); the swapped
    norm calls it with autocast off. CPU's autocast leaves rms_norm alone, so what is checked is where it is called."""
    norm, swapped = _pair(kind, torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    seen = {}
    for name, m in (("before", norm), ("after", swapped)):
        with torch.autocast("cpu", dtype=torch.bfloat16), _AutocastAtRmsNorm() as mode:
            assert m(x).dtype == torch.bfloat16
        seen[name] = mode.seen
    assert seen["after"] == [False]
    assert seen["before"] == ([True] if kind == "torch" else [])  # diffusers' norm: separate ops, no rms_norm


def test_norms_in_another_dtype_with_a_bias_or_of_a_subclass_keep_their_forward():
    class OwnNorm(torch.nn.RMSNorm):  # a family's norm with its own formula (Qwen-Image 2.1's zero-centred one)
        def forward(self, x):
            return super().forward(x) * 2

    model = torch.nn.ModuleDict({"fp32": DiffusersRMSNorm(64, eps=1e-6), "torch_fp32": torch.nn.RMSNorm(64),
                                 "bias": DiffusersRMSNorm(64, eps=1e-6, bias=True).to(torch.bfloat16),
                                 "own": OwnNorm(64).to(torch.bfloat16)})
    before = copy.deepcopy(model)
    assert norms_in_compute_dtype(model) == 3  # OwnNorm is not one of the two classes
    assert type(model["own"]) is OwnNorm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for key in model:
            with _AutocastAtRmsNorm() as mode:
                got = model[key](x)
            want = before[key](x)
            assert got.dtype == want.dtype and torch.equal(got, want), key
            assert not any(s is False for s in mode.seen), key  # the model's own forward, autocast untouched


@pytest.mark.slow  # two short runs of a tiny family each
@pytest.mark.parametrize("preset, count, exact", [
    ("demo-flux", 6, True),  # torch's nn.RMSNorm: CPU's autocast leaves it in bf16 either way, the same computation
    ("demo-qwen-image", 9, False)])  # diffusers' RMSNorm: fused, one rounding less
def test_a_bf16_run_swaps_its_norms_and_trains_as_without(tiny_workspace, preset, count, exact):
    sets = ("training.mixed_precision=bf16", "parts.denoiser.dtype=bf16", "training.max_steps=3", "sampling.prompts=[]")
    on = train_quiet(tiny_workspace, f"{preset}-norms-on", preset, *sets)
    off = train_quiet(tiny_workspace, f"{preset}-norms-off", preset, *sets, "training.norms_in_compute_dtype=false")
    assert f"training.norms_in_compute_dtype: {count} RMSNorms" in (on / "train.log").read_text()
    assert "norms_in_compute_dtype:" not in (off / "train.log").read_text()
    losses = [[e["loss"] for e in read_events(r / "events.jsonl") if e["type"] == "step"] for r in (on, off)]
    assert len(losses[0]) == 3
    if exact:
        assert losses[0] == losses[1]
    else:
        assert losses[0] != losses[1]  # the diffusers norms did change: one rounding fewer in bf16
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-3, atol=1e-4)


def _saved_bytes(fn, *args) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*args)
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in saved}.values() if t.numel() > 64)


def test_the_vram_estimate_keeps_for_backward_what_cudas_fused_norm_keeps():
    """The estimate runs on the CPU, whose rms_norm keeps an fp32 copy of a bf16 input for backward; CUDA's fused
    kernel keeps the input and a per-row fp32 statistic. The estimate's stand-in gives F.rms_norm's values and
    gradients and keeps what CUDA keeps."""
    from trainer.memory.estimate_session import rms_norm_as_cuda
    torch.manual_seed(0)
    x = (torch.randn(2, 40, 3, 64) * 2).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(64, dtype=torch.bfloat16).requires_grad_(True)
    grad = torch.randn(2, 40, 3, 64).to(torch.bfloat16)
    for args in ((x, (64,), w, 1e-6), (x.float(), (64,), w.float(), 1e-6), (x, (64,), None, None)):
        want, got = F.rms_norm(*args), rms_norm_as_cuda(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        inputs = [a for a in (args[0], args[2]) if a is not None]
        for a, b in zip(torch.autograd.grad(got, inputs, grad.to(got.dtype)),
                        torch.autograd.grad(want, inputs, grad.to(want.dtype))):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    cuda_keeps = x.numel() * 2 + 2 * 40 * 3 * 4  # the bf16 input, the fp32 statistic per row
    assert _saved_bytes(rms_norm_as_cuda, x, (64,), w, 1e-6) == cuda_keeps
    assert _saved_bytes(F.rms_norm, x, (64,), w, 1e-6) >= x.numel() * 4  # the CPU's composite: an fp32 copy


def test_diffusers_norms_fused_take_fewer_ops_in_a_block_as_cuda_would_launch_them():
    """bench/norm_counts.py: a Qwen-Image block's forward and backward under CUDA's autocast policy, each fused norm
    call counted as its two kernels; diffusers' op-by-op norms before."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import norm_counts
    make, inputs = norm_counts._blocks()["qwen-image"]
    before, now = norm_counts.count(make, inputs, False), norm_counts.count(make, inputs, True)
    assert before["fused_norm_calls"] == 0 and now["fused_norm_calls"] == 4  # q/k of the image and text streams
    assert now["ops"] <= before["ops"] - 4 * 4  # each norm ~8 ops forward and more backward before, 2 now
