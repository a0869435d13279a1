"""EMA against its closed form, bf16 stochastic rounding, fp8 storage, and an EMA run that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.__main__ import main as cli
from trainer.config.checks import cross_field_warnings, load_config
from trainer.errors import ConfigError
from trainer.train.ema import TrainableEMA, sample_variants
from trainer.events import read_events
from trainer.memory.precision import StochasticRounding, stochastic_round_to_bf16

pytestmark = pytest.mark.slow


def linear(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).to(dtype)


def set_params(m, k: float):
    """The known parameter sequence: after optimizer step k every weight is p_k = k·base + k²/10."""
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.full_like(p, k) * (i + 1) + k * k / 10)


def closed_form(e0, values, decays):
    """e_n = e0·Π d_j + Σ_i (1 − d_i)·p_i·Π_{j>i} d_j."""
    out = e0 * torch.prod(torch.tensor(decays, dtype=torch.float64))
    for i, (v, d) in enumerate(zip(values, decays)):
        out = out + (1 - d) * v * torch.prod(torch.tensor(decays[i + 1:] or [1.0], dtype=torch.float64))
    return out


def test_constant_decay_matches_closed_form():
    m = linear()
    e0 = [p.detach().double().clone() for p in m.parameters()]
    ema = TrainableEMA(list(m.named_parameters()), decay=0.9, warmup=False)
    k = 7
    for step in range(1, k + 1):
        set_params(m, step)
        ema.after_optimizer_step(step)
    for j, (s, p) in enumerate(zip(ema.shadow_params, m.parameters())):
        values = [torch.full_like(e0[j], step) * (j + 1) + step * step / 10 for step in range(1, k + 1)]
        expected = closed_form(e0[j], values, [0.9] * k)
        torch.testing.assert_close(s.double(), expected, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(s.double(), p.detach().double())  # EMA lags the raw weights
    assert ema.optimization_step == k


def test_warmup_decay_and_update_interval_match_closed_form():
    m = linear()
    e0 = [p.detach().double().clone() for p in m.parameters()]
    ema = TrainableEMA(list(m.named_parameters()), decay=0.95, warmup=True, update_every_n_steps=3)
    seen = []
    for step in range(1, 31):
        set_params(m, step)
        if ema.after_optimizer_step(step):
            seen.append(step)
    assert seen == list(range(3, 31, 3))
    # diffusers' warm-up: update n uses min(decay, (1 + s)/(10 + s)), s = n − 1; the first update copies
    decays = [0.0 if n == 1 else min(0.95, n / (9 + n)) for n in range(1, len(seen) + 1)]
    assert decays[-1] < 0.95  # still warming up after 10 updates
    assert ema.cur_decay_value == pytest.approx(decays[-1])
    for j, s in enumerate(ema.shadow_params):
        values = [torch.full_like(e0[j], step) * (j + 1) + step * step / 10 for step in seen]
        torch.testing.assert_close(s.double(), closed_form(e0[j], values, decays), rtol=1e-6, atol=1e-5)


def test_shadow_is_fp32_on_its_device_and_applied_restores_raw_weights():
    m = linear(torch.bfloat16)
    ema = TrainableEMA(list(m.named_parameters()), decay=0.5, warmup=False, device="cpu")
    assert all(s.dtype == torch.float32 for s in ema.shadow_params)
    raw0 = [p.detach().clone() for p in m.parameters()]
    set_params(m, 1.0)
    ema.step()
    raw1 = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with ema.applied():
        for p, s, a, b in zip(m.parameters(), ema.shadow_params, raw0, raw1):
            torch.testing.assert_close(p.detach().float(), s.to(torch.bfloat16).float())
            torch.testing.assert_close(s, 0.5 * a.float() + 0.5 * b.float())
    for p, b in zip(m.parameters(), raw1):
        assert torch.equal(p.detach(), b) and p.dtype == torch.bfloat16
        assert torch.equal(p.grad, torch.ones_like(p))


def test_save_load_roundtrip_and_missing_ema(tmp_path):
    m = linear()
    ema = TrainableEMA(list(m.named_parameters()), decay=0.8, warmup=False)
    set_params(m, 2.0)
    ema.step()
    ema.save(tmp_path)
    other = TrainableEMA(list(m.named_parameters()), decay=0.8, warmup=False)
    assert other.load(tmp_path)
    assert other.optimization_step == 1
    for a, b in zip(ema.shadow_params, other.shadow_params):
        assert torch.equal(a, b)
    empty = tmp_path / "none"
    empty.mkdir()
    assert not other.load(empty)  # restarts from the current weights
    for s, p in zip(other.shadow_params, m.parameters()):
        assert torch.equal(s, p.detach())


def test_sample_variants():
    from types import SimpleNamespace as NS
    ema = object()
    assert sample_variants(None, NS(sample_with="both")) == [("", False)]
    assert sample_variants(ema, NS(sample_with="raw")) == [("", False)]
    assert sample_variants(ema, NS(sample_with="ema")) == [("", True)]
    assert sample_variants(ema, NS(sample_with="both")) == [("", False), ("-ema", True)]


# --- precision ---------------------------------------------------------------------------------

def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2 ** -7 / 3)  # a third of the way between two bf16 values
    lo, hi = torch.tensor(1.0), torch.tensor(1.0 + 2 ** -7)
    r = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {float(lo), float(hi)}
    assert float((r == hi).float().mean()) == pytest.approx(1 / 3, abs=0.01)
    assert float(r.mean()) == pytest.approx(float(x[0]), rel=1e-5)
    exact = torch.tensor([0.5, -2.0, float("inf"), 0.0])
    assert torch.equal(stochastic_round_to_bf16(exact, torch.Generator()).float(), exact)


def test_stochastic_rounding_keeps_small_updates_and_fp32_state():
    def train(rounding: bool, steps=200):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p], lr=1e-3)
        counter = {"step": 0}
        hooks = StochasticRounding(opt, lambda: counter["step"]) if rounding else None
        for _ in range(steps):
            p.grad = torch.full_like(p, -1.0)
            opt.step()
            counter["step"] += 1
        return p, opt, hooks

    p, _, _ = train(False)
    assert torch.equal(p.float(), torch.ones(4096))  # each 0.001 step rounds back: all updates lost
    p, _, _ = train(True)
    assert p.dtype == torch.bfloat16
    assert float(p.detach().float().mean()) == pytest.approx(1.2, abs=0.01)  # 200 × 0.001, kept on average
    # Adam's state is fp32 and stays fp32 through a state_dict round trip (exact resume)
    q = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([q], lr=1e-3)
    StochasticRounding(opt, lambda: 0)
    q.grad = torch.ones_like(q)
    opt.step()
    assert opt.state[q]["exp_avg"].dtype == torch.float32 and q.dtype == torch.bfloat16
    saved = opt.state_dict()
    saved_avg = saved["state"][0]["exp_avg"].clone()
    q2 = torch.nn.Parameter(q.detach().clone())
    opt2 = torch.optim.AdamW([q2], lr=1e-3)
    StochasticRounding(opt2, lambda: 0)
    opt2.load_state_dict(saved)
    assert opt2.state[q2]["exp_avg"].dtype == torch.float32 and q2.dtype == torch.bfloat16
    assert torch.equal(opt2.state[q2]["exp_avg"], saved_avg)


def test_fp8_storage_trains_lora_on_the_tiny_unet(tiny_workspace):
    import copy
    from trainer.methods.make import make_method
    from trainer.families.sources import load_model
    from trainer.memory.precision import apply_precision
    cfg = load_config(preset="demo", overrides=[f"general.workspace={tiny_workspace}", "precision.fp8_unet=true"])
    model = load_model(cfg.model, str(tiny_workspace))
    method = make_method(model, cfg)
    with torch.no_grad():  # non-zero LoRA up-weights, so the adapters change the output
        for n, p in model.unet.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    reference = copy.deepcopy(model.unet)
    apply_precision(model, method, None, cfg, lambda: 0)
    fp8 = {n for n, p in model.unet.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert len(fp8) > 20 and not any("lora_" in n for n in fp8)
    assert all(p.dtype == torch.float32 for n, p in model.unet.named_parameters() if "lora_" in n)
    assert model.unet.dtype == torch.float32  # the compute dtype: inputs are not cast to fp8
    # the reference: the same weights rounded to fp8 and back, computed the plain way
    with torch.no_grad():
        ref_params = dict(reference.named_parameters())
        for n, p in model.unet.named_parameters():
            if n in fp8:
                ref_params[n].copy_(p.to(torch.float32))
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(2, 77, model.unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([500, 20])
    outs, grads = [], []
    for unet in (model.unet, reference):
        pred = unet(latents, t, cond, return_dict=False)[0]
        pred.pow(2).mean().backward()  # through fp8 convs and linears
        outs.append(pred.detach())
        grads.append({n: p.grad for n, p in unet.named_parameters() if p.requires_grad})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-7)
    with torch.no_grad():  # sampling (no grad) takes the direct path
        torch.testing.assert_close(model.unet(latents, t, cond, return_dict=False)[0], outs[0])
    with pytest.raises(ConfigError):
        load_config(preset="demo-finetune", overrides=[f"general.workspace={tiny_workspace}",
                                                       "precision.fp8_unet=true"])


def test_ema_and_precision_config_rules(tmp_path):
    ws = [f"general.workspace={tmp_path}"]
    slow = ["ema.enabled=true", "ema.decay=0.9999", "training.max_steps=100"]
    c = load_config(preset="demo", overrides=ws + slow + ["ema.warmup=false"])
    assert "ema.decay" in {i.key for i in cross_field_warnings(c)}
    c = load_config(preset="demo", overrides=ws + slow)  # the warm-up keeps a short run's EMA moving
    assert "ema.decay" not in {i.key for i in cross_field_warnings(c)}
    c = load_config(preset="demo", overrides=ws + ["ema.enabled=true", "ema.decay=0.9", "training.max_steps=100"])
    assert "ema.decay" not in {i.key for i in cross_field_warnings(c)}
    with pytest.raises(ConfigError):
        load_config(preset="demo", overrides=ws + ["ema.device=gpu"])
    c = load_config(preset="demo-finetune", overrides=ws + ["model.unet_dtype=bf16"])
    assert "precision.stochastic_rounding" in {i.key for i in cross_field_warnings(c)}


# --- a whole run with EMA ----------------------------------------------------------------------

def _args(ws: Path, run: str, *extra: str) -> list:
    common = ["training.max_steps=6", "ema.enabled=true", "ema.decay=0.9", "sampling.every_n_epochs=0",
              "sampling.prompts=[{prompt: a red square, steps: 2, width: 64, height: 64}]",
              "backup.every_n_steps=3", "backup.every_n_epochs=0", "backup.keep_last=5", "lora.dropout=0.1",
              "data.random_flip=true", "output.dtype=fp32", "loss.min_snr_gamma=5"]
    out = ["--set", f"general.workspace={ws}", "--set", f"general.run_name={run}", "--no-progress"]
    for e in common + list(extra):
        out += ["--set", e]
    return out


def _kohya_key(name: str) -> str:
    """unet.<path>.lora_A.default.weight → lora_unet_<path with underscores>.lora_down.weight"""
    path, kind = name[len("unet."):].split(".lora_")
    return "lora_unet_" + path.replace(".", "_") + (".lora_down.weight" if kind.startswith("A") else
                                                    ".lora_up.weight")


def test_ema_run_saves_ema_weights_and_resumes_exactly(tiny_workspace):
    from safetensors.torch import load_file
    ws = tiny_workspace
    assert cli(["train", "--preset", "demo", *_args(ws, "ema_straight")]) == 0
    run = ws / "runs" / "ema_straight"
    samples = sorted(p.name for p in (run / "samples").glob("*.png"))
    assert samples == ["step000006-p0-ema.png", "step000006-p0.png"]
    ev = [e for e in read_events(run / "events.jsonl") if e["type"] == "sample"][-1]
    assert ev["weights"] == ["raw", "ema"] and len(ev["prompts"]) == 2
    last = run / "backups" / "backup-step000006"
    raw = load_file(str(last / "trainable.safetensors"))
    shadow = load_file(str(last / "ema.safetensors"))
    assert set(raw) == set(shadow)
    assert json.loads((last / "ema.json").read_text())["optimization_step"] == 6
    result = load_file(str(run / "ema_straight.safetensors"))
    differ = 0
    for name, s in shadow.items():
        got = result[_kohya_key(name)]
        torch.testing.assert_close(got, s, rtol=0, atol=0)  # the result holds the EMA weights
        differ += not torch.allclose(s, raw[name])
    assert differ > len(shadow) // 2  # … which are not the raw weights

    # resume from the step-3 backup (mid-epoch) in a new run folder: same EMA, same result
    assert cli(["train", "--preset", "demo", *_args(ws, "ema_resumed", "sampling.at_end=false"),
                "--resume", str(run / "backups" / "backup-step000003")]) == 0
    run2 = ws / "runs" / "ema_resumed"
    started = [e for e in read_events(run2 / "events.jsonl") if e["type"] == "started"][-1]
    assert started["resumed_from_step"] == 3
    a, b = result, load_file(str(run2 / "ema_resumed.safetensors"))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    shadow2 = load_file(str(run2 / "backups" / "backup-step000006" / "ema.safetensors"))
    for k in shadow:
        torch.testing.assert_close(shadow2[k], shadow[k], rtol=0, atol=1e-6)
