"""The base class the SD 1.x/2.x and SDXL families share (one UNet lineage): DDPM schedule and objective,
VAE latents, inpainting input, zero-terminal-SNR rescale. Part of the SD-lineage kit both family folders use."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from diffusers import DDPMScheduler

from trainer.errors import ModelLoadError
from trainer.families.base import Family as ModelFamily, Namer
from trainer.families.common.sd_kit.inpaint import InpaintingMixin
from trainer.families.common.sd_kit.keys import save_single_file_sd, sd_namer
from trainer.families.common.sd_kit.lora import TEXT_ENCODER_TARGETS, UNET_TARGETS, lora_metadata
from trainer.families.sources import ModelSource, source_fingerprint
from trainer.objectives import DDPMObjective

FAMILY_NAMES = {"sd15": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL", "sd15-inpaint": "SD 1.x inpainting",
                "sd2-inpaint": "SD 2.x inpainting", "sdxl-inpaint": "SDXL inpainting"}


def check_family(source: ModelSource, found: Optional[str], mcfg: Any, accepted: tuple, label: str) -> None:
    """Refuse weights of another family, naming the family they look like and what to set."""
    if found is None:
        return
    if found.endswith("-inpaint") and found.removesuffix("-inpaint") in accepted:
        found = found.removesuffix("-inpaint")  # inpainting variants load with their base family
    if found not in accepted:
        base = found.removesuffix("-inpaint")
        raise ModelLoadError(f"model.path '{source.display}' looks like {FAMILY_NAMES[found]} ({found}), but this "
                             f"run is set up for {label}. Set model.family to {base} (or auto), or use a "
                             f"{FAMILY_NAMES[base]} preset.", key="model.path", value=source.display)
    family = getattr(mcfg, "family", "auto")
    if family not in ("auto", found):
        raise ModelLoadError(f"model.family is {family}, but '{source.display}' holds a {FAMILY_NAMES[found]} "
                             f"({found}) model. Set model.family to {found} or auto.", key="model.family",
                             value=family)

class LatentDiffusionFamily(InpaintingMixin, ModelFamily):
    """The parts of the objective every VAE-latent, DDPM-trained UNet family shares (and, for
    9-channel inpainting UNets, the masked input: :class:`~trainer.families.common.sd_kit.inpaint.InpaintingMixin`).

    Needs ``self.vae``, ``self.device``, ``self.noise_scheduler``, ``self.prediction_type`` and
    ``self._sched_config`` (the sampling schedulers' config)."""

    def latent_shape(self, width: int, height: int) -> Tuple[int, ...]:
        """The VAE's latent for one image: its channels, the sides over the VAE's downsampling (no encode)."""
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        return (int(self.vae.config.latent_channels), height // factor, width // factor)

    def _setup_schedule(self, scheduler_config: Dict[str, Any], prediction_type: str) -> None:
        """Training schedule = the model's own betas in a DDPMScheduler; ``auto`` reads the prediction type."""
        self.noise_scheduler = DDPMScheduler.from_config(scheduler_config)
        pred = prediction_type
        if pred == "auto":
            pred = self.noise_scheduler.config.get("prediction_type", "epsilon")
        self.prediction_type = pred
        self.noise_scheduler.register_to_config(prediction_type=pred)
        self._sched_config = dict(scheduler_config)
        self._sched_config["prediction_type"] = pred
        self.num_train_timesteps = int(self.noise_scheduler.config.num_train_timesteps)
        self._alphas = self.noise_scheduler.alphas_cumprod
        self.objective = DDPMObjective(self.noise_scheduler, pred)

    def noisy_and_target(self, latents, noise, timesteps):
        return self.objective.noisy_and_target(latents, noise, timesteps)

    def model_input(self, noisy_latents, batch, generator=None, warn=None):
        """9-channel inpainting UNets: noisy ‖ mask ‖ masked-image latents; others the noisy latents."""
        return self.inpaint_input(noisy_latents, batch, generator, warn) if self.inpainting else noisy_latents

    def _set_attention(self, backend: str) -> None:
        """``model.attention``: PyTorch SDPA (diffusers' default) or xformers, refused clearly when absent."""
        if backend == "xformers":
            try:
                self.unet.enable_xformers_memory_efficient_attention()
            except Exception as exc:
                raise ModelLoadError(f"model.attention = xformers, but xformers is not usable here ({exc}). "
                                     "Use sdpa.", key="model.attention") from None

    def sampling_kwargs(self) -> Dict[str, Any]:
        """Extra arguments for ``pipeline(...)(prompt, ...)`` so samples see what training saw."""
        return {"clip_skip": self.clip_skip} if getattr(self, "clip_skip", 0) else {}

    # --- export (the generic writers of trainer/formats, named by the SD kit's keys and lora) ---------
    targets: Dict[str, List[str]] = UNET_TARGETS  # parts.denoiser.lora_targets preset -> UNet module-name endings

    def lora_targets(self, slot: str, preset: str) -> List[str]:
        """peft target name endings: the UNet's for ``parts.denoiser.lora_targets`` presets; CLIP's for text encoders."""
        return list(self.targets[preset]) if slot == "unet" else list(TEXT_ENCODER_TARGETS)

    def lora_namer(self) -> Namer:
        return sd_namer(self.family, self.unet, self.text_encoder, getattr(self, "text_encoder_2", None))

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        return lora_metadata(self.family, title=title, prediction_type=self.prediction_type, resolution=resolution,
                             extra=extra)

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """An original-layout SD1/SD2/SDXL checkpoint (A1111, ComfyUI, diffusers' from_single_file)."""
        extra = {"text_encoder_2": self.text_encoder_2} if getattr(self, "text_encoder_2", None) is not None else {}
        save_single_file_sd(path, self.unet, self.vae, self.text_encoder, family=self.family, dtype=dtype,
                            metadata=metadata, **extra)

    def fingerprint(self) -> str:
        """Identifies what changes cached latents: the weights' source and the VAE dtype."""
        return source_fingerprint(self.source, self._vae_dtype_name)

    def rescale_zero_terminal_snr(self) -> None:
        """Rescale the betas so the last timestep is pure noise (Lin et al. 2023, diffusers'
        ``rescale_betas_zero_snr``); samplers get the same schedule with trailing timestep spacing."""
        self.noise_scheduler = DDPMScheduler.from_config(self.noise_scheduler.config, rescale_betas_zero_snr=True)
        self._sched_config.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        self._alphas = self.noise_scheduler.alphas_cumprod
        self.objective.noise_scheduler = self.noise_scheduler


