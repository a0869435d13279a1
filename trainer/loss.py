"""The diffusion loss: noise, timesteps, the per-element loss, and its weightings.

Everything here is a pure function of tensors, a ``LossConfig`` and (where randomness is needed)
the trainer's ``torch.Generator`` — never the global RNG — so a resumed run draws exactly the same
noise, timesteps and mask choices as an uninterrupted one. The loop calls, per micro-batch::

    noise     = make_noise(latents.shape, generator, training.noise_offset)
    timesteps = model.objective.sample_timesteps(batch_size, cfg.loss, generator, latents)
    noisy, target = model.objective.noisy_and_target(latents, noise, timesteps)   # + input perturbation
    mask      = choose_mask(batch.get("mask"), cfg.loss, generator)
    losses    = per_sample_loss(model_pred, target, cfg.loss, timesteps, model.objective, mask)
    loss      = weighted_mean(losses, batch["loss_weights"])

Formulas and their sources:

- ``huber`` / ``smooth_l1`` are the pseudo-Huber forms of kohya's sd-scripts and the "scheduled
  pseudo-Huber" paper (Khrapov et al. 2024), with δ = ``huber_delta`` (kohya's ``huber_c``):
  huber = 2δ(√(d²+δ²) − δ) (≈ d² for small errors, so it is a drop-in for MSE),
  smooth_l1 = 2(√(d²+δ²) − δ). The schedule over timesteps: constant δ; exponential
  δ_t = exp(ln(δ)·t/T) (1 at t=0 → δ at t=T); snr δ_t = (1−δ)/(1+σ_t)² + δ with σ_t = √((1−ᾱ)/ᾱ).
- min-SNR-γ (Hang et al. 2023, as in diffusers' examples): ε-prediction min(SNR, γ)/SNR,
  v-prediction min(SNR, γ)/(SNR+1). Written as min(1, γ/SNR) for ε so SNR = 0 (zero terminal SNR)
  gives its limit 1 instead of 0/0.
- debiased estimation (kohya): ε-prediction 1/√SNR, v-prediction 1/(SNR+1), SNR capped at 1000.
- masked loss (OneTrainer's semantics): the element loss is multiplied by
  clamp(mask, unmasked_weight, 1); with ``normalize_masked_area_loss`` each sample is divided by
  the mean of that weight, so a small mask does not mean a small loss.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

from trainer.errors import ConfigError, Issue

LOSS_TYPES = ("mse", "mae", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
TIMESTEP_DISTRIBUTIONS = ("auto", "uniform", "logit_normal", "mode")
SNR_CAP = 1000.0  # SNR at t≈0 is huge (inf with some schedules); kohya caps it at 1000 for debiasing


def cfg_value(cfg: Any, name: str, default: Any) -> Any:
    """Read a LossConfig field; tests may pass a SimpleNamespace with only some fields."""
    return getattr(cfg, name, default) if cfg is not None else default


# ------------------------------------------------------------------------------------------
# noise and timesteps
# ------------------------------------------------------------------------------------------

def generator_device(generator):
    """Where ``generator`` draws (None: torch's default, the CPU). The training loop draws its tensors with a
    generator on the training device, so noise, timesteps and posterior samples are made there, not copied."""
    return None if generator is None else generator.device


def make_noise(shape, generator, noise_offset: float = 0.0):
    """Gaussian noise for the latents, plus the per-channel noise offset (Guttenberg 2023); on ``generator``'s
    device."""
    import torch  # torch inside: validate reads this module's rules without torch
    device = generator_device(generator)
    noise = torch.randn(shape, generator=generator, device=device)
    if noise_offset > 0:
        # one offset per channel, the same over every frame and pixel (video latents are [B, C, F, H, W])
        noise = noise + noise_offset * torch.randn((shape[0], shape[1]) + (1,) * (len(shape) - 2),
                                                   generator=generator, device=device)
    return noise


def perturb_noise(noise, gamma: float, generator):
    """Input perturbation (Ning et al. 2023): the model sees noise + γ·ξ; the target keeps ``noise``."""
    import torch  # torch inside: validate reads this module's rules without torch
    if gamma <= 0:
        return noise
    return noise + gamma * torch.randn(noise.shape, generator=generator,
                                       device=generator_device(generator)).to(noise.device)


def timestep_range(cfg: Any, num_train_timesteps: int) -> tuple[int, int]:
    """[lo, hi): the configured range clipped to the model's schedule."""
    lo = int(cfg_value(cfg, "timestep_min", 0))
    hi = min(int(cfg_value(cfg, "timestep_max", num_train_timesteps)), num_train_timesteps)
    if not 0 <= lo < hi:
        raise ConfigError(f"loss.timestep_min ({lo}) must be below loss.timestep_max ({hi}; the model has "
                          f"{num_train_timesteps} timesteps).", key="loss.timestep_min", value=lo)
    return lo, hi


def sample_timesteps(batch_size: int, num_train_timesteps: int, cfg: Any, generator):
    """Integer timesteps in [timestep_min, timestep_max), drawn with ``generator`` (on its device).

    ``uniform`` is ``torch.randint`` (the same draws as before these options existed);
    ``logit_normal`` and ``mode`` draw u ∈ [0, 1] with diffusers' SD3 helper
    ``compute_density_for_timestep_sampling`` (which takes our generator) and map it onto the range.
    """
    import torch  # torch inside: validate reads this module's rules without torch
    lo, hi = timestep_range(cfg, num_train_timesteps)
    dist = cfg_value(cfg, "timestep_distribution", "auto")
    if dist in ("uniform", "auto"):  # auto: a DDPM model's own draw is uniform
        return torch.randint(lo, hi, (batch_size,), generator=generator, device=generator_device(generator))
    if dist not in TIMESTEP_DISTRIBUTIONS:
        raise ValueError(f"unknown timestep distribution {dist!r}; one of {TIMESTEP_DISTRIBUTIONS}")
    # torch inside: validate reads this module's rules without torch
    from diffusers.training_utils import compute_density_for_timestep_sampling
    u = compute_density_for_timestep_sampling(
        weighting_scheme=dist, batch_size=batch_size, logit_mean=float(cfg_value(cfg, "logit_mean", 0.0)),
        logit_std=float(cfg_value(cfg, "logit_std", 1.0)), mode_scale=float(cfg_value(cfg, "mode_scale", 1.29)),
        device=generator_device(generator) or "cpu", generator=generator)
    t = lo + (u.clamp(0.0, 1.0) * (hi - lo)).long()
    return t.clamp(lo, hi - 1)


def choose_mask(mask, cfg: Any, generator):
    """The mask to use this micro-batch, or None.

    With ``unmasked_probability`` p > 0 one number is drawn from ``generator`` per micro-batch that has
    a mask: below p, the mask is ignored for this step (the model still sees the whole image now and
    then, which keeps backgrounds from decaying). Deterministic, so resume is exact.
    """
    import torch  # torch inside: validate reads this module's rules without torch
    if mask is None:
        return None
    p = float(cfg_value(cfg, "unmasked_probability", 0.0))
    if p > 0 and torch.rand((1,), generator=generator).item() < p:
        return None
    return mask


# ------------------------------------------------------------------------------------------
# the loss
# ------------------------------------------------------------------------------------------

def snr(noise_scheduler, timesteps):
    """SNR(t) = ᾱ_t / (1 − ᾱ_t), from diffusers' ``compute_snr``."""
    from diffusers.training_utils import compute_snr  # torch inside: validate reads this module's rules without torch
    return compute_snr(noise_scheduler, timesteps)


def huber_delta(cfg: Any, timesteps, noise_scheduler):
    """Per-sample δ for huber / smooth_l1 under ``huber_schedule`` (see the module docstring)."""
    import torch  # torch inside: validate reads this module's rules without torch
    c = float(cfg_value(cfg, "huber_delta", 0.1))
    schedule = cfg_value(cfg, "huber_schedule", "constant")
    t = timesteps.float()
    if schedule == "constant":
        return torch.full_like(t, c)
    if schedule == "exponential":
        total = int(noise_scheduler.config.num_train_timesteps)
        return torch.exp(math.log(c) * t / total)
    if schedule == "snr":
        ac = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
        sigmas = ((1.0 - ac) / ac) ** 0.5
        return (1.0 - c) / (1.0 + sigmas) ** 2 + c
    raise ValueError(f"unknown huber schedule {schedule!r}; one of {HUBER_SCHEDULES}")


def elementwise_loss(pred, target, loss_type: str = "mse", delta=None):
    """The unreduced loss, same shape as ``pred``; ``delta`` is a [B] tensor for huber/smooth_l1."""
    diff = pred.float() - target.float()
    if loss_type == "mse":
        return diff ** 2
    if loss_type == "mae":
        return diff.abs()
    if loss_type in ("huber", "smooth_l1"):
        if delta is None:
            raise ValueError(f"{loss_type} needs delta")
        c = delta.float().view(-1, *([1] * (diff.ndim - 1)))
        sq = diff ** 2
        core = sq / ((sq + c ** 2).sqrt() + c)  # = √(d²+δ²) − δ without fp32 cancellation for small d
        return 2 * c * core if loss_type == "huber" else 2 * core
    raise ValueError(f"unknown loss type {loss_type!r}; one of {LOSS_TYPES}")


def timestep_weights(cfg: Any, timesteps, noise_scheduler, prediction_type: Optional[str] = None):
    """Per-sample weights from min-SNR-γ and debiased estimation, or None when both are off."""
    import torch  # torch inside: validate reads this module's rules without torch
    gamma = float(cfg_value(cfg, "min_snr_gamma", 0.0))
    debiased = bool(cfg_value(cfg, "debiased_estimation", False))
    if gamma <= 0 and not debiased:
        return None
    pred = prediction_type or noise_scheduler.config.get("prediction_type", "epsilon")
    if pred not in ("epsilon", "v_prediction"):
        raise ValueError(f"SNR weighting is defined for epsilon and v_prediction, not {pred!r}")
    s = snr(noise_scheduler, timesteps).float()
    w = torch.ones_like(s)
    if gamma > 0:
        if pred == "epsilon":
            w = w * torch.clamp(gamma / s, max=1.0)  # = min(SNR, γ)/SNR, and 1 at SNR = 0
        else:
            w = w * torch.clamp(s, max=gamma) / (s + 1.0)
    if debiased:
        s_cap = torch.clamp(s, min=1e-3, max=SNR_CAP)
        w = w * (1.0 / (s_cap + 1.0) if pred == "v_prediction" else 1.0 / s_cap.sqrt())
    return w


def mask_weights(mask, loss_shape, unmasked_weight: float):
    """clamp(mask, unmasked_weight, 1) resized (area) to the loss's spatial size, shape [B,1,h,w] ([B,1,f,h,w] for
    video latents: an image's mask holds for every frame of its clip)."""
    import torch.nn.functional as F  # torch inside: validate reads this module's rules without torch
    m = mask.float()
    if m.ndim == 3:
        m = m.unsqueeze(1)
    if len(loss_shape) == 5 and m.ndim == 4:
        m = m.unsqueeze(2)
    size = tuple(loss_shape[2:]) if m.ndim == 5 else tuple(loss_shape[-2:])
    if tuple(m.shape[2:]) != size:
        m = F.interpolate(m, size=size, mode="area")
    if m.shape[1] != 1:
        m = m.mean(dim=1, keepdim=True)
    return m.clamp(min=float(unmasked_weight), max=1.0)


def per_sample_loss(pred, target, cfg: Any, timesteps, objective, mask=None,
                    prediction_type: Optional[str] = None):
    """One loss value per sample: element loss (× mask) averaged over C,H,W, × timestep weights.

    ``cfg`` is a ``LossConfig`` (or anything with its fields); ``objective`` the family's objective
    (``trainer.objectives``), or a DDPM noise scheduler (its ``prediction_type`` defaults to the
    scheduler's config, which the model family keeps in step with the model).
    """
    if hasattr(objective, "timestep_weights"):
        delta_of, weights_of = objective.huber_delta, objective.timestep_weights
    else:  # a DDPM noise scheduler: what trainer.objectives.DDPMObjective computes from it
        pred_type = prediction_type or objective.config.get("prediction_type", "epsilon")
        delta_of = lambda lc, t: huber_delta(lc, t, objective)  # noqa: E731
        weights_of = lambda lc, t: timestep_weights(lc, t, objective, pred_type)  # noqa: E731
    loss_type = cfg_value(cfg, "type", "mse")
    delta = delta_of(cfg, timesteps) if loss_type in ("huber", "smooth_l1") else None
    loss = elementwise_loss(pred, target, loss_type, delta)
    reduce_dims = tuple(range(1, loss.ndim))
    if mask is not None:
        w = mask_weights(mask.to(loss.device), loss.shape, float(cfg_value(cfg, "unmasked_weight", 0.0)))
        loss = loss * w
        per_sample = loss.mean(dim=reduce_dims)
        if bool(cfg_value(cfg, "normalize_masked_area_loss", False)):
            per_sample = per_sample / w.mean(dim=tuple(range(1, w.ndim))).clamp(min=1e-8)
    else:
        per_sample = loss.mean(dim=reduce_dims)
    tw = weights_of(cfg, timesteps)
    if tw is not None:
        per_sample = per_sample * tw.to(per_sample.device)
    return per_sample


def weighted_mean(per_sample, weights=None):
    """Batch mean of per-sample losses, each multiplied by its concept's loss weight."""
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample.device, per_sample.dtype)
    return per_sample.mean()


# ------------------------------------------------------------------------------------------
# set-up
# ------------------------------------------------------------------------------------------

def prepare_noise_schedule(model, cfg: Any, warn=None) -> None:
    """Apply schedule-changing options to the model before training (zero-terminal-SNR rescale)."""
    if not cfg_value(cfg, "zero_terminal_snr", False):
        return
    model.rescale_zero_terminal_snr()
    if warn is not None and getattr(model, "prediction_type", "") != "v_prediction":
        warn("loss.zero_terminal_snr is on with an epsilon-prediction model: at the last timestep the "
             "input is pure noise and epsilon is unlearnable. Zero terminal SNR wants v-prediction "
             "(set model.prediction_type = v_prediction).")


# --------------------------------------------------------------------------------------------
# learned variance (PixArt): the variational-bound term that trains the variance half of the output
# --------------------------------------------------------------------------------------------

def _normal_cdf_approx(x):
    import torch  # torch inside: validate reads this module's rules without torch
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def variational_bound(alphas_cumprod, x0, xt, timesteps, eps, var_values):
    """Per-element variational-bound term (in bits) of a model that predicts ε and, in [-1, 1], where its
    log-variance lies between the posterior's (β̃_t, -1) and β_t (+1) — Improved DDPM (Nichol & Dhariwal
    2021), as PixArt was trained and OneTrainer trains it. For t > 0 the KL between the true posterior
    q(x_{t-1} | x_t, x_0) and the model's p(x_{t-1} | x_t); for t = 0 the discretised decoder NLL of x_0.

    ε is detached: only the variance learns from this term; the mean keeps the plain ε loss."""
    import torch  # torch inside: validate reads this module's rules without torch
    a = alphas_cumprod.to(device=xt.device, dtype=torch.float64)
    t = timesteps.to(device=xt.device, dtype=torch.long)
    prev = torch.cat([a.new_ones(1), a[:-1]])
    betas = 1.0 - a / prev
    post_var = betas * (1.0 - prev) / (1.0 - a)
    post_log_var = torch.log(torch.cat([post_var[1:2], post_var[1:]]))  # clipped: β̃_0 = 0 would be -inf
    coef_x0 = betas * prev.sqrt() / (1.0 - a)
    coef_xt = (1.0 - prev) * (1.0 - betas).sqrt() / (1.0 - a)

    def at(table):
        return table[t].view(-1, *([1] * (xt.dim() - 1))).to(torch.float32)

    x0, xt = x0.float(), xt.float()
    eps, var_values = eps.detach().float(), var_values.float()
    true_mean = at(coef_x0) * x0 + at(coef_xt) * xt
    true_log_var = at(post_log_var)
    x0_pred = at(1.0 / a.sqrt()) * xt - at((1.0 / a - 1.0).sqrt()) * eps
    mean = at(coef_x0) * x0_pred + at(coef_xt) * xt
    frac = (var_values + 1.0) / 2.0
    log_var = frac * at(torch.log(betas)) + (1.0 - frac) * true_log_var
    kl = 0.5 * (-1.0 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                + (true_mean - mean) ** 2 * torch.exp(-log_var)) / math.log(2.0)
    # t = 0: -log p(x_0 | x_1), x_0 discretised to 256 levels in [-1, 1]
    centred, inv_std = x0 - mean, torch.exp(-0.5 * log_var)
    cdf_plus = _normal_cdf_approx(inv_std * (centred + 1.0 / 255.0))
    cdf_min = _normal_cdf_approx(inv_std * (centred - 1.0 / 255.0))
    log_probs = torch.where(x0 < -0.999, torch.log(cdf_plus.clamp(min=1e-12)),
                            torch.where(x0 > 0.999, torch.log((1.0 - cdf_min).clamp(min=1e-12)),
                                        torch.log((cdf_plus - cdf_min).clamp(min=1e-12))))
    nll = -log_probs / math.log(2.0)
    return torch.where(t.view(-1, *([1] * (xt.dim() - 1))) == 0, nll, kl)


# ------------------------------------------------------------------------------------------
# rules (trainer.config.checks calls them; torch-free)
# ------------------------------------------------------------------------------------------

def check_loss(cfg: Any) -> None:
    """Hard rules of the loss section (``validate``); raises ConfigError naming the field."""
    lc = cfg.loss
    if lc.timestep_min >= lc.timestep_max:
        raise ConfigError(f"loss.timestep_min ({lc.timestep_min}) must be below loss.timestep_max "
                          f"({lc.timestep_max}).", key="loss.timestep_min", value=lc.timestep_min)
    if lc.type in ("huber", "smooth_l1") and lc.huber_schedule != "constant" and lc.huber_delta > 1:
        raise ConfigError(f"loss.huber_delta = {lc.huber_delta:g} with huber_schedule = {lc.huber_schedule}: the "
                          "schedule goes from 1 down to huber_delta, so it must be at most 1 (0.1 is typical). "
                          "Use huber_schedule = constant for a larger δ.", key="loss.huber_delta",
                          value=lc.huber_delta)


def loss_warnings(cfg: Any) -> List[Issue]:
    """Community rules on the loss settings, shown before launch."""
    out: List[Issue] = []
    lc = cfg.loss
    if lc.zero_terminal_snr and cfg.model.prediction_type != "v_prediction":
        out.append(Issue("loss.zero_terminal_snr",
                         "Zero terminal SNR wants v-prediction: at the last timestep the input is pure noise, "
                         "so epsilon cannot be learned there. Set model.prediction_type = v_prediction"
                         + (" (fine as is if auto finds a v-prediction model)."
                            if cfg.model.prediction_type == "auto" else ".")))
    if lc.min_snr_gamma > 0 and lc.debiased_estimation:
        out.append(Issue("loss.debiased_estimation", "Min-SNR-γ and debiased estimation both reweight "
                                                     "timesteps and multiply; usually pick one."))
    if lc.type == "mse" and lc.huber_delta != 0.1:
        out.append(Issue("loss.huber_delta", "huber_delta only matters with loss.type = huber or smooth_l1."))
    return out
