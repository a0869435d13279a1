"""The objectives a family picks: DDPM (the SD lineage) and flow matching (Flux, SD3 …)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from trainer.objectives import DDPMObjective, FlowMatchingObjective, flux_shift_mu, refused_options


def _lc(**kw):
    base = dict(type="mse", huber_delta=0.1, huber_schedule="constant", min_snr_gamma=0.0, debiased_estimation=False,
                zero_terminal_snr=False, timestep_min=0, timestep_max=1000, timestep_distribution="uniform",
                logit_mean=0.0, logit_std=1.0, mode_scale=1.29, flow_shift=0.0, flow_weighting="none")
    base.update(kw)
    return NS(**base)


def test_flow_matching_interpolates_towards_noise_and_targets_the_velocity():
    obj = FlowMatchingObjective()
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    eps = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([0.0, 0.5, 1.0])
    noisy, target = obj.noisy_and_target(x, eps, sigmas)
    torch.testing.assert_close(noisy[0], x[0])
    torch.testing.assert_close(noisy[2], eps[2])
    torch.testing.assert_close(noisy[1], 0.5 * x[1] + 0.5 * eps[1])
    torch.testing.assert_close(target, eps - x)


def test_flow_timesteps_are_sigmas_in_range_shifted_and_reproducible():
    lc = _lc()
    plain = FlowMatchingObjective().sample_timesteps(4000, lc, torch.Generator().manual_seed(3))
    again = FlowMatchingObjective().sample_timesteps(4000, lc, torch.Generator().manual_seed(3))
    torch.testing.assert_close(plain, again)
    assert plain.dtype == torch.float32 and 0 < plain.min() and plain.max() <= 1
    assert abs(plain.mean().item() - 0.5) < 0.03  # uniform
    shifted = FlowMatchingObjective(shift=3.0).sample_timesteps(4000, lc, torch.Generator().manual_seed(3))
    # the same draws, shifted towards noise: s·σ / (1 + (s − 1)·σ)
    torch.testing.assert_close(shifted, 3 * plain / (1 + 2 * plain))
    # loss.flow_shift overrides the model's own shift
    user = FlowMatchingObjective(shift=3.0).sample_timesteps(4000, _lc(flow_shift=1.0), torch.Generator().manual_seed(3))
    torch.testing.assert_close(user, plain)
    # the range: timestep_min/max are read as thousandths of σ
    part = FlowMatchingObjective().sample_timesteps(1000, _lc(timestep_min=200, timestep_max=400),
                                                    torch.Generator().manual_seed(0))
    assert 0.2 <= part.min() and part.max() <= 0.4


def test_resolution_dependent_shift_grows_with_the_image():
    def mu_of(latents):  # Flux: 2x2 packed tokens of the latent
        return flux_shift_mu(latents.shape[-1] * latents.shape[-2] // 4)
    obj = FlowMatchingObjective(dynamic_shift=mu_of)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    lc = _lc(resolution_shift=True)  # (off, the default, the draw is unshifted: diffusers' Flux trainer)
    small = obj.sample_timesteps(2000, lc, gen(), torch.zeros(1, 16, 32, 32).expand(2000, -1, -1, -1))
    large = obj.sample_timesteps(2000, lc, gen(), torch.zeros(1, 16, 128, 128).expand(2000, -1, -1, -1))
    assert large.mean() > small.mean() + 0.05  # more tokens, more noise (as FluxPipeline samples)
    u = FlowMatchingObjective().sample_timesteps(2000, _lc(), gen())
    torch.testing.assert_close(obj.sample_timesteps(2000, _lc(), gen(), torch.zeros(1, 16, 128, 128)), u)
    mu = flux_shift_mu(32 * 32 // 4)
    torch.testing.assert_close(small, math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    assert flux_shift_mu(256) == pytest.approx(0.5) and flux_shift_mu(4096) == pytest.approx(1.15)


def test_flow_loss_weighting_is_sd3s():
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    sig = torch.tensor([0.1, 0.5, 0.9])
    assert FlowMatchingObjective().timestep_weights(_lc(), sig) is None
    torch.testing.assert_close(FlowMatchingObjective().timestep_weights(_lc(flow_weighting="cosmap"), sig),
                               compute_loss_weighting_for_sd3("cosmap", sig))


def test_ddpm_objective_matches_the_scheduler():
    from diffusers import DDPMScheduler
    sched = DDPMScheduler(num_train_timesteps=1000)
    x, eps = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    noisy, target = DDPMObjective(sched, "v_prediction").noisy_and_target(x, eps, t)
    torch.testing.assert_close(noisy, sched.add_noise(x, eps, t))
    torch.testing.assert_close(target, sched.get_velocity(x, eps, t))
    ts = DDPMObjective(sched, "epsilon").sample_timesteps(64, _lc(timestep_min=100, timestep_max=200),
                                                         torch.Generator().manual_seed(0))
    assert ts.dtype == torch.int64 and 100 <= ts.min() and ts.max() < 200


@pytest.mark.parametrize("option, value", [("min_snr_gamma", 5.0), ("debiased_estimation", True),
                                           ("zero_terminal_snr", True)])
def test_ddpm_options_are_refused_for_flow_matching_and_the_reverse(option, value):
    problems = refused_options("flow", _lc(**{option: value}), "Flux.1")
    assert [k for k, _ in problems] == [f"loss.{option}"] and "flow matching" in problems[0][1]
    assert refused_options("ddpm", _lc(**{option: value}), "SD") == []
    assert [k for k, _ in refused_options("ddpm", _lc(flow_weighting="cosmap"), "SD 1.x")] == ["loss.flow_weighting"]
    assert refused_options("flow", _lc(type="huber", huber_schedule="snr"), "Flux.1")[0][0] == "loss.huber_schedule"
    assert refused_options("flow", _lc(type="huber", huber_schedule="exponential"), "Flux.1") == []


def test_the_flow_samplers_logit_normal_has_the_mean_and_spread_it_is_given():
    """σ = sigmoid(n), n ~ N(logit_mean, logit_std): the logits of the draws have that mean and spread (a swapped mean
    and std would give every σ the same value)."""
    obj = FlowMatchingObjective()
    sigmas = obj.sample_timesteps(20000, _lc(timestep_distribution="logit_normal", logit_mean=0.8, logit_std=0.5),
                                  torch.Generator().manual_seed(5))
    logits = torch.logit(sigmas.double().clamp(1e-6, 1 - 1e-6))
    assert logits.mean().item() == pytest.approx(0.8, abs=0.02)
    assert logits.std().item() == pytest.approx(0.5, abs=0.02)


def test_auto_draws_each_models_own_distribution():
    """loss.timestep_distribution = auto: logit-normal σ for SD3 (diffusers' and kohya's SD3 default), uniform for a
    flow model without one of its own — the very draws of those settings."""
    lc_auto, lc_ln, lc_uni = _lc(timestep_distribution="auto"), _lc(timestep_distribution="logit_normal"), _lc()
    sd3 = FlowMatchingObjective(default_distribution="logit_normal")
    torch.testing.assert_close(sd3.sample_timesteps(64, lc_auto, torch.Generator().manual_seed(1)),
                               sd3.sample_timesteps(64, lc_ln, torch.Generator().manual_seed(1)))
    flux = FlowMatchingObjective()
    torch.testing.assert_close(flux.sample_timesteps(64, lc_auto, torch.Generator().manual_seed(1)),
                               flux.sample_timesteps(64, lc_uni, torch.Generator().manual_seed(1)))


def test_preconditioned_outputs_are_diffusers_sd3_trainers():
    """loss.precondition_outputs: diffusers' train_dreambooth_sd3.py compares ``model_pred * (-sigmas) +
    noisy_model_input`` with ``model_input``; that is the velocity error weighted by σ²."""
    obj = FlowMatchingObjective()
    g = torch.Generator().manual_seed(7)
    x, eps, v_hat = (torch.randn(3, 4, 6, 10, generator=g) for _ in range(3))
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    noisy, target = obj.noisy_and_target(x, eps, sigmas)
    pred, clean = obj.preconditioned(v_hat, noisy, x, sigmas)
    s = sigmas.view(-1, 1, 1, 1)
    torch.testing.assert_close(pred, v_hat * (-s) + noisy)
    torch.testing.assert_close(clean, x)
    velocity = ((v_hat - target) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(((pred - clean) ** 2).mean((1, 2, 3)), (s.flatten() ** 2) * velocity)


def test_preconditioned_outputs_are_refused_without_flow_matching():
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError, match="loss.precondition_outputs"):
        load_config(preset="demo", overrides=["loss.precondition_outputs=true"])
