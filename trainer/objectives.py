"""The diffusion objectives, in one place: which timesteps are drawn, what the denoiser sees, what it
must predict, and how each sample's loss is weighted. A family picks one (``FamilyInfo.objective``)
and the loop calls only these methods, as diffusers' training examples do::

    timesteps     = objective.sample_timesteps(bsz, cfg.loss, generator, latents)
    noisy, target = objective.noisy_and_target(latents, noise, timesteps)
    weights       = objective.timestep_weights(cfg.loss, timesteps)          # or None

- :class:`DDPMObjective`: integer timesteps of the model's own β schedule, ε- or v-prediction;
  min-SNR-γ, debiased estimation, the Huber δ schedules and zero terminal SNR (see trainer/loss.py
  for the formulas and sources).
- :class:`CosineObjective` (Würstchen 2, Stable Cascade stage C): continuous t ∈ [0, 1] on their cosine
  schedule (diffusers' ``DDPMWuerstchenScheduler``: ᾱ(t) = cos²((t + s)/(1 + s)·π/2) / cos²(s/(1 + s)·π/2),
  s = 0.008, clamped to [1e-4, 0.9999]), ε-prediction, the P2 loss weight (1 + SNR)^-1 = 1 − ᾱ(t) that the
  Würstchen training code (``p2_weight``) and kohya's Stable Cascade trainer (``P2LossWeight``) use.
- :class:`FlowMatchingObjective` (rectified flow, SD3/Flux): σ ∈ (0, 1) from a uniform, logit-normal
  or mode density (diffusers' ``compute_density_for_timestep_sampling``), shifted by a fixed shift or, on
  request (``loss.resolution_shift``, kohya's ``flux_shift``), by the resolution-dependent shift μ(image tokens)
  the sampler of Flux.1 dev, Chroma and Qwen-Image uses (``FluxPipeline``'s ``calculate_shift`` and the scheduler's
  exponential time shift); unshifted there by default, as diffusers' trainers draw;
  noisy = (1 − σ)·x + σ·ε, target = ε − x; SD3's loss weightings (``compute_loss_weighting_for_sd3``).

Every draw comes from the trainer's generator, so a resumed run draws exactly what an uninterrupted
one would.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

from trainer.errors import ConfigError
from trainer.loss import cfg_value, generator_device, huber_delta, sample_timesteps, timestep_weights

FLOW_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")

# Loss options that only mean something for the DDPM objective: (field, value that means "off", why)
DDPM_ONLY = (
    ("min_snr_gamma", 0.0, "min-SNR-γ weights by the DDPM signal-to-noise ratio"),
    ("debiased_estimation", False, "debiased estimation weights by the DDPM signal-to-noise ratio"),
    ("zero_terminal_snr", False, "zero terminal SNR rescales a DDPM β schedule"),
)
FLOW_ONLY = (
    ("flow_weighting", "none", "SD3-style loss weighting is defined on flow-matching σ"),
    ("flow_shift", 0.0, "the timestep shift is a flow-matching option"),
    ("resolution_shift", False, "the resolution-dependent shift is a flow-matching option"),
    ("precondition_outputs", False, "preconditioned outputs (x̂0 = x_σ − σ·v̂) are defined for flow matching"),
)
COSINE_ONLY = (
    ("cosine_timesteps", "uniform", "the original recipe's t draw is Würstchen's and Stable Cascade's"),
)


OBJECTIVE_NAMES = {"ddpm": "the DDPM objective", "flow": "flow matching",
                   "cosine": "the continuous cosine schedule of Würstchen"}


def refused_options(objective: str, lc: Any, family_label: str) -> list:
    """(key, message) for every ``loss.*`` option that makes no sense with ``objective``
    ("ddpm"/"flow"/"cosine")."""
    problems = []
    rules = {"flow": DDPM_ONLY + COSINE_ONLY, "ddpm": FLOW_ONLY + COSINE_ONLY,
             "cosine": DDPM_ONLY + FLOW_ONLY}[objective]
    for name, off, why in rules:
        value = cfg_value(lc, name, off)
        if value != off and not (isinstance(off, float) and float(value) == off):
            problems.append((f"loss.{name}", f"loss.{name} = {value}: {why}, and {family_label} trains with "
                             f"{OBJECTIVE_NAMES[objective]}. Set it back to {off}."))
    if objective != "ddpm" and cfg_value(lc, "type", "mse") in ("huber", "smooth_l1") \
            and cfg_value(lc, "huber_schedule", "constant") == "snr":
        problems.append(("loss.huber_schedule", f"loss.huber_schedule = snr reads the DDPM noise schedule; "
                         f"{family_label} trains with {OBJECTIVE_NAMES[objective]}. Use constant or exponential."))
    return problems


class DDPMObjective:
    """ε/v-prediction on a DDPM β schedule (``diffusers.DDPMScheduler``)."""

    kind = "ddpm"

    def __init__(self, noise_scheduler: Any, prediction_type: str):
        self.noise_scheduler = noise_scheduler
        self.prediction_type = prediction_type

    @property
    def num_train_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    def sample_timesteps(self, batch_size: int, lc: Any, generator, latents=None):
        return sample_timesteps(batch_size, self.num_train_timesteps, lc, generator)

    def noisy_and_target(self, latents, noise, timesteps):
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            return noisy, noise
        if self.prediction_type == "v_prediction":
            return noisy, self.noise_scheduler.get_velocity(latents, noise, timesteps)
        raise ValueError(f"unknown prediction type {self.prediction_type}")

    def timestep_weights(self, lc: Any, timesteps):
        return timestep_weights(lc, timesteps, self.noise_scheduler, self.prediction_type)

    def huber_delta(self, lc: Any, timesteps):
        return huber_delta(lc, timesteps, self.noise_scheduler)


def flux_shift_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                  base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """μ for the resolution-dependent shift: linear in the number of image tokens between
    (base_seq_len, base_shift) and (max_seq_len, max_shift) — ``diffusers.pipelines.flux.calculate_shift``."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def flow_objective_for(scheduler_config: dict, patch: int = 2) -> "FlowMatchingObjective":
    """The flow objective a ``FlowMatchEulerDiscreteScheduler`` config describes: its fixed shift, or (with
    ``use_dynamic_shifting``: Flux.1 dev, Chroma, Qwen-Image) none, as diffusers' trainers draw — the scheduler skips
    its shift there, and the pipeline shifts by μ at sampling — with the pipeline's resolution-dependent μ of the
    image-token count (latents packed ``patch``×``patch``) kept for ``loss.resolution_shift``."""
    cfg = scheduler_config
    if not cfg.get("use_dynamic_shifting", False):
        return FlowMatchingObjective(shift=float(cfg.get("shift", 1.0)))

    def mu(latents) -> float:
        return flux_shift_mu(latents.shape[-2] * latents.shape[-1] // patch ** 2, int(cfg.get("base_image_seq_len", 256)),
                             int(cfg.get("max_image_seq_len", 4096)), float(cfg.get("base_shift", 0.5)),
                             float(cfg.get("max_shift", 1.15)))
    return FlowMatchingObjective(dynamic_shift=mu)


class FlowMatchingObjective:
    """Rectified flow: x_σ = (1 − σ)·x + σ·ε, target ε − x; ``timesteps`` are σ ∈ (0, 1) (float).

    ``shift``: a fixed shift s (σ' = s·σ / (1 + (s − 1)·σ)), 1 = none. ``dynamic_shift``: a function
    latents → μ (resolution-dependent, e.g. Flux.1 dev), used when ``loss.resolution_shift`` is on and
    ``loss.flow_shift`` is 0 (auto): σ' = e^μ / (e^μ + 1/σ − 1), kohya's ``flux_shift``. ``loss.flow_shift`` > 0
    overrides both with a fixed shift."""

    kind = "flow"
    prediction_type = "flow"
    num_train_timesteps = 1000

    def __init__(self, shift: float = 1.0, dynamic_shift: Optional[Callable[[Any], float]] = None,
                 default_distribution: str = "uniform", sigma_range: Optional[Tuple[float, float]] = None):
        self.shift = float(shift)
        self.dynamic_shift = dynamic_shift
        self.default_distribution = default_distribution  # what loss.timestep_distribution = auto draws
        # [σ_lo, σ_hi): the only σ drawn (one expert of a two-expert model, Wan 2.2 A14B), a fixed shift only
        self.sigma_range = sigma_range

    def _u_of(self, sigma: float, lc: Any) -> float:
        """The unshifted u whose fixed shift is ``sigma`` (the shift is monotonic: a σ range is a u range)."""
        fixed = float(cfg_value(lc, "flow_shift", 0.0) or 0.0)
        s = fixed if fixed > 0 else self.shift
        return sigma / (s - (s - 1) * sigma)

    def _shifted(self, sigmas, lc: Any, latents):
        import torch  # torch inside: validate reads the objectives' rules without torch
        fixed = float(cfg_value(lc, "flow_shift", 0.0) or 0.0)
        by_size = bool(cfg_value(lc, "resolution_shift", False))
        if fixed > 0 or self.dynamic_shift is None or not by_size or latents is None:
            s = fixed if fixed > 0 else self.shift
            return sigmas if s == 1.0 else s * sigmas / (1 + (s - 1) * sigmas)
        mu = float(self.dynamic_shift(latents))  # σ' = e^μ / (e^μ + 1/σ − 1)
        return (math.exp(mu) / (math.exp(mu) + (1 / sigmas.clamp(min=1e-6) - 1))).to(torch.float32)

    def sample_timesteps(self, batch_size: int, lc: Any, generator, latents=None):
        """σ for each sample: u from ``loss.timestep_distribution`` within [timestep_min, timestep_max)/1000,
        then shifted."""
        import torch  # torch inside: validate reads the objectives' rules without torch
        lo = int(cfg_value(lc, "timestep_min", 0)) / self.num_train_timesteps
        hi = min(int(cfg_value(lc, "timestep_max", self.num_train_timesteps)), self.num_train_timesteps) \
            / self.num_train_timesteps
        if not 0 <= lo < hi:
            raise ConfigError(f"loss.timestep_min ({cfg_value(lc, 'timestep_min', 0)}) must be below loss.timestep_max.",
                              key="loss.timestep_min")
        if self.sigma_range is not None:  # the expert's σ range, as a range of u before the shift
            lo, hi = max(lo, self._u_of(self.sigma_range[0], lc)), min(hi, self._u_of(self.sigma_range[1], lc))
            if not lo < hi:
                raise ConfigError(f"loss.timestep_min/max leave nothing of the trained expert's range (σ "
                                  f"{self.sigma_range[0]:g}–{self.sigma_range[1]:g}).", key="loss.timestep_min")
        dist = cfg_value(lc, "timestep_distribution", "auto")
        dist = self.default_distribution if dist == "auto" else dist
        if dist == "uniform":
            u = torch.rand((batch_size,), generator=generator, device=generator_device(generator))
        else:
            # torch inside: validate reads the objectives' rules without torch
            from diffusers.training_utils import compute_density_for_timestep_sampling
            u = compute_density_for_timestep_sampling(
                weighting_scheme=dist, batch_size=batch_size, logit_mean=float(cfg_value(lc, "logit_mean", 0.0)),
                logit_std=float(cfg_value(lc, "logit_std", 1.0)), mode_scale=float(cfg_value(lc, "mode_scale", 1.29)),
                device=generator_device(generator) or "cpu", generator=generator)
        u = lo + u.clamp(0.0, 1.0) * (hi - lo)
        sigmas = self._shifted(u.float().clamp(1e-5, 1.0), lc, latents)
        return sigmas.to(latents.device if latents is not None else "cpu")

    def noisy_and_target(self, latents, noise, timesteps):
        s = timesteps.to(latents.device, latents.dtype).view(-1, *([1] * (latents.ndim - 1)))
        return (1.0 - s) * latents + s * noise, noise - latents

    def preconditioned(self, model_pred, noisy, clean, timesteps):
        """``loss.precondition_outputs``: (x̂0, x0) = (x_σ − σ·v̂, the clean latents), as diffusers' SD3 trainer's
        ``model_pred * (-sigmas) + noisy_model_input`` against ``model_input``."""
        s = timesteps.to(model_pred.device, model_pred.dtype).view(-1, *([1] * (model_pred.ndim - 1)))
        return noisy.to(model_pred.dtype) - s * model_pred, clean.to(model_pred.dtype)

    def timestep_weights(self, lc: Any, timesteps):
        scheme = cfg_value(lc, "flow_weighting", "none")
        if scheme in (None, "none"):
            return None
        # torch inside: validate reads the objectives' rules without torch
        from diffusers.training_utils import compute_loss_weighting_for_sd3
        return compute_loss_weighting_for_sd3(scheme, timesteps.float())

    def huber_delta(self, lc: Any, timesteps):
        """δ per sample: constant, or exponential in σ (1 at σ = 0 → δ at σ = 1)."""
        import torch  # torch inside: validate reads the objectives' rules without torch
        c = float(cfg_value(lc, "huber_delta", 0.1))
        schedule = cfg_value(lc, "huber_schedule", "constant")
        if schedule == "exponential":
            return torch.exp(math.log(c) * timesteps.float())
        if schedule == "constant":
            return torch.full_like(timesteps.float(), c)
        raise ValueError(f"loss.huber_schedule = {schedule} is not defined for flow matching")


class CosineObjective:
    """Würstchen 2 / Stable Cascade priors: t ∈ [0, 1] (float, what the prior takes as its ratio ``r``),
    x_t = √ᾱ(t)·x + √(1 − ᾱ(t))·ε from diffusers' ``DDPMWuerstchenScheduler`` (the schedule their pipelines
    sample with), target ε, every sample weighted by P2 (k = 1, γ = 1): (1 + SNR(t))^-1 = 1 − ᾱ(t)."""

    kind = "cosine"
    prediction_type = "epsilon"
    num_train_timesteps = 1000  # loss.timestep_min/max are read in thousandths of t

    def __init__(self, original_stretch: float = 1.0):
        """``original_stretch``: the original recipe's draw (``loss.cosine_timesteps = original``) is
        ``t·stretch + 0.001`` clamped to [0.001, 1] — 1.08 for Würstchen 2, 1 for Stable Cascade."""
        # torch inside: validate reads the objectives' rules without torch
        from diffusers import DDPMWuerstchenScheduler
        self.scheduler = DDPMWuerstchenScheduler()
        self.original_stretch = original_stretch

    def _on(self, device):
        """The scheduler, its schedule's two constant tensors on ``device``: it moves them there at every call (``s``
        twice and ``_init_alpha_cumprod``, made on the CPU: three blocking copies a call, six a step), here once."""
        sched = self.scheduler
        if self.__dict__.get("_constants_on") != str(device):
            sched.s, sched._init_alpha_cumprod = sched.s.to(device), sched._init_alpha_cumprod.to(device)
            self._constants_on = str(device)
        return sched

    def alpha_cumprod(self, timesteps):
        return self._on(timesteps.device)._alpha_cumprod(timesteps.float(), timesteps.device)

    def sample_timesteps(self, batch_size: int, lc: Any, generator, latents=None):
        """t uniform in [timestep_min, timestep_max)/1000, as the reference trainers draw it."""
        import torch  # torch inside: validate reads the objectives' rules without torch
        lo = int(cfg_value(lc, "timestep_min", 0)) / self.num_train_timesteps
        hi = min(int(cfg_value(lc, "timestep_max", self.num_train_timesteps)), self.num_train_timesteps) \
            / self.num_train_timesteps
        if not 0 <= lo < hi:
            raise ConfigError(f"loss.timestep_min ({cfg_value(lc, 'timestep_min', 0)}) must be below loss.timestep_max.",
                              key="loss.timestep_min")
        t = lo + torch.rand((batch_size,), generator=generator, device=generator_device(generator)) * (hi - lo)
        if cfg_value(lc, "cosine_timesteps", "uniform") == "original":  # OneTrainer's and the original trainers' draw
            t = (t * self.original_stretch + 0.001).clamp(0.001, 1.0)
        return t.to(latents.device if latents is not None else "cpu")

    def noisy_and_target(self, latents, noise, timesteps):
        return self._on(latents.device).add_noise(latents, noise, timesteps.to(latents.device)), noise

    def timestep_weights(self, lc: Any, timesteps):
        return 1.0 - self.alpha_cumprod(timesteps)

    def huber_delta(self, lc: Any, timesteps):
        """δ per sample: constant, or exponential in t (1 at t = 0 → δ at t = 1)."""
        import torch  # torch inside: validate reads the objectives' rules without torch
        c = float(cfg_value(lc, "huber_delta", 0.1))
        schedule = cfg_value(lc, "huber_schedule", "constant")
        if schedule == "exponential":
            return torch.exp(math.log(c) * timesteps.float())
        if schedule == "constant":
            return torch.full_like(timesteps.float(), c)
        raise ValueError(f"loss.huber_schedule = {schedule} is not defined for the cosine schedule")
