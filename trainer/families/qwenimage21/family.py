"""Qwen-Image 2.1 (base and Turbo) on diffusers' ``QwenImage21Pipeline``: one block-causal single-stream sequence of
Qwen3-VL text features and unpatched 64-channel latents.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_qwenimage21.py``,
``transformer_qwenimage21.py``, ``autoencoder_kl_qwenimage21.py`` and the QwenImage21/QwenImage21Turbo modular blocks):

- Text: the pipeline's own ``_get_qwen_prompt_embeds`` (its raw system/user template, left padding, the last decoder
  layer before the final norm, the system tokens dropped, the real tokens kept) is called as is, on the Qwen3-VL
  processor without its video part (processor.py). Cached right-padded to ``max_sequence_length`` with the mask;
  :meth:`predict` cuts the batch back to its longest caption, as the pipeline pads a batch of prompts, because the
  image block's RoPE frame position is where the text ends. Caption dropout gives the empty caption's (the pipeline
  encodes "" as " "). Qwen3-VL keeps only the layer the pipeline reads (:class:`LastLayerOnly`). On the VRAM
  estimate's fake tensors, fake_tensors.py gives what the path reads of tensor values from shapes.
- Latents: the VAE reads RGBA (an opaque alpha channel of 1 is added to the training pixels, as the pipeline's
  preprocess of an RGB image converted to RGBA gives), one frame, normalised per channel with ``latents_mean`` /
  ``latents_std``; 16× so one latent is one token (no 2×2 packing).
- The sequence: text slots, then one slot per 2×2 group of target latents (``img_mask``), as ``__call__`` builds it;
  the transformer takes σ (``t/1000``) and predicts ε − x, the loop's own objective; its output covers the joint
  sequence and the last h·w tokens are the image's.
- σ: unshifted, with the pipeline's μ of the token count (h·w) for ``loss.resolution_shift`` (its scheduler uses
  dynamic shifting); Turbo trains the same way and samples on its shipped ``sample_sigmas``.
- Samples: ``cfg_scale`` is ``true_cfg_scale`` (1 = none, the pipeline's default; above 1 with " " as the negative
  prompt when none is set). Condition images (2.1's editing) are not trained here.
- Files: LoRA as ``diffusion_model.<module>.lora_A/lora_B.weight`` (α/r baked into ``lora_B``): ComfyUI's generic
  ``diffusion_model.`` key map reads it, and ``QwenImage21Pipeline.load_lora_weights`` (the Qwen-Image converter)
  strips the prefix. Targets stay on modules whose names are the same in both layouts (not the SwiGLU's gate/up,
  which the original fuses). Fine-tunes as the original single file (keys.py); single files in: the transformer, with
  VAE, Qwen3-VL and processor from ``model.config_path`` (default Qwen/Qwen-Image-2.1).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import is_fake

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    ChannelNormalisedLatents,
    MaskedTextConditioning,
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.qwenimage21.fake_tensors import layout_from_shapes, longest_captions, masked_hidden
from trainer.families.qwenimage21.keys import config_from_original, diffusers_to_original, original_to_diffusers
from trainer.families.qwenimage21.processor import ProcessorAt, QwenImage21Loading
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import flow_objective_for

OFFICIAL = "Qwen/Qwen-Image-2.1"
MAX_TOKENS = 512
PREFIX = "diffusion_model"
ATTN = ["transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
        "transformer_blocks.*.attn.to_out.0"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + ["transformer_blocks.*.img_mlp.out"],
           "all": ATTN + ["transformer_blocks.*.img_mlp.out", "modulation.1"]}


def _same(path: str) -> str:
    return path


class LastLayerOnly:
    """Qwen3-VL keeps only what the pipeline's text function reads of it: ``hidden_states[-1]``, the last decoder
    layer's output before the final norm (the pipeline's own norm hook makes it that), and the last token's logits.
    Asked for every hidden state it would keep all 37 layers (2.5 GiB for 16 captions of 512 tokens in bf16) and the
    logits of every token ([B, L, 151936], 2 GiB more): the hooks ask for neither and hand back the norm's input as
    the only hidden state."""

    def __init__(self, text_encoder: Any):
        model = text_encoder.model
        norm = getattr(model, "language_model", model).norm
        self.last: Optional[torch.Tensor] = None
        self.wanted = False
        self.handles = [text_encoder.register_forward_pre_hook(self._ask, with_kwargs=True),
                        norm.register_forward_pre_hook(self._keep),
                        text_encoder.register_forward_hook(self._give)]

    def _ask(self, _module, args, kwargs):
        self.wanted = bool(kwargs.get("output_hidden_states"))
        kwargs.update(output_hidden_states=False, logits_to_keep=1)
        return args, kwargs

    def _keep(self, _module, args):
        self.last = args[0]

    def _give(self, _module, _args, output):
        if self.wanted:
            output.hidden_states = (self.last,)
        self.last = None
        return output


class QwenImage21Sampler:
    """QwenImage21Pipeline behind the arguments every family's pipeline takes: ``guidance_scale`` is its
    ``true_cfg_scale`` (" " the negative prompt above 1 when none is given); a step count other than the shipped
    ``sample_sigmas``' (Turbo) samples the pipeline's plain grid of that many steps."""

    def __init__(self, pipe: Any):
        self.pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, prompt, guidance_scale: float = 1.0, negative_prompt: Optional[str] = None,
                 num_inference_steps: int = 40, **kwargs: Any):
        shipped = self.pipe.config.sample_sigmas
        if shipped and num_inference_steps != len(shipped) and kwargs.get("sigmas") is None:
            kwargs["sigmas"] = list(np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))
        if guidance_scale > 1:
            kwargs["negative_prompt"] = negative_prompt or " "
        return self.pipe(prompt=prompt, true_cfg_scale=guidance_scale, num_inference_steps=num_inference_steps,
                         **kwargs)


class QwenImage21(ChannelNormalisedLatents, MaskedTextConditioning, PeftLayoutLora, Family):
    cache_cut = True  # the step cuts captions to their length: the cache keeps no more
    name = "qwenimage21"
    family = "qwen-image-21"
    prediction_type = "flow"
    fp8_skip = ("norm", "img_in", "txt_in", "time_text_embed", "modulation", "proj_out")
    swap_blocks = ("transformer_blocks",)
    targets = TARGETS
    modelspec = ("qwen-image-2.1", "https://github.com/QwenLM/Qwen-Image", "qwen_image_21")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        self.family = found or (chosen if chosen in self.info.variants else "qwen-image-21")
        if chosen == "qwen-image-21-turbo" and self.source.kind == "single_file":
            self.family = chosen  # base and Turbo files hold the same tensors: only model.family tells
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        hub = {"cache_dir": getattr(mcfg, "cache_dir", "") or None, "revision": getattr(mcfg, "revision", "") or None}
        if self.source.kind == "single_file":
            rest = getattr(mcfg, "config_path", "") or OFFICIAL
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=QwenImage21Loading,
                                                  transformer_cls=QwenImage21Transformer2DModel,
                                                  config=config_from_original, to_diffusers=original_to_diffusers,
                                                  official=OFFICIAL, layout="the original layout",
                                                  processor=ProcessorAt(rest, **hub))
        else:
            pipe = sources.load_pipeline(QwenImage21Loading, self.source, mcfg, workspace, family=self.family,
                                         dtype=dtypes, processor=ProcessorAt(self.source.location, **hub))
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.processor = pipe.text_encoder, pipe.processor
        self.tokenizer = pipe.processor.tokenizer
        self.last_layer_only = LastLayerOnly(self.text_encoder)
        # what the pipeline's text function reads of its pipeline (the pipeline itself is not kept)
        self._view = SimpleNamespace(processor=pipe.processor, text_encoder=pipe.text_encoder,
                                     prompt_template_t2i=pipe.prompt_template_t2i,
                                     prompt_template_ti2i=pipe.prompt_template_ti2i, _drop_idx=pipe._drop_idx,
                                     _img_token_id=pipe._img_token_id,
                                     _extract_masked_hidden=masked_hidden)
        self.sample_sigmas = pipe.config.sample_sigmas
        self.turbo = self.family == "qwen-image-21-turbo"
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config, patch=1)
        self.max_sequence_length = int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS)
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Qwen-Image 2.1 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """RGB pixels with an opaque alpha channel, one frame, through the VAE: the posterior's mean and std
        [B, C, h, w] on the CPU in fp32."""
        pixels = pixels.to(self.device, dtype=self.vae.dtype)
        rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1).unsqueeze(2)
        with torch.no_grad():
            dist = self.vae.encode(rgba).latent_dist
        return {"mean": dist.mean.squeeze(2).float().cpu(), "std": dist.std.squeeze(2).float().cpu()}

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """``QwenImage21Pipeline._get_qwen_prompt_embeds`` (text only), right-padded to ``max_sequence_length``:
        (features [B, L, D], mask of the real tokens [B, L])."""
        length = self.max_sequence_length
        view = self._view
        if active_fake_mode() is not None:  # the VRAM estimate: the longest captions (fake_tensors.py)
            view = longest_captions(view, length)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            embeds, mask, _ = QwenImage21Pipeline._get_qwen_prompt_embeds(view, list(captions), None,
                                                                           self.text_encoder.device)
        embeds, mask = embeds[:, :length], mask[:, :length]
        pad = length - embeds.shape[1]
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
        return embeds.float().to(self.device), mask.to(self.device).bool()

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        if (h * w) % 4:
            raise ValueError(f"Qwen-Image 2.1 gives one text slot to each 2×2 group of latents: {h}×{w} latents must "
                             "hold a multiple of 4 (image sides a multiple of 32)")
        device, dtype = model_input.device, model_input.dtype
        mask = conditioning.prompt_mask.to(device).bool()
        fake = is_fake(mask)  # the VRAM estimate: no values; every token kept, the longest caption (fake_tensors.py)
        lengths = None if fake else getattr(conditioning, "lengths", None)  # cached: known on the host
        if fake:
            length = mask.shape[1]
        else:  # the batch's longest, as the pipeline pads
            length = max(max(lengths) if lengths else int(mask.sum(1).max()), 1)
        embeds, mask = conditioning.prompt_embeds[:, :length].to(device, dtype), mask[:, :length]
        every_token = all(n == length for n in lengths) if lengths else (not fake and bool(mask.all()))
        img_mask = torch.cat([torch.zeros_like(mask), mask.new_ones(b, h * w // 4)], dim=1)
        tokens = model_input.reshape(b, c, h * w).transpose(1, 2)  # QwenImage21Pipeline._pack_latents
        with layout_from_shapes(self.transformer, fake):
            out = self.transformer(hidden_states=tokens, timestep=timesteps.to(device, torch.float32).reshape(-1),
                                   encoder_hidden_states=embeds,
                                   encoder_hidden_states_mask=None if fake or every_token else mask,
                                   img_shapes=[[(1, h, w)]] * b, img_mask=img_mask, return_dict=False)[0]
        return out[:, -h * w:].transpose(1, 2).reshape(b, c, h, w)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = QwenImage21Pipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                   text_encoder=self.text_encoder, processor=self.processor,
                                   transformer=self.transformer, sample_sigmas=self.sample_sigmas)
        pipe.set_progress_bar_config(disable=True)
        return QwenImage21Sampler(pipe)

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:qwen-image-21-template"

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file: ``diffusion_model.<module>``."""
        return {"unet": (PREFIX, _same)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA as ``diffusion_model.<module>`` (α/r baked into ``lora_B``)."""
        out = peft_layout_state_dict(modules, {"unet": PREFIX}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any],
                             adapter_name: str = "default") -> int:
        """A ``diffusion_model.`` file into fresh peft layers (a ``transformer.`` file as :class:`PeftLayoutLora`
        reads it)."""
        if not any(k.startswith(PREFIX + ".") for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        used = load_peft_layout(state, {"unet": modules["unet"]}, {"unet": PREFIX}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py): what ComfyUI's diffusion-model loader and
        ``QwenImage21Transformer2DModel.from_single_file`` read, and model.path here."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
