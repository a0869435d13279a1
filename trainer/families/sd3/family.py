"""Stable Diffusion 3 / 3.5 (large, medium) on diffusers' ``StableDiffusion3Pipeline`` classes.

What differs from the SD lineage, and where it lives here:

- Flow matching (``trainer.objectives.FlowMatchingObjective``) with the fixed shift its scheduler config declares
  (3.0 for the released models); the transformer takes σ·1000 as its timestep, as the pipeline passes it.
- Text: three encoders, as ``StableDiffusion3Pipeline.encode_prompt`` assembles them: CLIP-L's and CLIP-G's
  penultimate hidden states side by side, zero-padded to T5's width, then T5's hidden states after them in the
  sequence; the pooled vector is CLIP-L's and CLIP-G's projected outputs side by side. Each encoder has its own
  caption dropout (its encoding of the empty caption); T5 can be switched off (``parts.text_encoder_3.enabled``:
  it then contributes zeros, as the pipeline does without T5). The cache keeps each encoder's
  outputs apart, so dropout and switches act on cached captions too.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>``, ``text_encoder.<CLIP-L module>``,
  ``text_encoder_2.<CLIP-G module>``; α/r baked into lora_B), which ``StableDiffusion3Pipeline.load_lora_weights``
  and ComfyUI (comfy/lora.py maps ``transformer.<diffusers key>`` for SD3) load. Fine-tunes as Stability's single
  file of the transformer (keys.py: ``model.diffusion_model.joint_blocks…``), which ComfyUI's UNET loader and
  diffusers' ``SD3Transformer2DModel.from_single_file`` read. Single files in: the transformer, with the VAE and
  text encoders from ``model.config_path`` (a diffusers SD3 folder or hub id; default the official, gated repo).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import load_file

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.fp8_weights import dequantise_fp8, fp8_layer_scales
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.common.peft_lora import clip_text_model, load_peft_layout, peft_layout_state_dict, target_regex
from trainer.families.sd3.keys import (
    CONFIG_3_MEDIUM,
    CONFIG_35_LARGE,
    CONFIG_35_MEDIUM,
    ORIGINAL_PREFIX,
    config_from_original,
    diffusers_to_original,
    original_to_diffusers,
)
from trainer.families.sources import classify_source, detect_source_family, hub_offline
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.metadata import modelspec_common
from trainer.objectives import FlowMatchingObjective

OFFICIAL = {"sd3.5-large": "stabilityai/stable-diffusion-3.5-large",
            "sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium",
            "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers"}
T5_MAX = 256  # StableDiffusion3Pipeline's max_sequence_length default
ATTN = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TARGETS = {
    "attn": ATTN,
    "attn_mlp": ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"],
    "all": ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                   "norm1_context.linear", "norm_out.linear", "proj_out", "context_embedder"],
}
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
# cache keys of each encoder's outputs
CLIP_KEYS = {"text_encoder": ("clip_l", "clip_l_pooled"), "text_encoder_2": ("clip_g", "clip_g_pooled")}


class SD3Conditioning:
    """The transformer's ``prompt_embeds`` [B, 77 + T5 tokens, D] and ``pooled_prompt_embeds`` [B, P]."""

    def __init__(self, prompt_embeds, pooled_prompt_embeds):
        self.prompt_embeds, self.pooled_prompt_embeds = prompt_embeds, pooled_prompt_embeds

    def to(self, *args: Any, **kwargs: Any) -> "SD3Conditioning":
        return SD3Conditioning(self.prompt_embeds.to(*args, **kwargs), self.pooled_prompt_embeds.to(*args, **kwargs))


class SD3(Family):
    name = "sd3"
    prediction_type = "flow"
    # the blocks' AdaLN modulation Linears (norm1.linear, norm1_context.linear: ~2.7B of SD 3.5 large's 8.1B) are stored
    # in fp8/NF4 with the rest, as sd-scripts' fp8_base does; the final norm_out's and the embedders stay
    fp8_skip = ("norm_out", "pos_embed", "time_text_embed", "context_embedder", "proj_out")
    swap_blocks = ("transformer_blocks",)

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        variant = found or (chosen if chosen in OFFICIAL else "sd3.5-large")
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder",
                                      text_encoder_2="text_encoder_2", text_encoder_3="text_encoder_3")
        # T5 switched off is not loaded (9 GB in bf16 for 3.5 large): the pipeline then feeds zeros in its place
        no_t5 = {"text_encoder_3": None, "tokenizer_3": None} if "text_encoder_3" in (getattr(mcfg, "disabled", ())
                                                                                          or ()) else {}
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, variant, dtypes, no_t5)
        else:
            pipe = sources.load_pipeline(StableDiffusion3Pipeline, self.source, mcfg, workspace, family=variant,
                                         dtype=dtypes, **no_t5)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.text_encoder_2, self.tokenizer_2 = pipe.text_encoder_2, pipe.tokenizer_2
        self.text_encoder_3, self.tokenizer_3 = pipe.text_encoder_3, pipe.tokenizer_3
        c = self.transformer.config
        self.family = "sd3.5-medium" if c.dual_attention_layers else "sd3.5-large" if c.qk_norm else "sd3-medium"
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        # loss.timestep_distribution auto: logit-normal σ, the default of diffusers' SD3 trainer (--weighting_scheme)
        # and kohya's sd3_train (--weighting_scheme logit_normal)
        self.objective = FlowMatchingObjective(shift=float(self._sched_config.get("shift", 3.0)),
                                               default_distribution="logit_normal")
        self.disabled = frozenset(getattr(mcfg, "disabled", ()) or ())  # text encoders switched off
        limit = int(self.tokenizer_3.model_max_length) if self.tokenizer_3 is not None else T5_MAX
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or T5_MAX), limit)
        self.device = torch.device(device)
        self._place_frozen(dtypes, tuple(n for n in ("transformer", "text_encoder", "text_encoder_2",
                                                        "text_encoder_3", "vae") if getattr(self, n) is not None))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: SD3 runs on PyTorch SDPA. Use sdpa.", key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    # --- loading ----------------------------------------------------------------------------
    def _from_single_file(self, mcfg: Any, variant: str, dtypes: Dict[str, Any], no_t5: Dict[str, Any]):
        """Stability's transformer file, with VAE and text encoders from ``model.config_path``."""

        rest = getattr(mcfg, "config_path", "") or OFFICIAL[variant]
        try:
            state = load_file(self.source.location)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}' could not be read as a .safetensors file: {exc}",
                                 key="model.path", value=self.source.display) from None
        state = {k.split("model.diffusion_model.", 1)[1]: v for k, v in state.items()
                 if k.startswith("model.diffusion_model.")} or state
        scales = fp8_layer_scales(state, original_to_diffusers)  # an fp8 release: which layers, with which scales
        state = dequantise_fp8(state, dtypes["transformer"], self.source.display)  # floats to build the model from
        local = Path(rest) / "transformer" / "config.json"
        base = json.loads(local.read_text()) if local.is_file() else dict(
            {"sd3.5-large": CONFIG_35_LARGE, "sd3.5-medium": CONFIG_35_MEDIUM, "sd3-medium": CONFIG_3_MEDIUM}[variant])
        try:
            transformer = SD3Transformer2DModel.from_config(
                config_from_original({k: tuple(v.shape) for k, v in state.items()}, base))
            transformer.load_state_dict(original_to_diffusers(state), strict=True)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a complete SD3 transformer in Stability's "
                                 f"layout ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                                 key="model.path", value=self.source.display) from None
        transformer.to(dtypes["transformer"])
        if scales:  # kept in fp8 with these scales once the adapters exist (memory/precision.py apply_storage)
            transformer.fp8_file_scales = scales
        kw: Dict[str, Any] = {"dtype": {k: v for k, v in dtypes.items() if k != "transformer"}}
        if not Path(rest).is_dir():
            kw.update(cache_dir=getattr(mcfg, "cache_dir", "") or None, revision=getattr(mcfg, "revision", "") or None)
        try:
            return StableDiffusion3Pipeline.from_pretrained(
                rest, transformer=transformer, local_files_only=Path(rest).is_dir() or hub_offline(mcfg), **no_t5, **kw)
        except Exception as exc:
            raise ModelLoadError(
                f"model.path '{self.source.display}' is the SD3 transformer alone; its VAE and text encoders come from "
                f"model.config_path ('{rest}'), which could not be loaded ({type(exc).__name__}). Set model.config_path "
                f"to a diffusers SD3 folder, or accept the licence of {OFFICIAL[variant]} on the hub and log in once "
                "with network access.", key="model.config_path", value=rest) from None

    # --- text -------------------------------------------------------------------------------
    def _clip(self, slot: str, captions: List[str], grads: frozenset):
        tokenizer = self.tokenizer if slot == "text_encoder" else self.tokenizer_2
        encoder = getattr(self, slot)
        ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids
        with torch.set_grad_enabled(torch.is_grad_enabled() and slot in grads):
            out = encoder(ids.to(self.device), output_hidden_states=True)
        return out.hidden_states[-2], out[0]  # penultimate layer, projected pooled output

    def _t5(self, captions: List[str], grads: frozenset):
        ids = self.tokenizer_3(captions, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="pt").input_ids
        with torch.set_grad_enabled(torch.is_grad_enabled() and "text_encoder_3" in grads):
            return self.text_encoder_3(ids.to(self.device))[0]

    def _encode(self, captions: List[str], grads: frozenset = frozenset()) -> Dict[str, Any]:
        """Each encoder's outputs apart (those switched off or absent are left out)."""
        out: Dict[str, Any] = {}
        for slot, (hidden, pooled) in CLIP_KEYS.items():
            if slot not in self.disabled and getattr(self, slot) is not None:
                out[hidden], out[pooled] = self._clip(slot, captions, grads)
        if "text_encoder_3" not in self.disabled and self.text_encoder_3 is not None:
            out["t5"] = self._t5(captions, grads)
        return out

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        with torch.no_grad():
            return {k: v.float().cpu() for k, v in self._encode(list(captions)).items()}

    def _assemble(self, enc: Dict[str, Any], batch: int):
        """``StableDiffusion3Pipeline.encode_prompt``'s layout; an encoder that is off gives zeros of its shape."""
        ref = next(iter(enc.values()))
        device, dtype = ref.device, ref.dtype
        clip_width = {"clip_l": self.text_encoder.config.hidden_size, "clip_g": self.text_encoder_2.config.hidden_size}
        pooled_width = {"clip_l_pooled": self.text_encoder.config.projection_dim,
                        "clip_g_pooled": self.text_encoder_2.config.projection_dim}
        tokens = self.tokenizer.model_max_length
        hidden = [enc.get(k, torch.zeros(batch, tokens, w, device=device, dtype=dtype)) for k, w in clip_width.items()]
        pooled = [enc.get(k, torch.zeros(batch, w, device=device, dtype=dtype)) for k, w in pooled_width.items()]
        width = int(self.transformer.config.joint_attention_dim)
        t5 = enc.get("t5", torch.zeros(batch, self.max_sequence_length, width, device=device, dtype=dtype))
        clip = torch.cat(hidden, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return SD3Conditioning(torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1))

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None,
                        drop_te3=None):
        keys = [k for k in ("clip_l", "clip_l_pooled", "clip_g", "clip_g_pooled", "t5") if batch.get(k) is not None]
        if keys:
            enc = {k: batch[k].to(self.device) for k in keys}
        else:
            enc = self._encode(list(expand(batch["captions"])),
                               frozenset(train_text) & {"text_encoder", "text_encoder_2", "text_encoder_3"})
        drops = {("clip_l", "clip_l_pooled"): drop_te1, ("clip_g", "clip_g_pooled"): drop_te2, ("t5",): drop_te3}
        for names, flags in drops.items():
            if flags is None or not any(flags):
                continue
            if self._empty is None:
                self._empty = self.encode_captions([""])
            for k in names:
                if k in enc:
                    f = flags_on(flags, enc[k].device)
                    empty = kept_on(self, k, self._empty[k], enc[k])
                    enc[k] = torch.where(f.view(-1, *([1] * (enc[k].ndim - 1))), empty, enc[k])
        return self._assemble(enc, len(batch["captions"]))

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        dtype = model_input.dtype
        # the timestep in fp32, as StableDiffusion3Pipeline and diffusers' SD3 trainer pass it (the transformer embeds
        # it in fp32: a bf16 t would be 936 for 937.96)
        timestep = timesteps.to(model_input.device, torch.float32) * 1000
        return self.transformer(hidden_states=model_input, timestep=timestep,
                                encoder_hidden_states=conditioning.prompt_embeds.to(model_input.device, dtype),
                                pooled_projections=conditioning.pooled_prompt_embeds.to(model_input.device, dtype),
                                return_dict=False)[0]

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """StableDiffusion3Pipeline over the live modules with the model's own flow-matching Euler sampler; a text
        encoder that is off is left out (the pipeline then feeds zeros in its place, as training did)."""
        off = self.disabled
        pipe = StableDiffusion3Pipeline(
            scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae, transformer=self.transformer,
            text_encoder=self.text_encoder, tokenizer=self.tokenizer, text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2, tokenizer_3=None if "text_encoder_3" in off else self.tokenizer_3,
            text_encoder_3=None if "text_encoder_3" in off else self.text_encoder_3)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        dtypes = ":".join(part_dtype(mcfg, s) for s in ("text_encoder", "text_encoder_2", "text_encoder_3"))
        return f"{mcfg.path}:{dtypes}:{self.max_sequence_length}:{','.join(sorted(self.disabled))}"

    # --- export -----------------------------------------------------------------------------
    def lora_targets(self, slot: str, preset: str):
        if slot == "unet":
            return target_regex(TARGETS[preset])
        return list(CLIP_TARGETS)

    def lora_namer(self):
        """LyCORIS (LoHa/LoKr) names: ``lycoris_<diffusers module path>``; kohya names for the CLIPs."""
        return {"unet": ("lycoris", lambda p: p), "text_encoder": ("lora_te1", clip_text_model),
                "text_encoder_2": ("lora_te2", clip_text_model)}

    def peft_file_names(self):
        return {"unet": ("transformer", lambda p: p), "text_encoder": ("text_encoder", clip_text_model),
                "text_encoder_2": ("text_encoder_2", clip_text_model)}

    _FILE_PREFIXES = {"unet": "transformer", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2"}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        out = peft_layout_state_dict(modules, self._FILE_PREFIXES, adapter_name,
                                     {"text_encoder": clip_text_model, "text_encoder_2": clip_text_model})
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        used = load_peft_layout(state, modules, self._FILE_PREFIXES, adapter_name,
                                {"text_encoder": clip_text_model, "text_encoder_2": clip_text_model})
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        meta = modelspec_common(title=title, resolution=resolution)
        arch = {"sd3.5-large": "stable-diffusion-v3.5-large", "sd3.5-medium": "stable-diffusion-v3.5-medium",
                "sd3-medium": "stable-diffusion-v3-medium"}[self.family]
        meta.update({"modelspec.architecture": f"{arch}/lora", "modelspec.prediction_type": "flow",
                     "modelspec.implementation": "https://github.com/Stability-AI/sd3.5",
                     "ss_base_model_version": self.family.replace(".", "").replace("-", "_")})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as Stability's single file (``model.diffusion_model.``-prefixed MMDiT)."""
        state = diffusers_to_original({k: v.detach().cpu() for k, v in self.transformer.state_dict().items()})
        state = {ORIGINAL_PREFIX + k: v.contiguous() for k, v in state.items()}
        write_checkpoint(Path(path), cast_state_dict(state, dtype), metadata or {})
