"""Chroma on diffusers' ``ChromaPipeline`` classes: Flux's architecture with its modulation pruned into one
approximator MLP (``distilled_guidance_layer``), T5 alone as text encoder, and real classifier-free guidance.

What differs from Flux.1, and where it lives here:

- Text: T5's hidden states encoded with the attention mask, and the transformer told which text tokens to attend
  to: every real token and the first padding token (``ChromaPipeline._get_t5_prompt_embeds``), then every image
  token (``_prepare_attention_mask``); a step hands it the batch's longest run of those (the padding beyond takes no
  part). Caption dropout gives the empty caption's encoding and mask.
- No guidance embedding and no pooled vector: samples use true CFG with a negative prompt (the pipeline's
  ``guidance_scale``).
- Flow matching with the scheduler config's shift (``trainer.objectives.flow_objective_for``: unshifted when it says
  ``use_dynamic_shifting``, the pipeline's resolution-dependent μ with ``loss.resolution_shift``); packed 2×2
  latents as Flux.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>``), which ``ChromaPipeline.load_lora_weights``
  (diffusers' Flux LoRA loader) reads; fine-tunes as the original single file (families/common/bfl_keys.py, shared
  with Flux). Single files in: the transformer, with the VAE and T5 from ``model.config_path`` (a diffusers Chroma
  folder or hub id; default lodestones/Chroma1-HD).
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel

from trainer.data.text_rows import prefix_lengths
from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.chroma.keys import config_from_original
from trainer.families.common.bfl_keys import bfl_to_diffusers, diffusers_to_bfl
from trainer.families.common.packed_ids import latent_image_ids
from trainer.families.common.transformer_kit import (
    PeftLayoutLora,
    cut_to_longest,
    longest_caption,
    pipeline_with_transformer_file,
    rows_replaced,
    save_transformer_file,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import flow_objective_for

OFFICIAL = "lodestones/Chroma1-HD"
T5_MAX = 512
ATTN = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TARGETS = {
    "attn": ATTN,
    "attn_mlp": ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                        "single_transformer_blocks.*.proj_out"],
    "all": ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                   "single_transformer_blocks.*.proj_out", "x_embedder", "context_embedder"],
}


class ChromaConditioning:
    """T5 ``prompt_embeds`` [B, L, D] and the text part of the attention mask [B, L]; ``.to()`` like a tensor.
    ``lengths``: each row's attended tokens (the real ones and the first padding token), on the host, when the
    captions were cached; else None."""

    def __init__(self, prompt_embeds, text_mask, lengths: Optional[List[int]] = None):
        self.prompt_embeds, self.text_mask, self.lengths = prompt_embeds, text_mask, lengths

    @property
    def prompt_mask(self):  # the name transformer_kit.longest_caption reads
        return self.text_mask

    def to(self, *args: Any, **kwargs: Any) -> "ChromaConditioning":
        return ChromaConditioning(self.prompt_embeds.to(*args, **kwargs), self.text_mask.to(*args, **kwargs),
                                  self.lengths)


class Chroma(PeftLayoutLora, Family):
    name = "chroma"
    family = "chroma"
    prediction_type = "flow"
    fp8_skip = ("norm", "x_embedder", "context_embedder", "distilled_guidance_layer", "proj_out")
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")
    targets = TARGETS
    modelspec = ("chroma", "https://github.com/lodestone-rock/flow", "chroma")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, dtypes)
        else:
            pipe = sources.load_pipeline(ChromaPipeline, self.source, mcfg, workspace, family="chroma", dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or T5_MAX),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Chroma runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    def _from_single_file(self, mcfg: Any, dtypes: Dict[str, Any]):
        return pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=ChromaPipeline,
                                              transformer_cls=ChromaTransformer2DModel, config=config_from_original,
                                              to_diffusers=bfl_to_diffusers, official=OFFICIAL,
                                              layout="the original layout")

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``ChromaPipeline._get_t5_prompt_embeds``: T5 with its mask; the transformer attends to every real token
        and the first padding token."""
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            embeds = self.text_encoder(tokens.input_ids.to(self.device), output_hidden_states=False,
                                       attention_mask=mask)[0]
        positions = torch.arange(mask.shape[1], device=self.device).unsqueeze(0)
        text_mask = (positions <= mask.sum(dim=1, keepdim=True)).to(embeds.dtype)
        return embeds, text_mask

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        with torch.no_grad():  # only as long as the longest attended run: the step cuts the rest off anyway
            embeds, mask = cut_to_longest(*self._encode(list(captions)))
        return {"prompt_embeds": embeds.float().cpu(), "prompt_attention_mask": mask.float().cpu()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        lengths = None
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
            mask = batch["prompt_attention_mask"].to(self.device)
            lengths = batch.get("prompt_lengths")  # counted on the host by the data pipeline
        else:
            embeds, mask = self._encode(list(expand(batch["captions"])), "text_encoder" in train_text)
        if drop_te1 is not None and any(drop_te1):  # the empty caption's encoding and mask
            if self._empty is None:
                self._empty = self.encode_captions([""])
            embeds, mask = rows_replaced(drop_te1, embeds, mask, self._empty["prompt_embeds"],
                                         self._empty["prompt_attention_mask"], owner=self)
            empty = prefix_lengths(self._empty["prompt_attention_mask"])  # a host tensor
            lengths = None if lengths is None or empty is None else \
                [empty[0] if dropped else n for n, dropped in zip(lengths, drop_te1)]
        return ChromaConditioning(embeds, mask, lengths)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        if h % 2 or w % 2:
            raise ValueError(f"Chroma packs 2×2 latent patches: latents of {h}×{w} must be even (image sizes a multiple "
                             f"of {2 * self.vae_scale_factor})")
        dtype, device = model_input.dtype, model_input.device
        packed = ChromaPipeline._pack_latents(model_input, b, c, h, w)
        img_ids = latent_image_ids(h // 2, w // 2, device, dtype)  # diffusers': made on the CPU, then copied
        # the batch's longest attended run (the real tokens and the first padding token): the transformer's mask is an
        # outer product, so a padding token beyond it neither attends nor is attended to (tests/test_family_chroma.py)
        embeds, text_mask = longest_caption(conditioning, device, dtype)
        text_mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=device) if text_mask is None else \
            text_mask.bool()
        txt_ids = torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype)
        mask = torch.cat([text_mask, torch.ones(b, packed.shape[1], device=device, dtype=torch.bool)], dim=1)
        # σ in fp32, as diffusers' Flux-lineage trainers pass it: the transformer casts it to the hidden states' dtype
        # itself before it embeds it
        out = self.transformer(hidden_states=packed, encoder_hidden_states=embeds,
                               timestep=timesteps.to(device, torch.float32), img_ids=img_ids, txt_ids=txt_ids,
                               attention_mask=mask, return_dict=False)[0]
        return ChromaPipeline._unpack_latents(out, h * self.vae_scale_factor, w * self.vae_scale_factor,
                                              self.vae_scale_factor)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """ChromaPipeline over the live modules with the model's own flow-matching Euler sampler."""
        pipe = ChromaPipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                              text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
        # on the instance only: the pipeline stays a ChromaPipeline (its saved model_index.json says so)
        pipe._prepare_attention_mask = types.MethodType(_boolean_mask, pipe)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:chroma-mask"

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file ComfyUI's UNET loader reads."""
        save_transformer_file(path, diffusers_to_bfl(self.transformer.state_dict()), dtype, metadata)


def _boolean_mask(pipe: ChromaPipeline, batch_size, sequence_length, dtype, attention_mask=None):
    """``ChromaPipeline._prepare_attention_mask`` as a boolean mask, the one training uses: diffusers builds it from a
    float text mask, and torch's attention *adds* a float mask to the scores (1 or 0) instead of hiding the padding
    (diffusers issues #12116, #13619), so samples saw the padding tokens training never saw."""
    mask = ChromaPipeline._prepare_attention_mask(pipe, batch_size, sequence_length, dtype, attention_mask)
    return None if mask is None else mask.bool()
