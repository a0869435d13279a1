"""parts.denoiser.fp8_matmul: an fp8-stored frozen Linear multiplies its input, rounded to fp8 with one scale for
the tensor, by its stored fp8 weight (``torch._scaled_mm``, fp32 sums), and backward gives the input the gradient
fp8 storage gives it; a GPU without fp8 tensor cores, or the switch without fp8 storage, is refused by name; a run
with it trains the LoRA the fp8-stored run trains, within fp8's rounding of the inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_quiet

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(dtype, scale_kind):
    from trainer.memory.precision import store_fp8
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 32).to(dtype)
    lin.requires_grad_(False)  # a frozen base layer
    w = lin.weight.data.float()
    scale = {"none": None, "tensor": w.abs().max() / 448, "row": w.abs().amax(dim=1) / 448}[scale_kind]
    factor = 1.0 if scale is None else scale if scale.numel() == 1 else scale[:, None]
    w8 = (w / factor).to(torch.float8_e4m3fn)
    upcast, fast = copy.deepcopy(lin), copy.deepcopy(lin)
    store_fp8(upcast, w8.clone(), scale, dtype)
    store_fp8(fast, w8.clone(), scale, dtype, matmul=True)
    return upcast, fast, w8, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_kind", ["none", "tensor", "row"])
def test_the_product_is_the_fp8_input_times_the_stored_weight_and_backward_is_fp8_storages(dtype, scale_kind):
    from trainer.memory.fp8_matmul import quantise_input
    upcast, fast, w8, scale = _layer(dtype, scale_kind)
    assert fast.fp8_products and not upcast.fp8_products
    x = (torch.randn(2, 7, 48) * torch.linspace(0.1, 3, 48)).to(dtype).requires_grad_(True)
    y = fast(x)
    q, x_scale = quantise_input(x.detach())
    assert q.dtype == torch.float8_e4m3fn and 416 <= float(q.float().abs().max()) <= 448  # the largest input: ~448
    w = w8.float() if scale is None else w8.float() * (scale if scale.numel() == 1 else scale[:, None])
    expected = (q.float() * x_scale) @ w.t() + fast.bias.float()
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y.float(), expected.reshape(2, 7, 32), rtol=tol, atol=tol)
    assert y.dtype == dtype
    y_up = upcast(x)
    rel = float((y.detach().float() - y_up.detach().float()).norm() / y_up.detach().float().norm())
    assert 1e-4 < rel < 0.06, rel  # the inputs' rounding to 3 mantissa bits, no more
    g = torch.randn_like(y)
    gx, = torch.autograd.grad(y, x, g)
    gx_up, = torch.autograd.grad(y_up, x, g)
    assert torch.equal(gx, gx_up)
    with torch.no_grad():
        assert torch.equal(fast(x), y.detach())  # sampling takes the same product


def test_a_trainable_bias_gets_its_gradient():
    upcast, fast, _, _ = _layer(torch.float32, "row")
    for layer in (upcast, fast):
        layer.bias.requires_grad_(True)
    x = torch.randn(5, 48)
    g = torch.randn(5, 32)
    fast(x).backward(g)
    upcast(x).backward(g)
    torch.testing.assert_close(fast.bias.grad, upcast.bias.grad)


def test_layers_the_kernel_cannot_take_keep_the_upcast():
    from trainer.memory.fp8_matmul import takes
    from trainer.memory.precision import store_fp8
    odd = torch.nn.Linear(40, 24)  # 40 and 24: not multiples of 16
    store_fp8(odd, odd.weight.data.to(torch.float8_e4m3fn), None, torch.float32, matmul=True)
    assert not odd.fp8_products and not takes(torch.nn.Conv2d(16, 16, 1)) and takes(torch.nn.Linear(32, 16))


def test_a_gpu_without_fp8_tensor_cores_is_named(monkeypatch):
    from trainer.memory import fp8_matmul
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 3090")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    why = fp8_matmul.why_not("cuda")
    assert "RTX 3090" in why and "8.6" in why and "fp8 tensor cores" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fp8_matmul.why_not("cuda") is None
    assert fp8_matmul.why_not("cpu") is None and "mps" in fp8_matmul.why_not("mps")


@pytest.mark.parametrize("switch", ["fp8_matmul", "fp8_scaled"])  # the products, and the row scales (fp8_layers)
def test_validate_asks_for_fp8_storage(tmp_path, switch):
    from trainer.config.checks import check_config
    cfg, issues = check_config(None, [f"general.workspace={tmp_path}", f"parts.denoiser.{switch}=true"],
                               preset="demo-flux")
    errors = [i for i in issues if i.level == "error"]
    assert cfg is None and [i.key for i in errors] == [f"parts.denoiser.{switch}"], issues
    assert "parts.denoiser.fp8 on" in errors[0].message
    cfg, issues = check_config(None, [f"general.workspace={tmp_path}", f"parts.denoiser.{switch}=true",
                                      "parts.denoiser.fp8=true"], preset="demo-flux")
    assert cfg is not None and not [i for i in issues if i.level == "error"]


def test_a_run_on_a_gpu_without_fp8_tensor_cores_stops_before_its_model_loads(tiny_workspace, monkeypatch, capfd):
    from trainer.__main__ import main as cli
    from trainer.memory import fp8_matmul
    from trainer.train import setup
    monkeypatch.setattr(fp8_matmul, "why_not", lambda device: "the NVIDIA GeForce RTX 3090 (compute capability 8.6) "
                                                             "has no fp8 tensor cores")
    loads = []
    real_load = setup.load_model
    monkeypatch.setattr(setup, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    args = ["train", "--preset", "demo-flux", "--no-progress"]
    for s in (f"general.workspace={tiny_workspace}", "general.run_name=fp8-refused", "parts.denoiser.fp8=true",
              "parts.denoiser.fp8_matmul=true", "training.max_steps=2"):
        args += ["--set", s]
    assert cli(args) != 0
    out = capfd.readouterr()
    said = out.out + out.err
    assert "parts.denoiser.fp8_matmul" in said and "RTX 3090" in said, said[-2000:]
    assert not loads  # said before the model loads


@pytest.mark.slow  # two runs of the tiny Flux.1
def test_a_run_multiplying_in_fp8_trains_the_lora_of_the_fp8_stored_run(tiny_workspace):
    common = ("training.max_steps=6", "parts.denoiser.fp8=true", "parts.denoiser.dtype=bf16",
              "training.mixed_precision=bf16", "sampling.at_end=false")
    stored = train_quiet(tiny_workspace, "fp8-stored", "demo-flux", *common)
    fast = train_quiet(tiny_workspace, "fp8-products", "demo-flux", *common, "parts.denoiser.fp8_matmul=true")
    assert "multiplying in fp8" in (fast / "train.log").read_text()
    a = load_file(str(next(stored.glob("*.safetensors"))))
    b = load_file(str(next(fast.glob("*.safetensors"))))
    assert a.keys() == b.keys()
    moved = {k: float((a[k] - b[k]).norm() / a[k].norm()) for k in a if a[k].norm() > 0}
    assert any(v > 0 for v in moved.values())  # the products did change
    assert max(moved.values()) < 0.1, moved  # by fp8's rounding of the inputs, not more


def test_no_input_rounds_past_fp8s_range():
    """The factor and the scaled values are rounded in bf16; the largest scaled magnitude must still land inside
    e4m3's range (a cast beyond it is NaN on CUDA; this CPU build saturates instead), whatever the tensor's size."""
    from trainer.memory.fp8_matmul import input_factor, quantise_input
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        size = torch.rand((), generator=g) * 10 ** float(torch.randint(-6, 6, (), generator=g))
        x = (torch.randn(4, 32, generator=g) * size).to(torch.bfloat16)
        assert float((x * input_factor(x)).abs().max()) <= 448
        q, scale = quantise_input(x)
        assert not q.float().isnan().any() and torch.isfinite(scale) and scale > 0


def test_an_input_whose_features_are_not_contiguous_is_handed_over_row_major():
    """CUDA's fp8 kernel takes the input row-major only: a transposed view (features strided) is copied."""
    from trainer.memory.fp8_matmul import quantise_input
    _, fast, _, _ = _layer(torch.float32, "none")
    x = torch.randn(48, 6).t()  # [6, 48], its features 6 apart
    q, _ = quantise_input(x)
    assert q.is_contiguous()
    torch.testing.assert_close(fast(x), fast(x.contiguous()))
