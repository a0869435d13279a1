"""Stable Diffusion 1.x / 2.x (512 epsilon and 768 v-prediction) on diffusers classes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.models.base import ModelFamily, ModelLoadError, ModelSource, classify_source, torch_dtype

log = logging.getLogger("atelier")

SAMPLERS = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
}


def _load_pipeline(source: ModelSource, mcfg, workspace: str):
    """Load a StableDiffusionPipeline from any of the three source kinds, offline-safe."""
    from diffusers import StableDiffusionPipeline

    common = dict(safety_checker=None, requires_safety_checker=False)
    if source.kind == "folder":
        return StableDiffusionPipeline.from_pretrained(source.location, local_files_only=True, **common)
    if source.kind == "single_file":
        from trainer.models import sd_configs
        path = Path(source.location)
        try:
            family = sd_configs.detect_family(path)
        except ValueError as exc:
            raise ModelLoadError(f"model.path '{source.display}': {exc}", key="model.path") from None
        if family not in ("sd15", "sd2"):
            raise ModelLoadError(f"model.path '{source.display}' looks like a {family} model; this run "
                                 f"is set up for SD 1.x/2.x. Pick the {family} preset (or set model.family).",
                                 key="model.path", value=source.display)
        if mcfg.family != "auto" and mcfg.family != family:
            raise ModelLoadError(f"model.family is {mcfg.family}, but '{source.display}' holds a {family} "
                                 f"model. Set model.family to {family} or auto.", key="model.family",
                                 value=mcfg.family)
        if mcfg.config_path:
            config = mcfg.config_path
        else:
            name = sd_configs.default_config_for(family, mcfg.prediction_type)
            config = str(sd_configs.config_folder(name, Path(workspace) / "cache"))
        try:
            return StableDiffusionPipeline.from_single_file(str(path), config=config, local_files_only=True,
                                                            **common)
        except Exception as exc:  # diffusers raises many kinds here
            raise ModelLoadError(f"Could not load '{source.display}' as a single-file {family} checkpoint "
                                 f"(config {config}): {exc}", key="model.path") from None
    # hub id
    kwargs: Dict[str, Any] = dict(local_files_only=bool(mcfg.hub_offline))
    if mcfg.cache_dir:
        kwargs["cache_dir"] = mcfg.cache_dir
    if mcfg.revision:
        kwargs["revision"] = mcfg.revision
    try:
        return StableDiffusionPipeline.from_pretrained(source.location, **kwargs, **common)
    except Exception as exc:
        if mcfg.hub_offline:
            raise ModelLoadError(
                f"model.path '{source.location}' is a hub id, but it is not in the hub cache"
                f"{' ' + mcfg.cache_dir if mcfg.cache_dir else ''} and model.hub_offline is on. Download it "
                "once with model.hub_offline off, or point model.path at a local folder or file.",
                key="model.path", value=source.location) from None
        raise ModelLoadError(f"Could not download or load '{source.location}' from the hub: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
                             "Check the id, your network and (for gated models) your HF token.",
                             key="model.path", value=source.location) from None


def _family_of(source: ModelSource, unet) -> str:
    """sd15 or sd2, from the files where possible (tiny models have no tell-tale widths)."""
    if source.kind in ("folder", "single_file"):
        from trainer.models import sd_configs
        try:
            fam = sd_configs.detect_family(Path(source.location))
            if fam in ("sd15", "sd2"):
                return fam
        except (ValueError, OSError):
            pass
    cfg = unet.config
    return "sd2" if cfg.cross_attention_dim >= 1024 or cfg.use_linear_projection else "sd15"


class StableDiffusion(ModelFamily):
    """SD 1.x / 2.x components plus the pieces of the diffusion objective the loop needs."""

    def __init__(self, mcfg, workspace: str, device: Any = "cpu"):
        import torch
        from diffusers import DDPMScheduler

        self.source = classify_source(mcfg.path, workspace)
        pipe = _load_pipeline(self.source, mcfg, workspace)
        self.tokenizer = pipe.tokenizer
        self.text_encoder = pipe.text_encoder
        self.unet = pipe.unet
        self.vae = pipe.vae
        in_ch = self.unet.config.in_channels
        if in_ch != 4:
            raise ModelLoadError(f"'{self.source.display}' has a {in_ch}-channel UNet (an inpainting model?); "
                                 "inpainting training is not supported yet.", key="model.path")
        self.family = _family_of(self.source, self.unet)
        self.noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        pred = mcfg.prediction_type
        if pred == "auto":
            pred = self.noise_scheduler.config.get("prediction_type", "epsilon")
        self.prediction_type = pred
        self.noise_scheduler.register_to_config(prediction_type=pred)
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_config["prediction_type"] = pred
        self.device = torch.device(device)
        self.unet.to(self.device, dtype=torch_dtype(mcfg.unet_dtype))
        self.text_encoder.to(self.device, dtype=torch_dtype(mcfg.text_encoder_dtype))
        self.vae.to(self.device, dtype=torch_dtype(mcfg.vae_dtype))
        for m in (self.unet, self.text_encoder, self.vae):
            m.requires_grad_(False)
        self.vae.eval()
        self.text_encoder.eval()
        if mcfg.attention == "xformers":
            try:
                self.unet.enable_xformers_memory_efficient_attention()
            except Exception as exc:
                raise ModelLoadError(f"model.attention = xformers, but xformers is not usable here ({exc}). "
                                     "Use sdpa.", key="model.attention") from None
        self._fingerprint_src = f"{self.source.kind}:{self.source.location}:{mcfg.vae_dtype}"
        alphas = self.noise_scheduler.alphas_cumprod
        self.num_train_timesteps = int(self.noise_scheduler.config.num_train_timesteps)
        self._alphas = alphas

    # --- text ---------------------------------------------------------------------------
    def tokenize(self, captions: List[str]):
        return self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids

    def encode_text(self, input_ids):
        return self.text_encoder(input_ids.to(self.device))[0]

    # --- images -------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """VAE posterior (mean, std) in fp32: cached as is, sampled every step."""
        import torch
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        return {"mean": dist.mean.float().cpu(), "std": dist.std.float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        import torch
        mean = dist["mean"].to(self.device)
        std = dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(self.device)
        return (mean + std * eps) * self.vae.config.scaling_factor

    # --- objective ----------------------------------------------------------------------
    def noisy_and_target(self, latents, noise, timesteps):
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        elif self.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"unknown prediction type {self.prediction_type}")
        return noisy, target

    def rescale_zero_terminal_snr(self) -> None:
        """Rescale the betas so the last timestep is pure noise (Lin et al. 2023, diffusers'
        ``rescale_betas_zero_snr``); samplers get the same schedule with trailing timestep spacing."""
        from diffusers import DDPMScheduler
        self.noise_scheduler = DDPMScheduler.from_config(self.noise_scheduler.config, rescale_betas_zero_snr=True)
        self._sched_config.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        self._alphas = self.noise_scheduler.alphas_cumprod

    def predict(self, noisy_latents, timesteps, conditioning):
        return self.unet(noisy_latents, timesteps, conditioning, return_dict=False)[0]

    # --- sampling -----------------------------------------------------------------------
    def pipeline(self, sampler: str = "ddim"):
        import diffusers
        from diffusers import StableDiffusionPipeline
        sched_cls = getattr(diffusers, SAMPLERS[sampler])
        scheduler = sched_cls.from_config(self._sched_config)
        pipe = StableDiffusionPipeline(vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                       unet=self.unet, scheduler=scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def fingerprint(self) -> str:
        """Identifies what changes cached latents: the weights' source and the VAE dtype."""
        h = hashlib.sha256(self._fingerprint_src.encode())
        p = Path(self.source.location)
        if p.exists():
            target = p / "vae" if (p / "vae").is_dir() else p
            for fp in sorted(target.glob("*")) if target.is_dir() else [target]:
                st = fp.stat()
                h.update(f"{fp.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]


def load_model(mcfg, workspace: str, device: Any = "cpu") -> StableDiffusion:
    return StableDiffusion(mcfg, workspace, device)
