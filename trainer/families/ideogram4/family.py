"""Ideogram 4 on diffusers' ``Ideogram4Pipeline``: one packed sequence of Qwen3-VL text features and patchified image
latents through a single-stream transformer, and a second, unconditional transformer for guidance.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_ideogram4.py`` and
``transformer_ideogram4.py``):

- Text: the caption in Qwen3-VL's chat template (one user turn, generation prompt), the hidden states of 13 of its 36
  decoder layers (``QWEN3_VL_ACTIVATION_LAYERS``) concatenated per token (53,248 features), left-padded, padding
  zeroed — ``Ideogram4Pipeline._get_text_encoder_hidden_states``, made Qwen3-VL's forward here
  (:func:`tapped_text_layers`) so that the text-encoder offload's hooks see the call. The pipeline pads to 2048 tokens;
  Atelier encodes at ``model.t5_max_length`` (default 512): padding tokens form their own attention segment and the
  text positions count from the first real token, so the image tokens' output is the same (tested); so the cache
  keeps the real tokens first and no more of them than the longest caption encoded with it, and a step hands the
  transformer the batch's longest caption.
- The sequence: ``[text | image]`` with 3-axis MRoPE positions, a block-diagonal segment mask and per-token role
  indicators, built as ``Ideogram4Pipeline._prepare_ids`` builds them (vectorised here, from the text mask).
- The clock runs the other way: the transformer takes model time 1 − σ and returns the velocity x − ε (the pipeline
  steps with ``-v``), so :meth:`predict` turns both around and the loop keeps the common flow objective
  (σ, target ε − x). The timestep is passed in fp32 (the pipeline casts it to the model's dtype first; the time
  embedding casts it back to fp32 itself).
- σ: the pipeline's schedule is a logit-normal in σ whose mean is shifted by the image size
  (``μ = ½·ln(pixels / 512²)``): with ``loss.resolution_shift`` the σ drawn for training take the same shift
  (σ' = e^μ / (e^μ + 1/σ − 1)); the default draw is logit-normal as the schedule.
- Latents: the Flux.2 VAE's 32 channels, patchified 2×2 with the patch before the channel (``(pi, pj, c)``, the
  pipeline's unpatchify order), normalised by the VAE's BatchNorm statistics, kept as [B, 128, h, w].
- Guidance: the unconditional transformer is a separate model that samples only. It stays in CPU RAM and joins the
  device for a sample only where the conditional one is not stored in fp8/NF4 and there is room
  (:class:`Ideogram4Sampler`; the VRAM estimate counts it there); LoRA files adapt the conditional transformer
  (``transformer``), as ``load_lora_weights`` does.
- The prompt enhancer (``Ideogram4PromptEnhancerHead``) rewrites prompts at inference; it has no part in training and
  is not loaded (captions are used as written, whether plain text or Ideogram's JSON captions).
- Files: LoRA in the original layout (``diffusion_model.<module>``, lora_keys.py says why) that ComfyUI and
  ``Ideogram4Pipeline.load_lora_weights`` read; fine-tunes as the original single file (keys.py). Single files in:
  the conditional transformer, with the rest from ``model.config_path`` (default ideogram-ai/ideogram-v4).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional

import torch
from diffusers import Ideogram4Pipeline, Ideogram4Transformer2DModel
from diffusers.models.transformers.transformer_ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
)

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    MaskedTextConditioning,
    PeftLayoutLora,
    cut_to_longest,
    longest_caption,
    pipeline_with_transformer_file,
    real_tokens_first,
    save_transformer_file,
)
from trainer.families.ideogram4 import lora_keys
from trainer.families.ideogram4.keys import (
    config_from_original,
    diffusers_to_original,
    original_module,
    original_to_diffusers,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.formats.kohya import lora_layers
from trainer.objectives import FlowMatchingObjective

logger = logging.getLogger(__name__)
OFFICIAL = "ideogram-ai/ideogram-v4"
MAX_TOKENS = 512
PATCH = 2
ATTN = ["layers.*.attention.to_q", "layers.*.attention.to_k", "layers.*.attention.to_v", "layers.*.attention.to_out.0"]
MLP = ["layers.*.feed_forward.w1", "layers.*.feed_forward.w2", "layers.*.feed_forward.w3"]
# "all" adds the blocks' modulation Linear (the final layer's is outside diffusers' converter)
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP, "all": ATTN + MLP + ["layers.*.adaln_modulation"]}
# Ideogram4Pipeline.__call__'s default guidance: 7.0, then 3.0 for the last 3 of its 48 steps
DEFAULT_STEPS, DEFAULT_GUIDANCE = 48, 7.0


def resolution_mu(latents: torch.Tensor) -> float:
    """The pipeline's ``_resolution_aware_mu`` (base μ 0) for patchified latents [B, C, h, w]: the image is
    (h · 2 · 8) × (w · 2 · 8) pixels, 16 pixels a token."""
    tokens = latents.shape[-2] * latents.shape[-1]
    return 0.5 * math.log(tokens * 16 * 16 / (512 * 512))


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, c, H, W] -> [B, 4c, H/2, W/2], the channel index (pi, pj, c) as the pipeline's tokens hold it."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(b, PATCH * PATCH * c, h // PATCH, w // PATCH)


class Ideogram4Sampler(Ideogram4Pipeline):
    """``Ideogram4Pipeline`` as the sample loop calls every pipeline (``guidance_scale``, ``negative_prompt``): 48 steps
    at guidance 7 are the pipeline's own default schedule, any other values a constant guidance; the model takes no
    negative prompt (its unconditional branch has no text).

    Two placements differ from the pipeline's own, so that a sample holds on the device what the VRAM estimate counts:

    - Qwen3-VL runs through its ``forward`` (:func:`tapped_text_layers`): the pipeline calls its decoder layers one by
      one, which passes by the forward hooks that bring an offloaded text encoder (``data.offload_text_encoders``) to
      the device and send the denoiser to CPU RAM — the prompt would be encoded on the CPU.
    - The unconditional transformer (as large as the trained one: 17.3 GiB in bf16) lives in CPU RAM. It joins the
      device at the first denoising step, after the conditional transformer's hooks have sent the text encoders back,
      and only where ``unconditional_joins`` (set by :class:`Ideogram4`: the conditional transformer is not stored in
      fp8/NF4 nor block-swapped, so the run is not one sized to a card's memory) and the device has room. Otherwise
      the unconditional branch runs on the conditional transformer with the LoRA — what ComfyUI's Ideogram 4 model
      does when it is given no text, and what ai-toolkit's samples do — and a warning says so."""

    unconditional_joins = True
    run_device: Optional[torch.device] = None  # the run's device (the family's): where the denoising happens

    def __call__(self, prompt=None, *, guidance_scale=None, num_inference_steps=DEFAULT_STEPS, negative_prompt=None,
                 **kwargs):
        if kwargs.get("guidance_schedule") is not None:  # a schedule of the caller's own
            guidance_scale = None
        elif guidance_scale in (None, DEFAULT_GUIDANCE) and num_inference_steps == DEFAULT_STEPS:
            guidance_scale = None  # the pipeline's default guidance_schedule
            kwargs.pop("guidance_schedule", None)
        else:
            guidance_scale = DEFAULT_GUIDANCE if guidance_scale is None else guidance_scale
            kwargs["guidance_schedule"] = None
        own = self.unconditional_transformer
        # the run's device, not the conditional transformer's place now: an offloaded text cache may have left it in
        # CPU RAM (a sample before the first step), and its own pre-hook brings it back
        home, device = own.device, self.run_device or self.transformer.device
        hook = self.transformer.register_forward_pre_hook(lambda _m, _a: self.place_unconditional(own, device))
        try:
            return super().__call__(prompt, guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                                    **kwargs)
        finally:
            hook.remove()
            self.unconditional_transformer = own
            if own.device != home:
                own.to(home)

    @staticmethod
    def _get_text_encoder_hidden_states(text_encoder, token_ids, attention_mask, pos_2d):
        return text_encoder(token_ids, attention_mask, pos_2d)  # through forward: its offload hooks fire

    def place_unconditional(self, own: Any, device: torch.device) -> None:
        """Before each conditional call (registered after the text-encoder offload's own pre-hook, so it runs once
        the text encoders are back in CPU RAM): the unconditional transformer to ``device``, or its branch onto the
        conditional transformer (see the class docstring). Decided once per sample."""
        if self.unconditional_transformer is not own or own.device == device:
            return
        size = sum(p.numel() * p.element_size() for p in own.parameters())
        why = None
        if not self.unconditional_joins:
            why = ("the conditional transformer is stored in fp8/NF4 or block-swapped, so the run is sized without "
                   "it (turn those off for the pipeline's own guidance)")
        elif device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 1.2 * size:
            why = f"no room on {device}"
        if why is None:
            own.to(device)
            return
        logger.warning("Ideogram 4 samples: the unconditional transformer (%.1f GiB) stays in CPU RAM, %s: its branch "
                       "runs on the conditional transformer", size / 2 ** 30, why)
        self.unconditional_transformer = self.transformer


def tapped_text_layers(text_encoder: Any) -> Any:
    """Give Qwen3-VL the forward Ideogram 4 uses, ``(token_ids, attention_mask, positions)`` -> the hidden states of
    its 13 tapped layers (``Ideogram4Pipeline._get_text_encoder_hidden_states``), and return it. The pipeline and the
    text cache call the decoder layers directly, and a module's forward hooks — the text-encoder offload's (the
    encoder to the device, the denoiser out) — fire only on a call of the module itself. Set on the instance before
    any hook is added (accelerate's offload hook wraps the instance's forward)."""
    def forward(token_ids, attention_mask, positions):
        return Ideogram4Pipeline._get_text_encoder_hidden_states(text_encoder, token_ids, attention_mask, positions)
    text_encoder.forward = forward
    return text_encoder


class Ideogram4(MaskedTextConditioning, PeftLayoutLora, Family):
    name = "ideogram4"
    family = "ideogram4"
    prediction_type = "flow"
    fp8_skip = ("norm", "input_proj", "llm_cond", "t_embedding", "adaln_proj", "embed_image_indicator", "final_layer")
    swap_blocks = ("layers",)
    targets = TARGETS
    modelspec = ("ideogram-4", "https://huggingface.co/ideogram-ai/ideogram-v4", "ideogram4")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        dtypes["unconditional_transformer"] = dtypes["transformer"]
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=Ideogram4Pipeline,
                                                  transformer_cls=Ideogram4Transformer2DModel,
                                                  config=config_from_original, to_diffusers=original_to_diffusers,
                                                  official=OFFICIAL, layout="the original layout")
        else:
            pipe = sources.load_pipeline(Ideogram4Pipeline, self.source, mcfg, workspace, family="ideogram4",
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.unconditional_transformer = pipe.unconditional_transformer.requires_grad_(False).eval()
        self.text_encoder, self.tokenizer = tapped_text_layers(pipe.text_encoder), pipe.tokenizer
        # the second transformer joins the device for samples only in a run not sized down (Ideogram4Sampler)
        self.unconditional_joins = "unet" not in getattr(mcfg, "deferred", ())
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = FlowMatchingObjective(shift=1.0, dynamic_shift=resolution_mu,
                                               default_distribution="logit_normal")
        self.max_sequence_length = int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS)
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Ideogram 4 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """The posterior's mean and std, patchified 2×2 in the pipeline's token order (before normalising)."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        return {"mean": patchify(dist.mean).float().cpu(), "std": patchify(dist.std).float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        """A latent drawn from the cached posterior, normalised by the VAE's BatchNorm statistics (the inverse of the
        pipeline's denormalisation before decoding)."""
        mean, std = dist["mean"].to(self.device), dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype,  # on the generator's device
                          device=None if generator is None else generator.device).to(self.device)
        bn = self.vae.bn
        shift = bn.running_mean.view(1, -1, 1, 1).to(mean)
        scale = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(mean)
        return (mean + std * eps - shift) / scale

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``Ideogram4Pipeline.encode_prompt``'s text part, left-padded to ``max_sequence_length``: (features
        [B, L, 13·hidden] in fp32 with padding zeroed, mask of the real tokens [B, L])."""
        length = self.max_sequence_length
        token_ids = torch.zeros(len(captions), length, dtype=torch.long)
        mask = torch.zeros(len(captions), length, dtype=torch.long)
        positions = torch.zeros(len(captions), length, dtype=torch.long)
        for row, caption in enumerate(captions):
            messages = [{"role": "user", "content": [{"type": "text", "text": str(caption)}]}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            tokens = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0][:length]
            n = int(tokens.shape[0])
            token_ids[row, length - n:], mask[row, length - n:] = tokens, 1
            positions[row, length - n:] = torch.arange(n)
        device = self.text_encoder.device
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            layers = self.text_encoder(token_ids.to(device), mask.to(device), positions.to(device))
        features = torch.stack(layers, dim=0).permute(1, 2, 3, 0).reshape(len(captions), length, -1)
        features = (features * mask.to(features).unsqueeze(-1)).to(torch.float32)
        # the real tokens first: their features are made (left-padded, as the pipeline makes them) and their
        # positions in the transformer count real tokens only, while padding is a segment of its own that nothing
        # else attends to, so where it sits changes nothing, and at the end it can be cut off
        return real_tokens_first(features.to(self.device), mask.to(self.device))

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """As :class:`MaskedTextConditioning`, only as long as the longest caption encoded with them (13 layers of
        Qwen3-VL, 53,248 features a token: ~210 kB in fp32)."""
        with torch.no_grad():
            embeds, mask = cut_to_longest(*self._encode(list(captions)))
        return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu()}

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        device, dtype = model_input.device, model_input.dtype
        batch, channels, grid_h, grid_w = model_input.shape
        features, text_mask = longest_caption(conditioning, device, dtype)  # the batch's longest caption
        if text_mask is None:  # every row fills it
            text_mask = torch.ones(features.shape[:2], dtype=torch.bool, device=device)
        length, image_tokens = text_mask.shape[1], grid_h * grid_w
        tokens = model_input.flatten(2).transpose(1, 2)  # [B, h·w, C], row-major as the pipeline's grid
        hidden = torch.cat([tokens.new_zeros(batch, length, channels), tokens], dim=1)
        text = torch.cat([features, features.new_zeros(batch, image_tokens, features.shape[-1])], dim=1)
        # Ideogram4Pipeline._prepare_ids from the mask: text positions count from the first real token, padding
        # is its own segment with position 0 and no role
        text_pos = (text_mask.long().cumsum(1) - 1).clamp(min=0) * text_mask.long()
        rows = torch.arange(grid_h, device=device).view(-1, 1).expand(grid_h, grid_w).reshape(-1)
        cols = torch.arange(grid_w, device=device).view(1, -1).expand(grid_h, grid_w).reshape(-1)
        image_pos = torch.stack([torch.zeros_like(rows), rows, cols], dim=1) + IMAGE_POSITION_OFFSET
        position_ids = torch.cat([text_pos.unsqueeze(-1).expand(batch, length, 3),
                                  image_pos.unsqueeze(0).expand(batch, image_tokens, 3)], dim=1)
        real = torch.ones(batch, image_tokens, dtype=torch.bool, device=device)
        segment_ids = torch.where(torch.cat([text_mask, real], dim=1), 1, SEQUENCE_PADDING_INDICATOR)
        indicator = torch.cat([torch.where(text_mask, LLM_TOKEN_INDICATOR, 0),
                               torch.full((batch, image_tokens), OUTPUT_IMAGE_INDICATOR, device=device)], dim=1)
        # model time 1 − σ in fp32: the time embedding is computed from it
        model_time = 1.0 - timesteps.to(device, torch.float32).reshape(-1).expand(batch)
        out = self.transformer(hidden_states=hidden, timestep=model_time, encoder_hidden_states=text,
                               position_ids=position_ids, segment_ids=segment_ids, indicator=indicator,
                               return_dict=False)[0]
        velocity = out[:, length:].transpose(1, 2).reshape(batch, channels, grid_h, grid_w)
        return -velocity  # the transformer predicts x − ε

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = Ideogram4Sampler(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer,
                                unconditional_transformer=self.unconditional_transformer)
        pipe.unconditional_joins, pipe.run_device = self.unconditional_joins, self.device
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_modules(self) -> List[Any]:
        """What a sample brings to the device besides the parts and the VAE (the VRAM estimate counts it): the
        unconditional transformer where it joins (:class:`Ideogram4Sampler`)."""
        return [self.unconditional_transformer] if self.unconditional_joins else []

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:qwen3vl-13-layers:real-first"

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file (``diffusion_model.<original>``); q/k/v
        share the fused ``qkv``."""
        return {"unet": ("diffusion_model", original_module)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA in the original layout (α/r baked into ``lora_B``; q/k/v fused block-diagonally)."""
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return lora_keys.to_original(out)

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any],
                             adapter_name: str = "default") -> int:
        """An original-layout file into fresh peft layers (a diffusers-layout file as :class:`PeftLayoutLora` reads
        it)."""
        if not any(k.startswith(lora_keys.PREFIX) for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        ranks = {path: layer.r[adapter_name] for path, layer in lora_layers(modules["unet"], adapter_name)}
        tensors, used = lora_keys.from_original(state, ranks)
        loaded = load_peft_layout(tensors, {"unet": modules["unet"]}, {"unet": "transformer"}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(loaded) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned conditional transformer as the original single file (keys.py): what ComfyUI's
        diffusion-model loader reads, and model.path here."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
