"""Flux.1 dev / schnell on diffusers' ``FluxPipeline`` classes, and FLUX.1 Kontext [dev] on ``FluxKontextPipeline``.

What differs from the SD lineage, and where it lives here:

- Flow matching (``trainer.objectives.FlowMatchingObjective``): σ uniform and unshifted, as diffusers'
  ``train_dreambooth_lora_flux.py`` draws it (dev's scheduler skips its shift under ``use_dynamic_shifting``);
  ``loss.resolution_shift`` shifts it by the μ of the packed image-token count ``FluxPipeline`` samples with
  (kohya's ``flux_shift``), ``loss.flow_shift`` by a fixed shift (kohya's default 3). The transformer takes σ.
- Packed latents: 16-channel VAE latents, ``(z − shift_factor) · scaling_factor``, packed 2×2 into
  64-wide tokens with 3-axis position ids; :meth:`predict` packs, runs and unpacks, so the loop sees
  [B, 16, h, w] like any family.
- Text: the pooled vector from CLIP-L (``text_encoder``) and T5's hidden states (``text_encoder_2``),
  as ``FluxPipeline.encode_prompt``; each with its own caption dropout (the empty caption's encoding).
- Guidance: dev (and Kontext) is guidance-distilled; training feeds ``model.guidance_scale`` (default 3.5, as
  diffusers' train_dreambooth_lora_flux.py and kohya's flux_train_network.py do) into its guidance embedding,
  in fp32 as they pass it; schnell has none and ignores the setting (validate says so).
- Kontext (flux/kontext.py): dev's transformer trained on pairs; :meth:`batch_condition` carries the control
  latents, :meth:`predict` packs them after the target's tokens (ids with first coordinate 1) and cuts the
  prediction back, :meth:`prompt_kwargs` gives samples their control image. Its single file has dev's keys
  (nothing tells them apart), so it needs ``model.family: flux-kontext``.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>.lora_A/lora_B``, α/r baked into
  lora_B), which ``FluxPipeline.load_lora_weights`` loads and ComfyUI maps for Flux (comfy/lora.py,
  ``model_lora_keys_unet``: ``transformer.{diffusers key}``); CLIP-L LoRA as ``text_encoder.…`` likewise.
  Fine-tunes as the BFL single file (keys.py). LoHa/LoKr as ``lycoris_<module>`` (ComfyUI's SimpleTuner
  LyCORIS keys; diffusers has no LyCORIS loader).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
from huggingface_hub import constants
from safetensors.torch import load_file

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError, ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.fp8_weights import dequantise_fp8, fp8_layer_scales
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.common.packed_ids import latent_image_ids
from trainer.families.common.peft_lora import clip_text_model, load_peft_layout, peft_layout_state_dict, target_regex
from trainer.families.common.prompt_first import PromptFirst
from trainer.families.flux import kontext
from trainer.families.flux.keys import bfl_to_diffusers, config_from_bfl, diffusers_to_bfl
from trainer.families.sources import classify_source, detect_source_family
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.metadata import modelspec_common
from trainer.objectives import flow_objective_for

log = logging.getLogger("atelier")
CONFIGS = Path(__file__).parent / "configs"
OFFICIAL = {"flux-dev": "black-forest-labs/FLUX.1-dev", "flux-schnell": "black-forest-labs/FLUX.1-schnell",
            "flux-kontext": "black-forest-labs/FLUX.1-Kontext-dev"}
T5_MAX = {"flux-dev": 512, "flux-schnell": 256, "flux-kontext": 512}
PIPELINES = {"flux-dev": FluxPipeline, "flux-schnell": FluxPipeline, "flux-kontext": FluxKontextPipeline}
# modelspec.architecture and ss_base_model_version of LoRA files
MODELSPEC = {"flux-dev": ("flux-1-dev", "flux1_dev"), "flux-schnell": ("flux-1-schnell", "flux1_schnell"),
             "flux-kontext": ("flux-1-kontext-dev", "flux1_kontext")}
# transformer LoRA targets (diffusers module-name endings)
TARGETS = {
    "attn": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    "attn_mlp": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                 "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                 "single_transformer_blocks.*.proj_out"],
    "all": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
            "single_transformer_blocks.*.proj_out", "norm1.linear", "norm1_context.linear", "norm.linear"],
}
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
T5_TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]


class FluxConditioning:
    """T5 ``prompt_embeds`` [B, L, D] and CLIP-L ``pooled_prompt_embeds`` [B, P]; Kontext adds ``control``, the
    control image's normalised latents [B, 16, h', w'] (None otherwise); ``.to()`` like a tensor."""

    def __init__(self, prompt_embeds, pooled_prompt_embeds, control=None):
        self.prompt_embeds, self.pooled_prompt_embeds, self.control = prompt_embeds, pooled_prompt_embeds, control

    def to(self, *args: Any, **kwargs: Any) -> "FluxConditioning":
        return FluxConditioning(self.prompt_embeds.to(*args, **kwargs), self.pooled_prompt_embeds.to(*args, **kwargs),
                                None if self.control is None else self.control.to(*args, **kwargs))


class Flux(Family):
    name = "flux"
    prediction_type = "flow"
    true_cfg = False  # dev: guidance-distilled (an embedded guidance input); schnell: no guidance
    # the blocks' AdaLN modulation Linears (norm1.linear, norm1_context.linear, norm.linear: ~3.2B parameters, 6 GiB
    # in bf16) are stored in fp8/NF4 with the rest, as kohya/musubi (img_mod.lin) and the NF4 Flux checkpoints do;
    # the final norm_out's and the embedders stay in full precision
    fp8_skip = ("norm_out", "x_embedder", "context_embedder", "time_text_embed", "proj_out")
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        variant = found or (chosen if chosen in OFFICIAL else "flux-dev")
        if chosen == kontext.VARIANT:  # a Kontext single file has dev's keys: only model.family tells
            variant = kontext.VARIANT
        elif found == kontext.VARIANT and chosen in OFFICIAL:
            raise ModelLoadError(f"model.family is {chosen}, but '{self.source.display}' is FLUX.1 Kontext [dev] (its "
                                 "model_index.json names FluxKontextPipeline), which trains on pairs. Set "
                                 "model.family to flux-kontext or auto.", key="model.family", value=chosen)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder",
                                      text_encoder_2="text_encoder_2")
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, variant, dtypes)
        else:
            pipe = sources.load_pipeline(PIPELINES[variant], self.source, mcfg, workspace, family=variant,
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.text_encoder_2, self.tokenizer_2 = pipe.text_encoder_2, pipe.tokenizer_2
        self.family = "flux-dev" if self.transformer.config.guidance_embeds else "flux-schnell"
        self.kontext = variant == kontext.VARIANT
        if self.kontext:
            if not self.transformer.config.guidance_embeds:
                raise ModelLoadError(f"model.family is flux-kontext, but '{self.source.display}' has no guidance "
                                     "embedding (guidance_in): it is Flux.1 schnell, not FLUX.1 Kontext [dev]. Point "
                                     "model.path at the Kontext weights, or set model.family to auto.",
                                     key="model.family", value=chosen)
            self.family = kontext.VARIANT
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.disabled = frozenset(getattr(mcfg, "disabled", ()) or ())  # text encoders switched off
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or T5_MAX[self.family]),
                                       int(self.tokenizer_2.model_max_length))
        self.guidance = float(getattr(mcfg, "guidance_scale", ModelConfig.guidance_scale))
        self.objective = self._objective()
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "text_encoder_2", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Flux runs on PyTorch SDPA. Use sdpa.", key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    # --- loading ----------------------------------------------------------------------------
    def _from_single_file(self, mcfg: Any, variant: str, dtypes: Dict[str, Any]):
        """The BFL transformer file, with VAE/CLIP/T5 from ``model.config_path`` (a diffusers folder or
        hub id; default the official repo of the variant)."""

        try:
            state = load_file(self.source.location)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}' could not be read as a .safetensors file: "
                                 f"{exc}", key="model.path", value=self.source.display) from None
        scales = fp8_layer_scales(state, bfl_to_diffusers)  # an fp8 release: which layers, with which scales
        state = dequantise_fp8(state, dtypes["transformer"], self.source.display)  # floats to build the model from
        base = json.loads((CONFIGS / variant / "transformer" / "config.json").read_text())
        pipeline_cls = PIPELINES[variant]
        try:
            config = config_from_bfl(state, base)
            transformer = FluxTransformer2DModel.from_config(config)
            missing, unexpected = transformer.load_state_dict(bfl_to_diffusers(state), strict=False)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a complete Flux.1 transformer in the "
                                 f"original (BFL) layout ({type(exc).__name__}: {exc}).", key="model.path",
                                 value=self.source.display) from None
        if missing or unexpected:
            raise ModelLoadError(f"model.path '{self.source.display}': the Flux transformer's weights do not fit "
                                 f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}).",
                                 key="model.path", value=self.source.display)
        transformer.to(dtypes["transformer"])
        if scales:  # kept in fp8 with these scales once the adapters exist (memory/precision.py apply_storage)
            transformer.fp8_file_scales = scales
        rest = getattr(mcfg, "config_path", "") or OFFICIAL[variant]
        offline = bool(getattr(mcfg, "hub_offline", False)) or not Path(rest).is_dir() and hub_offline()
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(  # the variant's own (schnell: no dynamic shift)
            json.loads((CONFIGS / (variant if variant == kontext.VARIANT else config_variant(config)) / "scheduler"
                        / "scheduler_config.json").read_text()))
        kw: Dict[str, Any] = {"dtype": {k: v for k, v in dtypes.items() if k != "transformer"}, "scheduler": scheduler}
        if not Path(rest).is_dir():
            kw.update(cache_dir=getattr(mcfg, "cache_dir", "") or None, revision=getattr(mcfg, "revision", "") or None)
        try:
            return pipeline_cls.from_pretrained(rest, transformer=transformer,
                                                local_files_only=offline or Path(rest).is_dir(), **kw)
        except Exception as exc:
            raise ModelLoadError(
                f"model.path '{self.source.display}' is the Flux transformer alone; its VAE and text encoders come "
                f"from model.config_path ('{rest}'), which could not be loaded ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}). Set model.config_path to a diffusers Flux folder "
                f"(or the hub id {OFFICIAL[variant]}, downloaded once with network access).",
                key="model.config_path", value=rest) from None

    def _objective(self):
        return flow_objective_for(self._sched_config)

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: frozenset = frozenset()):
        ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        with torch.set_grad_enabled(torch.is_grad_enabled() and "text_encoder" in grads):
            pooled = self.text_encoder(ids.to(self.device), output_hidden_states=False).pooler_output
        ids_2 = self.tokenizer_2(captions, padding="max_length", max_length=self.max_sequence_length,
                                 truncation=True, return_tensors="pt").input_ids
        with torch.set_grad_enabled(torch.is_grad_enabled() and "text_encoder_2" in grads):
            prompt_embeds = self.text_encoder_2(ids_2.to(self.device), output_hidden_states=False)[0]
        return prompt_embeds, pooled

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """The text cache's entry: T5's 512 tokens in the dtype they come out in (bf16 from a bf16/fp8 T5: 4 MB a
        caption instead of 8 in fp32; the step casts them to its compute dtype, which leaves a bf16 value as it is;
        Flux attends to T5's padding, so it is not cut), CLIP's pooled vector in fp32."""
        with torch.no_grad():
            prompt_embeds, pooled = self._encode(list(captions))
        return {"prompt_embeds": prompt_embeds.cpu(), "pooled_prompt_embeds": pooled.float().cpu()}

    def _drop(self, prompt_embeds, pooled, drop_te1, drop_te2):
        """Per-encoder caption dropout: the flagged images get that encoder's encoding of the empty caption."""
        if not (drop_te1 is not None and any(drop_te1)) and not (drop_te2 is not None and any(drop_te2)):
            return prompt_embeds, pooled
        if self._empty is None:
            self._empty = self.encode_captions([""])
        if drop_te1 is not None and any(drop_te1):
            flags = flags_on(drop_te1, pooled.device)[:, None]
            empty = kept_on(self, "pooled_prompt_embeds", self._empty["pooled_prompt_embeds"], pooled)
            pooled = torch.where(flags, empty, pooled)
        if drop_te2 is not None and any(drop_te2):
            flags = flags_on(drop_te2, prompt_embeds.device)[:, None, None]
            empty = kept_on(self, "prompt_embeds", self._empty["prompt_embeds"], prompt_embeds)
            prompt_embeds = torch.where(flags, empty, prompt_embeds)
        return prompt_embeds, pooled

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if batch.get("prompt_embeds") is not None:
            prompt_embeds = batch["prompt_embeds"].to(self.device)
            pooled = batch["pooled_prompt_embeds"].to(self.device)
        else:
            prompt_embeds, pooled = self._encode(list(expand(batch["captions"])),
                                                 frozenset(train_text) & {"text_encoder", "text_encoder_2"})
        control = kontext.control_latents(batch, self.vae.config, self.device) if self.kontext else None
        return FluxConditioning(*self._drop(prompt_embeds, pooled, drop_te1, drop_te2), control=control)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        if h % 2 or w % 2:
            raise ValueError(f"Flux packs 2×2 latent patches: latents of {h}×{w} must be even (image sizes a multiple "
                             f"of {2 * self.vae_scale_factor})")
        dtype = model_input.dtype
        packed = FluxPipeline._pack_latents(model_input, b, c, h, w)
        img_ids = latent_image_ids(h // 2, w // 2, model_input.device, dtype)  # diffusers': made on the CPU, copied
        tokens = packed.shape[1]
        if conditioning.control is not None:  # Kontext: the control's tokens after the target's, ids (1, y, x)
            control = conditioning.control.to(model_input.device, dtype)
            packed, img_ids = kontext.pack_with_control(packed, img_ids, control)
        prompt_embeds = conditioning.prompt_embeds.to(model_input.device, dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=model_input.device, dtype=dtype)
        # σ and the guidance in fp32, as diffusers' Flux trainers pass them (FluxPipeline: the guidance in fp32, t in
        # the latents' dtype); the transformer casts both to the hidden states' dtype before it embeds them
        guidance = (torch.full((b,), self.guidance, device=model_input.device, dtype=torch.float32)
                    if self.transformer.config.guidance_embeds else None)
        timestep = timesteps.to(model_input.device, torch.float32)
        out = self.transformer(hidden_states=packed, timestep=timestep, guidance=guidance,
                               pooled_projections=conditioning.pooled_prompt_embeds.to(model_input.device, dtype),
                               encoder_hidden_states=prompt_embeds, txt_ids=txt_ids, img_ids=img_ids,
                               return_dict=False)[0]
        return FluxPipeline._unpack_latents(out[:, :tokens], h * self.vae_scale_factor, w * self.vae_scale_factor,
                                            self.vae_scale_factor)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """FluxPipeline (Kontext: FluxKontextPipeline) over the live modules with the model's own flow-matching
        Euler sampler (the SD samplers of ``sampling.scheduler`` do not apply to flow models)."""
        pipe = PIPELINES[self.family](scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                            text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                            text_encoder_2=self.text_encoder_2, tokenizer_2=self.tokenizer_2,
                            transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return PromptFirst(pipe) if self.kontext else pipe  # FluxKontextPipeline takes the image first

    def sampling_kwargs(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"max_sequence_length": self.max_sequence_length}
        if "text_encoder_2" in self.disabled:  # T5 off: the pipeline's prompt_2 (T5's prompt) is the empty caption
            out["prompt_2"] = ""
        return out

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Kontext: the sample's control image at the sample's size (flux/kontext.py says why)."""
        if not self.kontext:
            return {}
        return kontext.sample_control(sample_prompt, 2 * self.vae_scale_factor) or {}

    def check_captions(self, captions) -> None:
        """T5 off (parts.text_encoder_2.enabled = false): only CLIP-L reads the caption, and it cuts at 77
        tokens; a longer caption would train on a silently truncated text."""
        if "text_encoder_2" not in self.disabled:
            return
        limit = self.tokenizer.model_max_length  # 77, with the start and end tokens
        long = [(path, n) for path, text in captions
                if (n := len(self.tokenizer(text, truncation=False).input_ids)) > limit]
        if long:
            shown = ", ".join(f"{getattr(p, 'name', p)} ({n} tokens)" for p, n in long[:5])
            raise ConfigError(f"parts.text_encoder_2.enabled = false (T5 off): only CLIP-L reads the captions and it "
                              f"stops at {limit} tokens, but {len(long)} caption(s) are longer: {shown}"
                              f"{' …' if len(long) > 5 else ''}. Turn T5 back on, or shorten those captions.",
                              key="parts.text_encoder_2.enabled", value=False)

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{part_dtype(mcfg, 'text_encoder_2')}:{self.max_sequence_length}"

    # --- export -----------------------------------------------------------------------------
    def lora_targets(self, slot: str, preset: str):
        if slot == "unet":
            return target_regex(TARGETS[preset])
        return list(CLIP_TARGETS if slot == "text_encoder" else T5_TARGETS)

    def lora_namer(self):
        """LyCORIS (LoHa/LoKr) names: ``lycoris_<diffusers module path>`` (ComfyUI's Flux key map)."""
        return {"unet": ("lycoris", lambda p: p),
                "text_encoder": ("lora_te1", _clip_text_model),
                "text_encoder_2": ("lora_te2", lambda p: p)}

    def peft_file_names(self):
        return {"unet": ("transformer", lambda p: p), "text_encoder": ("text_encoder", clip_text_model)}

    _FILE_PREFIXES = {"unet": "transformer", "text_encoder": "text_encoder"}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """LoRA in the diffusers/peft layout with α/r baked into ``lora_B`` (families/common/peft_lora.py)."""
        if "text_encoder_2" in modules:
            raise ValueError("Flux LoRA files hold the transformer and CLIP-L (diffusers loads no T5 LoRA for Flux): "
                             "turn parts.text_encoder_2.train off")
        out = peft_layout_state_dict(modules, self._FILE_PREFIXES, adapter_name, {"text_encoder": clip_text_model})
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        """The inverse of :meth:`lora_state_dict` into fresh peft layers (``lora.init_weights``)."""
        used = load_peft_layout(state, modules, self._FILE_PREFIXES, adapter_name, {"text_encoder": clip_text_model})
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        meta = modelspec_common(title=title, resolution=resolution)
        architecture, version = MODELSPEC[self.family]
        meta.update({"modelspec.architecture": f"{architecture}/lora",
                     "modelspec.implementation": "https://github.com/black-forest-labs/flux",
                     "ss_base_model_version": version})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the BFL single file ComfyUI's UNet loader reads (VAE and text
        encoders are separate files in that world)."""
        state = cast_state_dict({k: v.detach().cpu().contiguous() for k, v in
                                 diffusers_to_bfl(self.transformer.state_dict()).items()}, dtype)
        write_checkpoint(Path(path), state, metadata or {})


def _clip_text_model(path: str) -> str:
    return clip_text_model(path)


def config_variant(transformer_config: dict) -> str:
    return "flux-dev" if transformer_config.get("guidance_embeds") else "flux-schnell"


def hub_offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)
