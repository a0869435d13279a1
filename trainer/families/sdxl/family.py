"""Stable Diffusion XL base models (SDXL 1.0 and its fine-tunes: Pony, Illustrious, NoobAI …) on
diffusers classes.

What SDXL adds to the SD 1.x/2.x recipe, and where it lives here:

- Two text encoders. CLIP-L (``text_encoder``) and OpenCLIP-G (``text_encoder_2``, with projection);
  the UNet's context is their penultimate hidden states side by side (768 + 1280 = 2048 wide), and
  the *pooled* context is text_encoder_2's projected ``text_embeds``. Same as
  ``StableDiffusionXLPipeline.encode_prompt``, so what trains is what samples.
- Size and crop conditioning. Each image tells the UNet its original size (h, w), the top-left of the
  crop taken from it (top, left) and the target size (h, w): six numbers per image ("time ids"), embedded
  next to the pooled text. Training with each image's real values is what lets SDXL learn from
  small and cropped images without drawing small, cropped pictures (SDXL paper, §2.2).
- Euler sampling and ``force_zeros_for_empty_prompt``: the unconditional input at sampling time is all
  zeros, so per-encoder caption dropout zeroes that encoder's output instead of encoding "".

The loop talks to it through :meth:`condition` (captions + sizes → :class:`SDXLConditioning`) and
:meth:`predict`; everything else matches the SD family (see ``common.sd_kit.family_base.LatentDiffusionFamily``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import diffusers
import torch
from diffusers import StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline

from trainer.errors import ModelLoadError
from trainer.families import sources  # load_pipeline looked up at call time (the VRAM estimate swaps it)
from trainer.families.common.host_copy import to_device
from trainer.families.common.samplers import SAMPLERS
from trainer.families.common.sd_kit.family_base import LatentDiffusionFamily, check_family
from trainer.families.sources import classify_source, detect_source_family

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
Size = Tuple[int, int]


@dataclass
class SDXLConditioning:
    """What the SDXL UNet is conditioned on, for a batch of B images.

    ``prompt_embeds`` [B, 77, 2048]: CLIP-L ‖ OpenCLIP-G hidden states; ``pooled_prompt_embeds``
    [B, 1280]: OpenCLIP-G's projected ``text_embeds``; ``time_ids`` [B, 6]: original (h, w), crop
    (top, left), target (h, w). ``.to()`` works like a tensor's, so code written for SD's single
    context tensor (``cond.to(model.device)``, ``cond.to(dtype)``) keeps working."""

    prompt_embeds: Any
    pooled_prompt_embeds: Any
    time_ids: Any

    @property
    def added_cond_kwargs(self) -> Dict[str, Any]:
        return {"text_embeds": self.pooled_prompt_embeds, "time_ids": self.time_ids}

    def to(self, *args: Any, **kwargs: Any) -> "SDXLConditioning":
        return SDXLConditioning(self.prompt_embeds.to(*args, **kwargs), self.pooled_prompt_embeds.to(*args, **kwargs),
                                self.time_ids.to(*args, **kwargs))


def _pairs(values: Union[Size, Sequence[Size]], n: int, what: str) -> list:
    """One (a, b) per image: a sequence of n pairs, an [n, 2] tensor, or one pair for all."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = list(values)
    if len(values) == 2 and all(isinstance(v, (int, float)) for v in values):
        values = [values] * n
    if len(values) != n or any(len(v) != 2 for v in values):
        raise ValueError(f"{what}: expected {n} (a, b) pairs, one per image; got {values!r}")
    return [(int(a), int(b)) for a, b in values]


class StableDiffusionXL(LatentDiffusionFamily):
    """SDXL components plus the pieces of the diffusion objective the loop needs.

    ``clip_skip`` counts layers skipped *beyond* SDXL's default penultimate layer (diffusers'
    convention): 0 = ``hidden_states[-2]`` (what SDXL was trained with), 1 = ``hidden_states[-3]`` …
    It applies to both encoders, in training and (through :meth:`sampling_kwargs`) in samples."""

    name = "sdxl"
    family = "sdxl"
    folder_sampler = None  # a saved diffusers folder keeps the model's own (Euler)

    def __init__(self, mcfg, workspace: str, device: Any = "cpu", clip_skip: Optional[int] = None):
        self.source = classify_source(mcfg.path, workspace)
        family = getattr(mcfg, "family", "auto")
        if family not in ("auto", "sdxl"):
            raise ModelLoadError(f"model.family is {family}, but the SDXL loader was asked to load "
                                 f"'{self.source.display}'. Set model.family to sdxl or auto.",
                                 key="model.family", value=family)
        found = detect_source_family(self.source, mcfg)
        check_family(self.source, found, mcfg, ("sdxl",), "SDXL")
        inpaint = found == "sdxl-inpaint"
        dtypes = self._storage_dtypes(mcfg, unet="unet", text_encoder="text_encoder", text_encoder_2="text_encoder_2")
        pipe_cls = StableDiffusionXLInpaintPipeline if inpaint else StableDiffusionXLPipeline
        pipe = sources.load_pipeline(pipe_cls, self.source, mcfg, workspace, family=found or "sdxl", dtype=dtypes,
                                     add_watermarker=False)
        if pipe.text_encoder is None or pipe.text_encoder_2 is None:
            raise ModelLoadError(f"'{self.source.display}' has no {'first' if pipe.text_encoder is None else 'second'} "
                                 "text encoder (the SDXL refiner?); only SDXL base models are supported.",
                                 key="model.path", value=self.source.display)
        self.tokenizer, self.tokenizer_2 = pipe.tokenizer, pipe.tokenizer_2
        self.text_encoder, self.text_encoder_2 = pipe.text_encoder, pipe.text_encoder_2
        self.unet, self.vae = pipe.unet, pipe.vae
        in_ch = self.unet.config.in_channels
        if in_ch not in (4, 9):
            raise ModelLoadError(f"'{self.source.display}' has a {in_ch}-channel UNet; only text-to-image (4) and "
                                 "inpainting (9) UNets can be trained.", key="model.path", value=self.source.display)
        self._setup_inpainting(mcfg)
        if self.unet.config.get("addition_embed_type") != "text_time":
            raise ModelLoadError(f"'{self.source.display}' has no SDXL size/crop conditioning in its UNet "
                                 "(addition_embed_type is not text_time): not an SDXL base model.", key="model.path",
                                 value=self.source.display)
        self._setup_schedule(dict(pipe.scheduler.config), mcfg.prediction_type)
        self._sampler_class = type(pipe.scheduler).__name__
        self.clip_skip = int(getattr(mcfg, "clip_skip", 0) or 0) if clip_skip is None else int(clip_skip)
        layers = min(self.text_encoder.config.num_hidden_layers, self.text_encoder_2.config.num_hidden_layers)
        if not 0 <= self.clip_skip < layers:
            raise ModelLoadError(f"clip skip {self.clip_skip} is out of range: SDXL already uses the penultimate "
                                 f"layer, and its text encoders have {layers} layers; use 0 to {layers - 1} "
                                 "(0 = SDXL's default).", key="model.clip_skip", value=self.clip_skip)

        self.device = torch.device(device)
        for name in ("unet", "text_encoder", "text_encoder_2", "vae"):
            module = getattr(self, name)
            module.to(self.device)
            if module.dtype != dtypes[name]:  # a single file with mixed dtypes loads in fp32
                module.to(dtype=dtypes[name])
            module.requires_grad_(False)
        for module in (self.vae, self.text_encoder, self.text_encoder_2):
            module.eval()
        self._set_attention(mcfg.attention)
        self._vae_dtype_name = mcfg.vae_dtype

    # --- components ---------------------------------------------------------------------
    def trainable_modules(self) -> Dict[str, Any]:
        """Names the methods and optimizer groups use: ``unet``, ``text_encoder`` (CLIP-L),
        ``text_encoder_2`` (OpenCLIP-G)."""
        return {"unet": self.unet, "text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2}

    # --- text ---------------------------------------------------------------------------
    def tokenize(self, captions: Sequence[str]):
        """Token ids for both tokenizers: ``(ids_clip_l, ids_clip_g)``, each [B, 77] (they pad
        differently: ``<|endoftext|>`` vs ``!``)."""
        captions = list(captions)
        return tuple(tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                         return_tensors="pt").input_ids for tok in (self.tokenizer, self.tokenizer_2))

    def encode_text(self, input_ids, train_text_encoders=frozenset(), drop_te1=None, drop_te2=None):
        """``(prompt_embeds [B, 77, 2048], pooled_prompt_embeds [B, 1280])`` from :meth:`tokenize`'s ids.

        Gradients flow only through the encoders named in ``train_text_encoders``. ``drop_te1`` /
        ``drop_te2`` (one bool per image) zero that encoder's output for those images (per-encoder
        caption dropout; text_encoder_2's drop also zeroes the pooled embedding) — the zeros are exactly
        SDXL's unconditional input at sampling time (``force_zeros_for_empty_prompt``)."""

        hidden, pooled = [], None
        for name, ids in zip(TEXT_ENCODERS, input_ids):
            encoder = getattr(self, name)
            with torch.set_grad_enabled(torch.is_grad_enabled() and name in train_text_encoders):
                out = encoder(to_device(ids, self.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-(self.clip_skip + 2)])
            if name == "text_encoder_2":
                pooled = out.text_embeds
        prompt_embeds = torch.cat([h.to(hidden[1].dtype) for h in hidden], dim=-1)
        return self._drop(prompt_embeds, pooled, drop_te1, drop_te2)

    def _drop(self, prompt_embeds, pooled, drop_te1, drop_te2):
        """Zero one encoder's part of the context (and, for text_encoder_2, the pooled embedding)
        for the images flagged in ``drop_te1``/``drop_te2``."""
        if drop_te1 is None and drop_te2 is None:
            return prompt_embeds, pooled
        width_1 = self.text_encoder.config.hidden_size
        n = prompt_embeds.shape[0]
        keep = torch.ones(n, 1, prompt_embeds.shape[-1], dtype=prompt_embeds.dtype, device=prompt_embeds.device)
        keep_pooled = torch.ones(n, 1, dtype=pooled.dtype, device=pooled.device)
        if drop_te1 is not None:
            keep[torch.as_tensor(drop_te1, dtype=torch.bool, device=keep.device), :, :width_1] = 0
        if drop_te2 is not None:
            flags = torch.as_tensor(drop_te2, dtype=torch.bool, device=keep.device)
            keep[flags, :, width_1:] = 0
            keep_pooled[flags.to(keep_pooled.device)] = 0
        return prompt_embeds * keep, pooled * keep_pooled

    def encode_captions(self, captions: Sequence[str]) -> Dict[str, Any]:
        """Frozen-encoder outputs for the text cache (``DataPipeline.prepare(encode_text_fn=...)``):
        ``{"prompt_embeds", "pooled_prompt_embeds"}`` on the CPU; batches then carry both keys and
        :meth:`condition_from_embeds` turns them into conditioning."""
        with torch.no_grad():
            prompt_embeds, pooled = self.encode_text(self.tokenize(captions))
        return {"prompt_embeds": prompt_embeds.cpu(), "pooled_prompt_embeds": pooled.cpu()}

    def add_time_ids(self, original_sizes, crop_top_lefts, target_size):
        """[B, 6] float32: original (h, w) + crop (top, left) + target (h, w) per image, as
        ``StableDiffusionXLPipeline._get_add_time_ids`` and diffusers' SDXL training script build them.

        ``original_sizes``/``crop_top_lefts``: one (a, b) pair per image (list or [B, 2] tensor);
        ``target_size``: one (h, w) for the batch (a bucket) or one per image."""
        n = len(original_sizes)
        rows = [o + c + t for o, c, t in zip(_pairs(original_sizes, n, "original_sizes"),
                                                 _pairs(crop_top_lefts, n, "crop_top_lefts"),
                                                 _pairs(target_size, n, "target_size"))]
        return to_device(torch.tensor(rows, dtype=torch.float32), self.device)  # pinned, not blocking the host

    def condition(self, captions: Sequence[str], original_sizes, crop_top_lefts, target_size,
                  train_text_encoders=frozenset(), drop_te1=None, drop_te2=None) -> SDXLConditioning:
        """Everything :meth:`predict` needs for a batch: text through both encoders (with gradients
        for those in ``train_text_encoders``, a set of ``text_encoder``/``text_encoder_2``) plus the
        size/crop time ids of each image."""
        prompt_embeds, pooled = self.encode_text(self.tokenize(captions), train_text_encoders, drop_te1, drop_te2)
        return self.condition_from_embeds(prompt_embeds, pooled, original_sizes, crop_top_lefts, target_size)

    def condition_from_embeds(self, prompt_embeds, pooled_prompt_embeds, original_sizes, crop_top_lefts,
                              target_size, drop_te1=None, drop_te2=None) -> SDXLConditioning:
        """Conditioning from cached text-encoder outputs (frozen encoders): only the time ids are new."""
        prompt_embeds, pooled = self._drop(prompt_embeds.to(self.device), pooled_prompt_embeds.to(self.device),
                                           drop_te1, drop_te2)
        return SDXLConditioning(prompt_embeds, pooled, self.add_time_ids(original_sizes, crop_top_lefts, target_size))

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None,
                        drop_te2=None) -> "SDXLConditioning":
        """Conditioning for a data batch (the loop's one call): cached ``prompt_embeds``/
        ``pooled_prompt_embeds`` when the batch has them, else the (placeholder-expanded) captions
        through both encoders; plus each image's size/crop time ids. A trained ``embedding`` needs
        gradients through both (frozen) encoders to reach its vectors. ``drop_te1``/``drop_te2``:
        per-encoder caption dropout flags (one bool per image), see :meth:`encode_text`."""
        sizes = (batch["original_sizes"], batch["crop_top_lefts"], batch["target_sizes"])
        if batch.get("prompt_embeds") is not None:
            return self.condition_from_embeds(batch["prompt_embeds"], batch["pooled_prompt_embeds"], *sizes,
                                              drop_te1=drop_te1, drop_te2=drop_te2)
        grads = set(TEXT_ENCODERS) if "embedding" in train_text else set(TEXT_ENCODERS) & set(train_text)
        return self.condition(expand(batch["captions"]), *sizes, train_text_encoders=frozenset(grads),
                              drop_te1=drop_te1, drop_te2=drop_te2)

    # --- objective ----------------------------------------------------------------------
    def predict(self, noisy_latents, timesteps, conditioning):
        """UNet output for ``noisy_latents``; ``conditioning`` is an :class:`SDXLConditioning` (or a
        mapping with ``prompt_embeds`` and ``added_cond_kwargs``)."""
        if isinstance(conditioning, Mapping):
            prompt_embeds, added = conditioning["prompt_embeds"], conditioning["added_cond_kwargs"]
        else:
            prompt_embeds, added = conditioning.prompt_embeds, conditioning.added_cond_kwargs
        dtype = noisy_latents.dtype
        added = {k: v.to(self.device, dtype=dtype) for k, v in added.items()}
        return self.unet(noisy_latents, timesteps, encoder_hidden_states=prompt_embeds.to(self.device, dtype=dtype),
                         added_cond_kwargs=added, return_dict=False)[0]

    # --- sampling -----------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """A StableDiffusionXLPipeline over the live components. ``sampler`` is a key of
        ``base.SAMPLERS``; None keeps the model's own scheduler class (Euler for SDXL base), which is
        what a saved diffusers folder should carry."""
        sched_cls = getattr(diffusers, SAMPLERS[sampler] if sampler else self._sampler_class)
        extra = {"requires_aesthetics_score": False} if self.inpainting else {}
        pipe = (StableDiffusionXLInpaintPipeline if self.inpainting else StableDiffusionXLPipeline)(
            vae=self.vae, text_encoder=self.text_encoder, text_encoder_2=self.text_encoder_2,
            tokenizer=self.tokenizer, tokenizer_2=self.tokenizer_2, unet=self.unet,
            scheduler=sched_cls.from_config(self._sched_config), force_zeros_for_empty_prompt=True,
            add_watermarker=False, **extra)
        pipe.set_progress_bar_config(disable=True)
        return pipe

