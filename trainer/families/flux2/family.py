"""Flux.2 [klein] on diffusers' ``Flux2KleinPipeline`` and Flux.2 [dev] on ``Flux2Pipeline``: Flux.2's transformer
(shared modulation, fused single-block projections, 4-axis RoPE) over Qwen3 ([klein]) or Mistral Small 3.1 ([dev])
features and the 32-channel Flux.2 VAE.

What differs, and where it lives here:

- Latents: the VAE's 32 channels patchified 2×2 into 128 (``_patchify_latents``) and normalised by the VAE's own
  BatchNorm statistics (``vae.bn``), as the pipeline inverts them before decoding; the cache keeps the patchified
  posterior, so loss masks meet latents of the transformer's size. Tokens are the patchified latents in row order,
  with 4-axis position ids (``_prepare_latent_ids``).
- Text: the caption in Qwen3's chat template (thinking off), three hidden layers stacked side by side
  (``_get_qwen3_prompt_embeds``; (9, 18, 27) for the released 4B/9B, spread over the depth of smaller models), with
  4-axis text ids. Caption dropout gives the empty caption's features.
- [dev]: the caption after BFL's system prompt in Mistral's chat template, layers (10, 20, 30) stacked
  (``_get_mistral_3_small_prompt_embeds``); the processor folder is read as its tokenizer (the text path needs no
  image processor, which would need torchvision); a guidance embedding fed ``model.guidance_scale`` (default 3.5,
  diffusers' train_dreambooth_lora_flux2.py ``--guidance_scale``; musubi feeds 1.0).
- Flow matching with σ drawn as diffusers' Flux.2 trainers draw it: uniform and unshifted when the scheduler shifts
  by resolution (``use_dynamic_shifting``: the pipeline's empirical μ is for sampling), its fixed shift otherwise;
  ``loss.flow_shift`` and ``loss.timestep_distribution`` change it. The transformer takes σ; no guidance embedding in
  [klein] (the base model samples with real CFG, the distilled one without).
- Reference images (``data.concepts[].control_paths``; up to 4 for [klein], 6 for [dev]): see
  :mod:`trainer.families.flux2.references`. Each reference's cached posterior mean, normalised like the target, packed
  after the target's tokens with its own position ids (time 10, 20, …); the prediction is cut to the target's tokens.
  The LoRA's modules are the same with or without references.
- Files: LoRA in the original BFL layout (``diffusion_model.<BFL module>``, :mod:`trainer.families.flux2.lora_keys`),
  which ComfyUI maps for Flux.2 and ``Flux2KleinPipeline``/``Flux2Pipeline.load_lora_weights`` convert on load
  (the diffusers layout loses most adapters in ComfyUI); ``lora.init_weights`` reads it and the older diffusers
  layout. Fine-tunes as the transformer's weights in one file under diffusers' names. Single files in: the
  transformer, with the VAE, Qwen3 and tokenizer from ``model.config_path`` (default black-forest-labs/FLUX.2-klein-4B).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from huggingface_hub import hf_hub_download

from trainer.config.schema import ModelConfig
from trainer.errors import ModelLoadError
from trainer.families import SampleDefaults, sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.common.packed_ids import flux2_latent_ids, flux2_text_ids
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.flux2 import lora_keys
from trainer.families.flux2.keys import config_from_state, diffusers_to_bfl, to_diffusers
from trainer.families.flux2.references import Flux2Input, load_images, normalise, reference_tokens
from trainer.families.sources import classify_source, detect_source_family, hub_kwargs, hub_offline
from trainer.formats.kohya import lora_layers
from trainer.objectives import FlowMatchingObjective
from trainer.parallel.distributed import expand_rows

OFFICIAL = "black-forest-labs/FLUX.2-klein-4B"
OFFICIAL_DEV = "black-forest-labs/FLUX.2-dev"
MAX_TOKENS = 512
ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj",
        "single_transformer_blocks.*.attn.to_out"]  # (a double block's to_out is a ModuleList around to_out.0)
TARGETS = {"attn": ATTN,
           "attn_mlp": ATTN + ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"],
           # not the shared modulation Linears (double_stream_modulation_img/txt, single_stream_modulation), which every
           # block reads; custom targets may name them (the BFL layout names them, and ComfyUI and diffusers map them)
           "all": ATTN + ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]}


def _bfl_name(path: str) -> str:
    """A transformer module's name in a BFL-layout LoRA file, for the model tools: q/k/v share their fused Linear's
    name (the tools stack the rows in the order diffusers registers them: q, k, v); KeyError for the final norm's
    Linear, whose rows the file keeps in BFL's order."""
    if path == "norm_out.linear":
        raise KeyError(path)
    return lora_keys.bfl_module(path)[0]


def _processor_chat_template(location: str, mcfg: Any) -> str:
    """The chat template of Flux.2 [dev]'s processor (``tokenizer/chat_template.jinja`` or ``.json``), for a tokenizer
    that carries none; ModelLoadError naming the folder when there is neither."""

    for name in ("chat_template.jinja", "chat_template.json"):
        try:
            if Path(location).is_dir():
                path = Path(location) / "tokenizer" / name
            else:
                path = Path(hf_hub_download(location, f"tokenizer/{name}", local_files_only=hub_offline(mcfg),
                                            **hub_kwargs(mcfg)))
            text = path.read_text(encoding="utf-8")
        except Exception:
            continue
        return json.loads(text)["chat_template"] if name.endswith(".json") else text
    raise ModelLoadError(f"'{location}': Flux.2 [dev]'s tokenizer/ has no chat template (tokenizer_config.json, "
                         "chat_template.jinja or chat_template.json); its captions are encoded in Mistral's chat format. "
                         "Use the complete tokenizer/ folder of black-forest-labs/FLUX.2-dev.", key="model.path",
                         value=location)


def _one_logit(_module, args, kwargs):
    """Qwen3's next-token logits for the last position only: diffusers' ``_get_qwen3_prompt_embeds`` reads three
    hidden layers and never the logits, which for every token are [B, L, 151936] (2.5 GiB for 16 captions of 512
    tokens in bf16)."""
    kwargs.setdefault("logits_to_keep", 1)
    return args, kwargs


class Flux2Conditioning:
    """Qwen3 features [B, L, 3·D]; ``.to()`` like a tensor."""

    def __init__(self, prompt_embeds):
        self.prompt_embeds = prompt_embeds

    def to(self, *args: Any, **kwargs: Any) -> "Flux2Conditioning":
        return Flux2Conditioning(self.prompt_embeds.to(*args, **kwargs))


class PromptSampler:
    """Flux2KleinPipeline takes reference images first and the prompt second; every family's pipeline is called with
    the prompt first. Anything else (``load_lora_weights`` …) reaches the pipeline."""

    def __init__(self, pipe: Any):
        self.pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, prompt, **kwargs: Any):
        return self.pipe(prompt=prompt, **kwargs)


class Flux2(PeftLayoutLora, Family):
    name = "flux2"
    family = "flux2-klein"
    prediction_type = "flow"
    true_cfg = False  # sampled once a step: [dev]'s guidance is embedded (the VRAM estimate counts one pass)
    fp8_skip = ("norm", "x_embedder", "context_embedder", "time_guidance_embed", "modulation", "proj_out")
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")
    targets = TARGETS
    modelspec = ("flux-2-klein", "https://github.com/black-forest-labs/flux2", "flux2_klein")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        variant = found or (chosen if chosen in ("flux2-klein", "flux2-dev") else "flux2-klein")
        self.dev = variant == "flux2-dev"
        self.family = variant
        pipeline_cls = Flux2Pipeline if self.dev else Flux2KleinPipeline
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        # [dev]: component by component, so tokenizer/ (a PixtralProcessor folder, whose processor would need
        # torchvision) is read as the plain tokenizer the text path needs
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, dtypes, pipeline_cls)
        else:
            pipe = sources.load_pipeline(pipeline_cls, self.source, mcfg, workspace, family=variant, dtype=dtypes,
                                         by_component=self.dev)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        if self.dev and not getattr(self.tokenizer, "chat_template", None):
            rest = self.source.location if self.source.kind != "single_file" else \
                (getattr(mcfg, "config_path", "") or OFFICIAL_DEV)
            self.tokenizer.chat_template = _processor_chat_template(rest, mcfg)
        if hasattr(self.text_encoder, "lm_head"):  # Qwen3 / Mistral3: only hidden states are read (below)
            self.text_encoder.register_forward_pre_hook(_one_logit, with_kwargs=True)
        self._is_distilled = bool(pipe.config.get("is_distilled", False))
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = self._objective()
        text_config = getattr(self.text_encoder.config, "text_config", self.text_encoder.config)
        depth = int(text_config.num_hidden_layers)
        released = (10, 20, 30) if self.dev else (9, 18, 27)
        self.text_layers = released if depth >= released[-1] else \
            tuple(max(1, round(depth * k / 3)) for k in (1, 2, 3))
        self.max_sequence_length = MAX_TOKENS
        self.guidance = float(getattr(mcfg, "guidance_scale", ModelConfig.guidance_scale))
        if self.dev:
            self.modelspec = ("flux-2-dev", "https://github.com/black-forest-labs/flux2", "flux2_dev")
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Flux.2 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    def _objective(self):
        """σ as diffusers' Flux.2 trainers draw it (train_dreambooth_lora_flux2*.py, ``--weighting_scheme none``):
        uniform over the training scheduler's σ, which ``FlowMatchEulerDiscreteScheduler`` leaves unshifted when
        ``use_dynamic_shifting`` is on (the released models) and shifts by its fixed ``shift`` otherwise. The
        pipeline's ``compute_empirical_mu`` is a fit for a number of *sampling* steps (at 50 it put the median σ at
        0.88 for 1024² images); no reference trainer draws training σ with it (docs/families.md)."""
        if not self._sched_config.get("use_dynamic_shifting", False):
            return FlowMatchingObjective(shift=float(self._sched_config.get("shift", 1.0)))
        return FlowMatchingObjective(shift=1.0)

    def _from_single_file(self, mcfg: Any, dtypes: Dict[str, Any], pipeline_cls: Any):
        return pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=pipeline_cls,
                                              transformer_cls=Flux2Transformer2DModel, config=config_from_state,
                                              to_diffusers=to_diffusers,
                                              official=OFFICIAL_DEV if self.dev else OFFICIAL,
                                              layout="BFL's or diffusers' layout", by_component=self.dev)

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """The posterior's mean and std, patchified 2×2 (the transformer's latent space, before normalising)."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        patch = Flux2KleinPipeline._patchify_latents
        return {"mean": patch(dist.mean).float().cpu(), "std": patch(dist.std).float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        """A latent drawn from the cached posterior, normalised by the VAE's BatchNorm statistics."""
        mean, std = dist["mean"].to(self.device), dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype,  # on the generator's device
                          device=None if generator is None else generator.device).to(self.device)
        return normalise(self.vae, mean + std * eps)

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            if self.dev:
                return Flux2Pipeline._get_mistral_3_small_prompt_embeds(
                    self.text_encoder, self.tokenizer, [str(c) for c in captions], device=self.device,
                    max_sequence_length=self.max_sequence_length, hidden_states_layers=self.text_layers)
            return Flux2KleinPipeline._get_qwen3_prompt_embeds(
                self.text_encoder, self.tokenizer, [str(c) for c in captions], device=self.device,
                max_sequence_length=self.max_sequence_length, hidden_states_layers=self.text_layers)

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        captions = list(captions)
        # [dev]: Mistral's 41 hidden states of a caption are 21 MiB each at 512 tokens: 4 captions at a time
        step = 4 if self.dev else max(1, len(captions))
        with torch.no_grad():
            return {"prompt_embeds": torch.cat([self._encode(captions[i:i + step]).float().cpu()
                                                for i in range(0, len(captions), step)])}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
        else:
            embeds = self._encode(list(expand(batch["captions"])), "text_encoder" in train_text)
        if drop_te1 is not None and any(drop_te1):
            if self._empty is None:
                self._empty = self.encode_captions([""])
            flags = flags_on(drop_te1, embeds.device)
            empty = kept_on(self, "prompt_embeds", self._empty["prompt_embeds"], embeds)
            embeds = torch.where(flags[:, None, None], empty, embeds)
        return Flux2Conditioning(embeds)

    # --- the denoiser -------------------------------------------------------------------------
    def model_input(self, noisy_latents, batch: Dict[str, Any], generator=None, warn=None):
        """The noisy latents, with the batch's reference images (``control_latents``, one entry per control folder)
        when it has them: each reference's posterior mean (the pipeline encodes references with
        ``sample_mode="argmax"``), normalised as the target is. ``noisy_latents`` has the global micro-batch's rows
        with several processes (``batch["global_rows"]``); the references of the other processes' rows are zeros."""
        controls = batch.get("control_latents")
        if not controls:
            return noisy_latents
        rows = batch.get("global_rows")
        refs = [expand_rows(normalise(self.vae, c["mean"].to(self.device, torch.float32)), rows) for c in controls]
        return Flux2Input(noisy_latents, [r.to(noisy_latents.device, noisy_latents.dtype) for r in refs])

    def predict(self, model_input, timesteps, conditioning):
        """The target's tokens, then the references' (each with its own time offset) as the pipeline's denoising
        step joins them; the velocity of the target's tokens, unpacked."""
        references = model_input.references if isinstance(model_input, Flux2Input) else ()
        latents = model_input.latents if isinstance(model_input, Flux2Input) else model_input
        b, c, h, w = latents.shape
        dtype, device = latents.dtype, latents.device
        tokens = Flux2KleinPipeline._pack_latents(latents)
        img_ids = flux2_latent_ids(latents)  # diffusers' helpers make the ids on the CPU: a blocking copy
        if references:
            ref_tokens, ref_ids = reference_tokens(references)
            tokens = torch.cat([tokens, ref_tokens.to(device, dtype)], dim=1)
            img_ids = torch.cat([img_ids, ref_ids.to(device)], dim=1)
        embeds = conditioning.prompt_embeds.to(device, dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:  # [dev]: the embedded guidance (the transformer scales it by 1000)
            guidance = torch.full((b,), self.guidance, device=device, dtype=torch.float32)
        # σ in fp32, as diffusers' Flux.2 trainers pass it (timesteps / 1000 of the fp32 schedule): the transformer
        # casts it to the hidden states' dtype itself before it embeds it
        out = self.transformer(hidden_states=tokens, timestep=timesteps.to(device, torch.float32), guidance=guidance,
                               encoder_hidden_states=embeds,
                               txt_ids=flux2_text_ids(embeds),
                               img_ids=img_ids, return_dict=False)[0][:, :h * w]
        return out.permute(0, 2, 1).reshape(b, c, h, w)  # tokens are in row order: the inverse of _pack_latents

    # --- sampling ---------------------------------------------------------------------------
    def sample_defaults(self) -> SampleDefaults:
        """[klein]: the step-distilled models' (4 steps) or, when the pipeline says it is not distilled, the Base
        models' (50 steps at CFG 4)."""
        if not self.dev and not self._is_distilled:
            return self.info.sample_defaults_for("flux2-klein-base")
        return super().sample_defaults()

    def pipeline(self, sampler: Optional[str] = None):
        if self.dev:
            pipe = Flux2Pipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                 text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
            pipe.set_progress_bar_config(disable=True)
            return PromptSampler(pipe)
        pipe = Flux2KleinPipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                  text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer,
                                  is_distilled=self._is_distilled)
        pipe.set_progress_bar_config(disable=True)
        return PromptSampler(pipe)

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length, "text_encoder_out_layers": self.text_layers}

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """The sample prompt's reference images (``control_images``) as the pipeline's ``image=``; the pipeline
        sizes them by its own rule (:mod:`trainer.families.flux2.references`)."""
        images = load_images(getattr(sample_prompt, "control_images", None) or [])
        return {"image": images} if images else {}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:{self.text_layers}"

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file (``peft:diffusion_model.<BFL>``)."""
        return {"unet": ("diffusion_model", _bfl_name)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA in the BFL layout (α/r baked into ``lora_B``; q/k/v fused block-diagonally)."""
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return lora_keys.to_bfl(out)

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        """A BFL-layout file (as written, or another trainer's with shared q/k/v A) into fresh peft layers; a file in
        the diffusers layout (Atelier's earlier Flux.2 files) as :class:`PeftLayoutLora` reads it."""
        if not any(k.startswith(lora_keys.PREFIX) for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        ranks = {path: layer.r[adapter_name] for path, layer in lora_layers(modules["unet"], adapter_name)}
        used = load_peft_layout(lora_keys.from_bfl(state, ranks), {"unet": modules["unet"]}, {"unet": "transformer"},
                                adapter_name)
        extra = sorted(set(state) - lora_keys.used_keys(state, ranks))
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as BFL's single file (flux2/keys.py says why): what ComfyUI's UNET loader and
        ``Flux2Transformer2DModel.from_single_file`` read, and model.path here."""
        save_transformer_file(path, diffusers_to_bfl(self.transformer.state_dict()), dtype, metadata)
