"""Qwen-Image on diffusers' ``QwenImagePipeline`` classes: an MMDiT over the features of a Qwen2.5-VL text model
and the latents of a Wan-style VAE.

What differs, and where it lives here:

- Text: the caption in the pipeline's system/user template, the last hidden layer, the template's first tokens
  dropped and only the real tokens kept (``QwenImagePipeline._get_qwen_prompt_embeds``); cached padded to
  ``max_sequence_length`` with their mask, and cut to the batch's longest caption for the transformer (no mask when
  every row fills it), as the pipeline pads (padding at the end changes no position: text RoPE positions start
  after the image's). Caption dropout gives the empty caption's.
- Latents: the VAE works on video ([B, C, T, H, W]); images are one frame, normalised per channel with the VAE's
  ``latents_mean``/``latents_std`` as the pipeline inverts them; packed 2×2 into tokens for the transformer.
- Flow matching: σ unshifted, as diffusers' Qwen-Image trainer draws it (the resolution-dependent μ of its scheduler
  config with ``loss.resolution_shift``); the transformer takes σ.
- Samples: true classifier-free guidance (the pipeline's ``true_cfg_scale``, with a negative prompt: " " when none
  is set, as the model card does) is what ``sampling.prompts.*.cfg_scale`` drives.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>``) that ``QwenImagePipeline.load_lora_weights``
  reads; fine-tunes as the transformer's weights in one file under diffusers' names (the layout of ComfyUI's
  qwen_image files). Single files in: the transformer, with VAE, Qwen2.5-VL and tokenizer from
  ``model.config_path`` (default Qwen/Qwen-Image).

The edit models (Qwen-Image-Edit, -2509, -2511) are :class:`trainer.families.qwenimage.edit.QwenImageEdit`, a
subclass: their pipeline class, the text features with the control images, and the control tokens after the
target's (:meth:`QwenImage._reference_tokens`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.transformer_kit import (
    ChannelNormalisedLatents,
    MaskedTextConditioning,
    PeftLayoutLora,
    longest_caption,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.qwenimage.keys import config_from_state, without_marker
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import flow_objective_for

OFFICIAL = "Qwen/Qwen-Image"
MAX_TOKENS = 512  # the pipeline reads up to 1024; the cache keeps this many (real captions are far shorter)
ATTN = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TARGETS = {"attn": ATTN,
           "attn_mlp": ATTN + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"],
           "all": ATTN + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1",
                          "txt_mod.1"]}


class TrueCFGSampler:
    """QwenImagePipeline behind the arguments every family's pipeline takes: ``guidance_scale`` is its
    ``true_cfg_scale`` (with " " as the negative prompt when none is given); anything else reaches the pipeline."""

    def __init__(self, pipe: Any):
        self.pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, prompt, guidance_scale: float = 4.0, negative_prompt: Optional[str] = None, **kwargs: Any):
        # by name: the edit pipelines take the image first
        return self.pipe(prompt=prompt, true_cfg_scale=guidance_scale, negative_prompt=negative_prompt or " ", **kwargs)


class QwenImage(ChannelNormalisedLatents, MaskedTextConditioning, PeftLayoutLora, Family):
    cache_cut = True  # the step cuts captions to their length: the cache keeps no more
    name = "qwenimage"
    family = "qwen-image"
    prediction_type = "flow"
    fp8_skip = ("norm", "img_in", "txt_in", "time_text_embed", "proj_out")
    swap_blocks = ("transformer_blocks",)
    targets = TARGETS
    modelspec = ("qwen-image", "https://github.com/QwenLM/Qwen-Image", "qwen_image")

    pipeline_cls: Any = QwenImagePipeline
    official = OFFICIAL  # model.config_path's default for a single file

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, dtypes)
        else:
            pipe = sources.load_pipeline(self.pipeline_cls, self.source, mcfg, workspace, family=self.family,
                                         dtype=dtypes, **self._given_components())
        self._loaded(pipe)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self._template, self._drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config)
        self.vae_scale_factor = pipe.vae_scale_factor
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS), pipe.tokenizer_max_length)
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Qwen-Image runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    def _from_single_file(self, mcfg: Any, dtypes: Dict[str, Any]):
        return pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=self.pipeline_cls,
                                              transformer_cls=QwenImageTransformer2DModel, config=config_from_state,
                                              to_diffusers=without_marker, official=self.official,
                                              layout="diffusers' layout", **self._given_components())

    def _given_components(self) -> Dict[str, Any]:
        """Pipeline components not loaded from the model's folder (the edit models' processor)."""
        return {}

    def _loaded(self, pipe: Any) -> None:
        """What a subclass takes from the loaded pipeline before it is taken apart."""

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """One-frame video through the VAE: the posterior's mean and std [B, C, h, w] on the CPU in fp32."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype).unsqueeze(2)).latent_dist
        return {"mean": dist.mean.squeeze(2).float().cpu(), "std": dist.std.squeeze(2).float().cpu()}

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``QwenImagePipeline._get_qwen_prompt_embeds``, padded to ``max_sequence_length``."""
        texts = [self._template.format(c) for c in captions]
        tokens = self.tokenizer(texts, max_length=self.max_sequence_length + self._drop, padding="max_length",
                                truncation=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                                       output_hidden_states=True,  # the logits are not used: only the last
                                       logits_to_keep=1).hidden_states[-1]  # token's (not [B, L, 152064])
        embeds = torch.zeros(len(texts), self.max_sequence_length, hidden.shape[-1], dtype=hidden.dtype,
                             device=hidden.device)
        keep = torch.zeros(len(texts), self.max_sequence_length, dtype=torch.bool, device=hidden.device)
        for i in range(len(texts)):  # the real tokens after the template's first ones, moved to the front
            real = hidden[i][mask[i].bool()][self._drop:]
            embeds[i, :real.shape[0]] = real
            keep[i, :real.shape[0]] = True
        return embeds, keep

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        if h % 2 or w % 2:
            raise ValueError(f"Qwen-Image packs 2×2 latent patches: latents of {h}×{w} must be even (image sizes a "
                             f"multiple of {2 * self.vae_scale_factor})")
        dtype, device = model_input.dtype, model_input.device
        packed = QwenImagePipeline._pack_latents(model_input, b, c, h, w)
        refs, ref_shapes = self._reference_tokens(conditioning, b, (h, w))
        hidden = packed if refs is None else torch.cat([packed, refs.to(device, dtype)], dim=1)
        # σ in fp32, as diffusers' Qwen-Image trainer passes it (timesteps / 1000 of the fp32 schedule): the
        # transformer casts it to the hidden states' dtype itself before it embeds it
        embeds, mask = longest_caption(conditioning, device, dtype)  # as the pipeline pads (no mask when full)
        out = self.transformer(hidden_states=hidden, timestep=timesteps.to(device, torch.float32),
                               encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                               img_shapes=[[(1, h // 2, w // 2), *ref_shapes]] * b, return_dict=False)[0]
        out = out[:, :packed.shape[1]]  # the target's tokens (the references' are only read)
        return QwenImagePipeline._unpack_latents(out, h * self.vae_scale_factor, w * self.vae_scale_factor,
                                                 self.vae_scale_factor).squeeze(2)

    def _reference_tokens(self, conditioning: Any, batch: int, latent_hw: Tuple[int, int]) -> Tuple[Any, List[tuple]]:
        """Packed tokens [B, N, C·4] read after the target's, and their ``img_shapes`` entries: none here."""
        return None, []

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = self.pipeline_cls(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                 text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer,
                                 **self._sampling_components())
        pipe.set_progress_bar_config(disable=True)
        return TrueCFGSampler(pipe)

    def _sampling_components(self) -> Dict[str, Any]:
        return {}

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:qwen-template"

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer's weights in one file under diffusers' names."""
        save_transformer_file(path, self.transformer.state_dict(), dtype, metadata)
