"""Loss options on fixed tensors, against formulas written out here independently of trainer/loss.py."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from trainer.config.checks import cross_field_warnings, load_config
from trainer.errors import ConfigError
from trainer.loss import (choose_mask, make_noise, per_sample_loss, perturb_noise, prepare_noise_schedule,
                          sample_timesteps, weighted_mean)

T = 1000


def sd_scheduler(prediction_type="epsilon", **kw):
    from diffusers import DDPMScheduler
    return DDPMScheduler(num_train_timesteps=T, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         prediction_type=prediction_type, **kw)


def hand_alphas_cumprod():
    """SD's scaled-linear schedule, by hand: betas = linspace(√β0, √β1, T)², ᾱ = Π(1 − β)."""
    betas = [(math.sqrt(0.00085) + (math.sqrt(0.012) - math.sqrt(0.00085)) * i / (T - 1)) ** 2 for i in range(T)]
    out, acc = [], 1.0
    for b in betas:
        acc *= 1.0 - b
        out.append(acc)
    return out


AC = hand_alphas_cumprod()
TIMESTEPS = torch.tensor([0, 10, 400, 999])


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(123)
    pred = torch.randn(4, 4, 8, 8, generator=g)
    target = torch.randn(4, 4, 8, 8, generator=g) * 1.5
    return pred, target


def mean_sq(pred, target, i):
    d = (pred[i] - target[i]).double()
    return float((d * d).mean())


def cfg(**kw):
    base = dict(type="mse", huber_delta=0.1, huber_schedule="constant", min_snr_gamma=0.0,
                debiased_estimation=False, unmasked_weight=0.0, unmasked_probability=0.0,
                normalize_masked_area_loss=False)
    base.update(kw)
    return NS(**base)


def test_scheduler_matches_hand_schedule():
    ac = sd_scheduler().alphas_cumprod
    for t in (0, 10, 400, 999):
        assert float(ac[t]) == pytest.approx(AC[t], rel=1e-4)


def test_plain_mse_and_mae(tensors):
    pred, target = tensors
    s = sd_scheduler()
    got = per_sample_loss(pred, target, cfg(), TIMESTEPS, s)
    for i in range(4):
        assert float(got[i]) == pytest.approx(mean_sq(pred, target, i), rel=1e-5)
    got = per_sample_loss(pred, target, cfg(type="mae"), TIMESTEPS, s)
    for i in range(4):
        assert float(got[i]) == pytest.approx(float((pred[i] - target[i]).abs().double().mean()), rel=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_gamma_epsilon(tensors, gamma):
    pred, target = tensors
    got = per_sample_loss(pred, target, cfg(min_snr_gamma=gamma), TIMESTEPS, sd_scheduler("epsilon"))
    for i, t in enumerate(TIMESTEPS.tolist()):
        snr = AC[t] / (1 - AC[t])
        w = min(snr, gamma) / snr
        assert float(got[i]) == pytest.approx(w * mean_sq(pred, target, i), rel=1e-4)
    # low noise (t=0: SNR ≈ 1000) is down-weighted, high noise (SNR < γ) keeps weight 1
    assert float(got[0]) < 0.01 * mean_sq(pred, target, 0)
    assert float(got[3]) == pytest.approx(mean_sq(pred, target, 3), rel=1e-4)


def test_min_snr_gamma_v_prediction(tensors):
    pred, target = tensors
    gamma = 5.0
    got = per_sample_loss(pred, target, cfg(min_snr_gamma=gamma), TIMESTEPS, sd_scheduler("v_prediction"))
    for i, t in enumerate(TIMESTEPS.tolist()):
        snr = AC[t] / (1 - AC[t])
        w = min(snr, gamma) / (snr + 1)
        assert float(got[i]) == pytest.approx(w * mean_sq(pred, target, i), rel=1e-4)
    # the prediction type can also be given explicitly
    again = per_sample_loss(pred, target, cfg(min_snr_gamma=gamma), TIMESTEPS, sd_scheduler("epsilon"),
                            prediction_type="v_prediction")
    torch.testing.assert_close(again, got)


@pytest.mark.parametrize("pred_type", ["epsilon", "v_prediction"])
def test_debiased_estimation(tensors, pred_type):
    pred, target = tensors
    got = per_sample_loss(pred, target, cfg(debiased_estimation=True), TIMESTEPS, sd_scheduler(pred_type))
    for i, t in enumerate(TIMESTEPS.tolist()):
        snr = min(AC[t] / (1 - AC[t]), 1000.0)
        w = 1 / (snr + 1) if pred_type == "v_prediction" else 1 / math.sqrt(snr)
        assert float(got[i]) == pytest.approx(w * mean_sq(pred, target, i), rel=1e-4)


def hand_delta(schedule, c, t):
    if schedule == "constant":
        return c
    if schedule == "exponential":  # kohya: exp(−α t) with α = −ln(c)/T
        return math.exp(math.log(c) / T * t)
    sigma = math.sqrt((1 - AC[t]) / AC[t])
    return (1 - c) / (1 + sigma) ** 2 + c


@pytest.mark.parametrize("loss_type", ["huber", "smooth_l1"])
@pytest.mark.parametrize("schedule", ["constant", "exponential", "snr"])
def test_huber_and_smooth_l1(tensors, loss_type, schedule):
    pred, target = tensors
    c = 0.1
    got = per_sample_loss(pred, target, cfg(type=loss_type, huber_delta=c, huber_schedule=schedule), TIMESTEPS,
                          sd_scheduler())
    for i, t in enumerate(TIMESTEPS.tolist()):
        delta = hand_delta(schedule, c, t)
        total = 0.0
        diffs = (pred[i] - target[i]).flatten().tolist()
        for d in diffs:
            core = math.sqrt(d * d + delta * delta) - delta
            total += 2 * delta * core if loss_type == "huber" else 2 * core
        assert float(got[i]) == pytest.approx(total / len(diffs), rel=1e-4)


def test_huber_schedules_run_from_one_to_delta():
    # exponential: δ(0) = 1, δ(T) = c; snr: δ ≈ 1 at low noise, → c at high noise
    assert hand_delta("exponential", 0.1, 0) == 1.0
    assert hand_delta("exponential", 0.1, T) == pytest.approx(0.1)
    assert hand_delta("snr", 0.1, 0) > 0.9 and hand_delta("snr", 0.1, 999) < 0.2
    # huber is ≈ MSE for errors far below δ (a drop-in for MSE) and linear far above
    small = torch.full((1, 1, 2, 2), 1e-3)
    zero = torch.zeros_like(small)
    c = cfg(type="huber", huber_delta=1.0)
    assert float(per_sample_loss(small, zero, c, torch.tensor([0]), sd_scheduler())) == pytest.approx(1e-6, rel=1e-3)
    big = torch.full((1, 1, 2, 2), 100.0)
    assert float(per_sample_loss(big, zero, c, torch.tensor([0]), sd_scheduler())) == pytest.approx(2 * 100 - 2,
                                                                                                  rel=1e-3)


def test_masked_loss_weights_and_normalisation(tensors):
    pred, target = tensors
    mask = torch.zeros(4, 1, 8, 8)
    mask[:, :, 2:6, 1:5] = 1.0  # 16 of 64 positions are "focus"
    mask[1] = 1.0  # sample 1: everything is focus
    mask[3, :, 0, 0] = 0.5  # a soft value stays as it is (above unmasked_weight)
    uw = 0.25
    for normalize in (False, True):
        got = per_sample_loss(pred, target, cfg(unmasked_weight=uw, normalize_masked_area_loss=normalize),
                              TIMESTEPS, sd_scheduler(), mask=mask)
        for i in range(4):
            num, wsum, n = 0.0, 0.0, 0
            for c in range(4):
                for y in range(8):
                    for x in range(8):
                        w = max(uw, float(mask[i, 0, y, x]))
                        d = float(pred[i, c, y, x] - target[i, c, y, x])
                        num += w * d * d
                        n += 1
            for y in range(8):
                for x in range(8):
                    wsum += max(uw, float(mask[i, 0, y, x]))
            expected = num / n
            if normalize:
                expected /= wsum / 64
            assert float(got[i]) == pytest.approx(expected, rel=1e-4), (i, normalize)
        assert float(got[1]) == pytest.approx(mean_sq(pred, target, 1), rel=1e-4)  # full mask = no mask


def test_mask_at_other_resolution_is_area_resized(tensors):
    pred, target = tensors
    mask = torch.zeros(4, 1, 16, 16)
    mask[:, :, :8, :] = 1.0  # top half
    got = per_sample_loss(pred, target, cfg(unmasked_weight=0.0), TIMESTEPS, sd_scheduler(), mask=mask)
    for i in range(4):
        d = (pred[i] - target[i]).double() ** 2
        assert float(got[i]) == pytest.approx(float(d[:, :4, :].sum() / d.numel()), rel=1e-4)


def test_masks_combine_with_min_snr_and_concept_weights(tensors):
    pred, target = tensors
    mask = torch.ones(4, 1, 8, 8)
    mask[:, :, :, 4:] = 0.0
    c = cfg(min_snr_gamma=5.0, unmasked_weight=0.5)
    got = per_sample_loss(pred, target, c, TIMESTEPS, sd_scheduler(), mask=mask)
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0])
    total = 0.0
    for i, t in enumerate(TIMESTEPS.tolist()):
        d = (pred[i] - target[i]).double() ** 2
        masked = (d[:, :, :4].sum() + 0.5 * d[:, :, 4:].sum()) / d.numel()
        snr = AC[t] / (1 - AC[t])
        assert float(got[i]) == pytest.approx(float(masked) * min(snr, 5.0) / snr, rel=1e-4)
        total += float(got[i]) * float(weights[i])
    assert float(weighted_mean(got, weights)) == pytest.approx(total / 4, rel=1e-6)


def test_unmasked_probability_is_deterministic_and_has_the_right_rate():
    mask = torch.ones(1, 1, 2, 2)
    c = cfg(unmasked_probability=0.3)
    picks = [choose_mask(mask, c, g) is None for g in [torch.Generator().manual_seed(5)] for _ in range(4000)]
    assert 0.27 < sum(picks) / len(picks) < 0.33
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [choose_mask(mask, c, g1) is None for _ in range(50)] == [choose_mask(mask, c, g2) is None for _ in range(50)]
    assert choose_mask(None, c, g1) is None
    # no mask, no draw: runs without masks keep their random stream
    g3 = torch.Generator().manual_seed(1)
    state = g3.get_state()
    choose_mask(None, c, g3)
    choose_mask(mask, cfg(unmasked_probability=0.0), g3)
    assert torch.equal(g3.get_state(), state)


def test_noise_offset_and_input_perturbation():
    g = torch.Generator().manual_seed(0)
    noise = make_noise((2, 4, 8, 8), g, 0.1)
    g = torch.Generator().manual_seed(0)
    base = torch.randn((2, 4, 8, 8), generator=g)
    offset = torch.randn((2, 4, 1, 1), generator=g)
    torch.testing.assert_close(noise, base + 0.1 * offset)
    g = torch.Generator().manual_seed(0)
    torch.testing.assert_close(make_noise((2, 4, 8, 8), g, 0.0), base)
    assert perturb_noise(noise, 0.0, g) is noise
    big = torch.zeros(4, 4, 64, 64)
    extra = perturb_noise(big, 0.1, torch.Generator().manual_seed(1))
    assert float(extra.std()) == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("dist,kw", [("uniform", {}), ("logit_normal", {}), ("logit_normal", {"logit_mean": 1.0}),
                                     ("mode", {"mode_scale": 1.29}), ("mode", {"mode_scale": -1.0})])
def test_timesteps_stay_in_range(dist, kw):
    g = torch.Generator().manual_seed(0)
    c = NS(timestep_distribution=dist, timestep_min=200, timestep_max=700, **kw)
    t = sample_timesteps(5000, T, c, g)
    assert t.dtype == torch.int64
    assert int(t.min()) >= 200 and int(t.max()) <= 699
    full = sample_timesteps(5000, T, NS(timestep_distribution=dist, timestep_min=0, timestep_max=5000, **kw), g)
    assert int(full.max()) <= T - 1  # capped at the model's count


def test_timestep_distribution_shapes():
    n = 20000
    draw = lambda **kw: sample_timesteps(n, T, NS(timestep_min=0, timestep_max=T, **kw),
                                         torch.Generator().manual_seed(3)).float()
    uni = draw(timestep_distribution="uniform")
    assert abs(float(uni.mean()) - 499.5) < 10 and abs(float(uni.std()) - 288.7) < 10
    # the default uniform draw is exactly torch.randint: old runs keep their timesteps
    assert torch.equal(uni.long(), torch.randint(0, T, (n,), generator=torch.Generator().manual_seed(3)))
    ln = draw(timestep_distribution="logit_normal", logit_mean=0.0, logit_std=1.0)
    assert abs(float(ln.mean()) - 500) < 15 and float(ln.std()) < 230  # centred, narrower than uniform
    middle = ((ln > 250) & (ln < 750)).float().mean()
    assert middle > 0.68  # uniform: 0.5; sigmoid(N(0,1)) puts ≈ 72 % in the middle half
    shifted = draw(timestep_distribution="logit_normal", logit_mean=1.0, logit_std=1.0)
    assert float(shifted.mean()) > 650
    mode = draw(timestep_distribution="mode", mode_scale=1.29)
    assert abs(float(mode.mean()) - 500) < 15 and float(mode.std()) < 240
    flat = draw(timestep_distribution="mode", mode_scale=0.0)
    assert abs(float(flat.std()) - 288.7) < 10


def test_timestep_range_must_be_nonempty():
    with pytest.raises(ConfigError):
        sample_timesteps(2, T, NS(timestep_distribution="uniform", timestep_min=500, timestep_max=500),
                         torch.Generator())


def test_zero_terminal_snr_on_the_model(tiny_workspace):
    from trainer.families.sources import load_model
    c = load_config(preset="demo", overrides=[f"general.workspace={tiny_workspace}", "loss.zero_terminal_snr=true",
                                              "loss.min_snr_gamma=5"])
    model = load_model(c.model, str(tiny_workspace))
    assert float(model.noise_scheduler.alphas_cumprod[-1]) > 0
    warnings = []
    prepare_noise_schedule(model, c.loss, warnings.append)
    ac = model.noise_scheduler.alphas_cumprod
    assert float(ac[-1]) == 0.0 and float(ac[0]) > 0.99
    assert any("v-prediction" in w for w in warnings)  # the tiny model is epsilon
    sampler = model.pipeline("euler").scheduler
    assert sampler.config.rescale_betas_zero_snr and sampler.config.timestep_spacing == "trailing"
    # SNR weights stay finite at SNR = 0: ε → limit 1, v → 0
    pred = torch.ones(2, 4, 2, 2)
    ts = torch.tensor([999, 999])
    eps = per_sample_loss(pred, torch.zeros_like(pred), c.loss, ts, model.noise_scheduler)
    v = per_sample_loss(pred, torch.zeros_like(pred), c.loss, ts, model.noise_scheduler, prediction_type="v_prediction")
    assert torch.equal(eps, torch.ones(2)) and torch.equal(v, torch.zeros(2))
    deb = per_sample_loss(pred, torch.zeros_like(pred), cfg(debiased_estimation=True), ts, model.noise_scheduler)
    assert torch.isfinite(deb).all()


def test_config_rules(tmp_path):
    ws = [f"general.workspace={tmp_path}"]
    c = load_config(preset="demo", overrides=ws + ["loss.type=huber", "loss.huber_schedule=snr", "loss.huber_delta=0.2",
                                                   "loss.timestep_distribution=logit_normal"])
    assert c.loss.huber_delta == 0.2
    with pytest.raises(ConfigError) as e:
        load_config(preset="demo", overrides=ws + ["loss.timestep_min=600", "loss.timestep_max=400"])
    assert e.value.key == "loss.timestep_min"
    with pytest.raises(ConfigError) as e:
        load_config(preset="demo", overrides=ws + ["loss.type=huber", "loss.huber_delta=2"])
    assert e.value.key == "loss.huber_delta"
    load_config(preset="demo", overrides=ws + ["loss.type=huber", "loss.huber_delta=2", "loss.huber_schedule=constant"])
    with pytest.raises(ConfigError) as e:
        load_config(preset="demo", overrides=ws + ["loss.type=l3"])
    assert "huber" in str(e.value)
    with pytest.raises(ConfigError):
        load_config(preset="demo", overrides=ws + ["loss.mode_scale=3"])
    warned = {i.key for i in cross_field_warnings(load_config(
        preset="demo", overrides=ws + ["loss.zero_terminal_snr=true", "model.prediction_type=epsilon",
                                       "loss.min_snr_gamma=5", "loss.debiased_estimation=true"]))}
    assert {"loss.zero_terminal_snr", "loss.debiased_estimation"} <= warned
    quiet = {i.key for i in cross_field_warnings(load_config(
        preset="demo", overrides=ws + ["loss.zero_terminal_snr=true", "model.prediction_type=v_prediction"]))}
    assert "loss.zero_terminal_snr" not in quiet


# --- learned variance (PixArt): the variational bound -------------------------------------------------------

def test_variational_bound_is_zero_for_the_true_posterior_and_trains_only_the_variance():
    """With the true noise and the posterior's own variance (var_values = -1) the KL term is 0; a wrong variance
    costs bits; only the variance values get a gradient (ε is detached: the mean learns from the ε loss)."""
    from diffusers import DDPMScheduler

    from trainer.loss import variational_bound
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.0001, beta_end=0.02)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(3, 4, 8, 8, generator=g) * 2 - 1
    noise = torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([10, 500, 999])
    xt = sched.add_noise(x0, noise, t)
    exact = variational_bound(sched.alphas_cumprod, x0, xt, t, noise, -torch.ones_like(x0))
    assert exact.abs().max() < 1e-4, exact.abs().max()
    var = torch.ones_like(x0, requires_grad=True)  # β_t instead of β̃_t: a worse variance
    eps = noise.clone().requires_grad_(True)
    worse = variational_bound(sched.alphas_cumprod, x0, xt, t, eps, var)
    per_image = worse.mean(dim=(1, 2, 3))
    assert per_image[0] > 1e-3 and (per_image >= 0).all()  # early t: β_t and β̃_t differ; late t they meet
    worse.mean().backward()
    assert var.grad is not None and var.grad.abs().sum() > 0 and eps.grad is None
    t0 = variational_bound(sched.alphas_cumprod, x0, sched.add_noise(x0, noise, torch.zeros(3, dtype=torch.long)),
                           torch.zeros(3, dtype=torch.long), noise, -torch.ones_like(x0))
    assert torch.isfinite(t0).all() and (t0 >= 0).all()  # t = 0: the decoder's NLL in bits


@pytest.mark.parametrize("stretch", [1.08, 1.0])
def test_the_cosine_schedules_original_timestep_draw_is_onetrainers(stretch):
    """loss.cosine_timesteps = original: the Würstchen v2 / Stable Cascade trainers' draw, as OneTrainer restates it
    (Würstchen 2: t·1.08 + 0.001, Stable Cascade: t + 0.001, clamped to [0.001, 1]) on the same uniform draw."""
    from types import SimpleNamespace

    from trainer.objectives import CosineObjective
    objective = CosineObjective(stretch)
    lc = SimpleNamespace(timestep_min=0, timestep_max=1000, cosine_timesteps="original")
    t = objective.sample_timesteps(4096, lc, torch.Generator().manual_seed(3))
    u = torch.rand((4096,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(t, (u * stretch + 0.001).clamp(0.001, 1.0))
    lc.cosine_timesteps = "uniform"
    torch.testing.assert_close(objective.sample_timesteps(8, lc, torch.Generator().manual_seed(3)), u[:8])


def test_the_original_cosine_draw_is_refused_where_there_is_no_cosine_schedule():
    from trainer.config.checks import load_config
    with pytest.raises(ConfigError, match="loss.cosine_timesteps"):
        load_config(preset="demo", overrides=["loss.cosine_timesteps=original"])
    cfg = load_config(preset="wuerstchen-2-lora", overrides=["loss.cosine_timesteps=original", "model.family=wuerstchen-2"])
    assert cfg.loss.cosine_timesteps == "original"
