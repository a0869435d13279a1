"""Stable Diffusion 1.x / 2.x (512 epsilon and 768 v-prediction) on diffusers classes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List

import diffusers
import torch
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

from trainer.errors import ModelLoadError
from trainer.families import sources  # load_pipeline looked up at call time (the VRAM estimate swaps it)
from trainer.families.base import part_dtype, torch_dtype
from trainer.families.common.host_copy import flags_on, to_device
from trainer.families.common.samplers import SAMPLERS
from trainer.families.common.sd_kit import sd_configs
from trainer.families.common.sd_kit.family_base import LatentDiffusionFamily, check_family
from trainer.families.sources import ModelSource, classify_source, detect_source_family

log = logging.getLogger("atelier")


def _family_of(source: ModelSource, found, unet) -> str:
    """sd15 or sd2: from the files where they tell (tiny models have no tell-tale widths), else the UNet."""
    if found in ("sd15", "sd2"):
        return found
    cfg = unet.config
    return "sd2" if cfg.cross_attention_dim >= 1024 or cfg.use_linear_projection else "sd15"


class StableDiffusion(LatentDiffusionFamily):
    """SD 1.x / 2.x components plus the pieces of the diffusion objective the loop needs."""

    name = "sd"
    folder_sampler = "ddim"  # what a saved diffusers folder carries

    def __init__(self, mcfg, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        check_family(self.source, found, mcfg, ("sd15", "sd2"), "SD 1.x/2.x")
        inpaint = bool(found and found.endswith("-inpaint"))
        pipe_cls = StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline
        pred = None
        if found == "sd2" and self.source.kind == "single_file" and mcfg.prediction_type == "auto":
            pred = sd_configs.sd2_prediction(Path(self.source.location))  # 768 px v or 512 px ε base: from the weights
            if pred:
                log.info("model.prediction_type auto: %s is an SD 2.x %s model (told from its weights, as ComfyUI "
                         "does); set model.prediction_type to choose yourself", self.source.display,
                         "768 px v-prediction" if pred == "v_prediction" else "512 px ε-prediction (base)")
        pipe = sources.load_pipeline(pipe_cls, self.source, mcfg, workspace, family=found if found else "sd15",
                                     prediction_type=pred,
                                     safety_checker=None, requires_safety_checker=False)
        self.tokenizer = pipe.tokenizer
        self.text_encoder = pipe.text_encoder
        self.unet = pipe.unet
        self.vae = pipe.vae
        in_ch = self.unet.config.in_channels
        if in_ch not in (4, 9):
            raise ModelLoadError(f"'{self.source.display}' has a {in_ch}-channel UNet; only text-to-image (4) and "
                                 "inpainting (9) UNets can be trained.", key="model.path")
        self._setup_inpainting(mcfg)
        self.family = _family_of(self.source, found and found.removesuffix("-inpaint"), self.unet)
        self._setup_schedule(dict(pipe.scheduler.config), mcfg.prediction_type)
        self.device = torch.device(device)
        self.unet.to(self.device, dtype=torch_dtype(part_dtype(mcfg, "unet")))
        self.text_encoder.to(self.device, dtype=torch_dtype(part_dtype(mcfg, "text_encoder")))
        self.vae.to(self.device, dtype=torch_dtype(mcfg.vae_dtype))
        for m in (self.unet, self.text_encoder, self.vae):
            m.requires_grad_(False)
        self.vae.eval()
        self.text_encoder.eval()
        self.clip_skip = int(getattr(mcfg, "clip_skip", 0) or 0)
        self._set_attention(mcfg.attention)
        self._vae_dtype_name = mcfg.vae_dtype

    # --- text ---------------------------------------------------------------------------
    def tokenize(self, captions: List[str]):
        return self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids

    def encode_text(self, input_ids):
        """The text encoder's last hidden state, or with ``model.clip_skip`` = N an earlier layer
        through the final layer norm (as A1111 and diffusers' ``clip_skip`` do)."""
        if not self.clip_skip:
            return self.text_encoder(to_device(input_ids, self.device))[0]
        out = self.text_encoder(to_device(input_ids, self.device), output_hidden_states=True)
        hidden = out.hidden_states[-(self.clip_skip + 1)]
        final_norm = getattr(self.text_encoder, "final_layer_norm", None) or \
            self.text_encoder.text_model.final_layer_norm
        return final_norm(hidden)

    def encode_captions(self, captions: List[str]):
        """Captions → conditioning tensor: what the text cache stores for a frozen encoder."""
        return self.encode_text(self.tokenize(list(captions)))

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        """The UNet's conditioning for a data batch: cached encoder output when the batch has it, else
        the captions (after ``expand``: embedding placeholders) through the text encoder, with
        gradients only when a text-side module trains.

        ``drop_te1`` (one bool per image): caption dropout of the one text encoder — those images get
        the empty caption's encoding, SD's unconditional input. ``drop_te2`` has no encoder here."""
        cached = batch.get("encoder_hidden_states")
        if cached is not None:
            cond = cached.to(self.device)
            if drop_te1 is not None and any(drop_te1):
                with torch.no_grad():
                    empty = self.encode_text(self.tokenize([""])).to(cond.dtype)
                flags = flags_on(drop_te1, cond.device)
                cond = torch.where(flags[:, None, None], empty, cond)
            return cond
        captions = list(expand(batch["captions"]))
        if drop_te1 is not None:
            captions = ["" if drop else c for c, drop in zip(captions, drop_te1)]
        ids = self.tokenize(captions)
        if train_text:
            return self.encode_text(ids)
        with torch.no_grad():
            return self.encode_text(ids)

    def predict(self, noisy_latents, timesteps, conditioning):
        return self.unet(noisy_latents, timesteps, conditioning.to(noisy_latents.dtype), return_dict=False)[0]

    # --- sampling -----------------------------------------------------------------------
    def pipeline(self, sampler: str = "ddim"):
        sched_cls = getattr(diffusers, SAMPLERS[sampler or "ddim"])
        scheduler = sched_cls.from_config(self._sched_config)
        pipe_cls = StableDiffusionInpaintPipeline if self.inpainting else StableDiffusionPipeline
        pipe = pipe_cls(vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                       unet=self.unet, scheduler=scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe
