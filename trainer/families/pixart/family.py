"""PixArt-α / PixArt-Σ on diffusers' ``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` classes.

What differs from the SD lineage, and where it lives here:

- Text: one T5 encoder with its attention mask (padding never attends), at the pipelines' caption length
  (α 120 tokens, Σ 300); caption dropout gives the empty caption's encoding (what the pipelines use
  as the unconditional input).
- Learned variance: the transformer outputs 2× the latent channels (ε ‖ variance); ``predict`` returns the ε
  half (OneTrainer's BasePixArtAlphaSetup.predict chunks the same way) and the ε loss is on it; the variance
  half trains with the variational bound of Improved DDPM (``variance_loss``, weight ``loss.vb_strength``,
  default 1 like OneTrainer's ``vb_loss_strength``), as PixArt itself was trained. diffusers' PixArt pipelines
  and ComfyUI (pixartms.py returns ``out[:, :in_channels]``) discard that half at sampling.
- Micro-conditions: α 1024 models (``use_additional_conditions``) are told each batch's pixel size and
  aspect ratio, as the α pipeline does; Σ has none.
- DDPM ε objective from the model's own β schedule (``DDPMObjective``), so min-SNR, debiased, Huber-SNR
  and zero terminal SNR work as for SD.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>.lora_A/lora_B``; α/r baked in), the
  "default format" ComfyUI maps for PixArt (comfy/lora.py model_lora_keys_unet, PixArt branch:
  ``transformer.{diffusers key}``); diffusers has no PixArt ``load_lora_weights``, so it loads through peft
  on the transformer (:func:`load_lora_into_pipeline`). A T5 LoRA goes in the same file as kohya
  ``lora_te1_<module>`` keys (ComfyUI's T5 key map when no CLIP is present). Fine-tunes: the transformer
  as the original single file (keys.py); single files in (``.pth``/``.safetensors``, original or diffusers
  layout) with the config corrected by the weights (a 512 px α file has no micro-conditions).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import diffusers
import torch
from diffusers import DDPMScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline, PixArtTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.fp8_weights import dequantise_fp8, fp8_layer_scales
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.samplers import SAMPLERS
from trainer.families.common.transformer_kit import cut_to_longest, longest_caption, rows_replaced
from trainer.families.pixart.keys import (
    SKIPPED,
    config_from_state,
    diffusers_to_original,
    is_diffusers_layout,
    original_to_diffusers,
    read_state,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.kohya import kohya_lora_state_dict, load_lora_kohya_into_peft
from trainer.formats.metadata import modelspec_common
from trainer.loss import variational_bound
from trainer.objectives import DDPMObjective

CONFIGS = Path(__file__).parent / "configs"
OFFICIAL = {"pixart-alpha": "PixArt-alpha/PixArt-XL-2-1024-MS",
            "pixart-sigma": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"}
CAPTION_TOKENS = {"pixart-alpha": 120, "pixart-sigma": 300}
ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + ["ff.net.0.proj", "ff.net.2"],
           "all": ATTN + ["ff.net.0.proj", "ff.net.2", "caption_projection.linear_1", "caption_projection.linear_2",
                          "adaln_single.linear"]}
T5_TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]


class PixArtConditioning:
    """T5 ``prompt_embeds`` [B, L, D] and its ``prompt_attention_mask`` [B, L]; ``.to()`` like a tensor
    (the mask keeps its integer dtype). ``lengths``: each row's real tokens, on the host, for cached captions."""

    def __init__(self, prompt_embeds, prompt_attention_mask, lengths: Optional[List[int]] = None):
        self.prompt_embeds, self.prompt_attention_mask, self.lengths = prompt_embeds, prompt_attention_mask, lengths

    @property
    def prompt_mask(self):  # the name transformer_kit.longest_caption reads
        return self.prompt_attention_mask

    def to(self, *args: Any, **kwargs: Any) -> "PixArtConditioning":
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        mask = self.prompt_attention_mask if device is None else self.prompt_attention_mask.to(device)
        return PixArtConditioning(self.prompt_embeds.to(*args, **kwargs), mask, self.lengths)


class PixArt(Family):
    name = "pixart"
    _original_extras: Dict[str, Any] = {}  # non-diffusers tensors of an original single file (keys.SKIPPED)
    fp8_skip = ("norm", "pos_embed", "adaln_single", "caption_projection", "proj_out")
    swap_blocks = ("transformer_blocks",)

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        variant = found or (chosen if chosen in OFFICIAL else "pixart-sigma")
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        pipe_cls = PixArtAlphaPipeline if variant == "pixart-alpha" else PixArtSigmaPipeline
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, variant, pipe_cls, dtypes)
        else:
            pipe = sources.load_pipeline(pipe_cls, self.source, mcfg, workspace, family=variant, dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.family, self._pipe_cls = variant, pipe_cls
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        pred = getattr(mcfg, "prediction_type", "auto")
        self.prediction_type = self._sched_config.get("prediction_type", "epsilon") if pred == "auto" else pred
        train_config = {k: v for k, v in self._sched_config.items() if not k.startswith("_")}
        self.noise_scheduler = DDPMScheduler.from_config(dict(train_config, prediction_type=self.prediction_type))
        self.objective = DDPMObjective(self.noise_scheduler, self.prediction_type)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or CAPTION_TOKENS[variant]),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            try:
                self.transformer.enable_xformers_memory_efficient_attention()
            except Exception as exc:
                raise ModelLoadError(f"model.attention = xformers, but xformers is not usable here ({exc}). Use sdpa.",
                                     key="model.attention") from None
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    def _from_single_file(self, mcfg: Any, variant: str, pipe_cls: Any, dtypes: Dict[str, Any]):
        """The transformer alone, in the original layout (``.pth`` or ``.safetensors``; or a diffusers
        ``transformer/diffusion_pytorch_model.safetensors``); its config and the VAE/T5 from
        ``model.config_path`` (a diffusers PixArt folder or hub id; default the official repo of the variant).
        What the weights show (depth, α micro-conditions, training size) overrides that config: a 512 px α
        file has no size embedders although the default α config is the 1024 one."""

        rest = getattr(mcfg, "config_path", "") or OFFICIAL[variant]
        local = Path(rest).is_dir()
        cfg_file = Path(rest) / "transformer" / "config.json" if local else None
        config = json.loads((cfg_file if cfg_file is not None and cfg_file.is_file() else
                             CONFIGS / variant / "transformer" / "config.json").read_text())
        try:
            state = {k.split("diffusion_model.", 1)[-1]: v for k, v in read_state(self.source.location).items()}
            # an fp8 release: which layers, with which scales; then floats to build the model from
            scales = fp8_layer_scales(state, lambda m: m if is_diffusers_layout(m) else original_to_diffusers(
                {k: v for k, v in m.items() if k not in SKIPPED}))
            state = dequantise_fp8(state, dtypes["transformer"], self.source.display)
            # kept to write back on save: the learned null caption (its length tells α from Σ) and the
            # fixed position table (its size tells the training resolution), neither a diffusers weight
            if is_diffusers_layout(state):  # older diffusers conversions kept the null caption here
                null = state.pop("caption_projection.y_embedding", None)
                state.pop("pos_embed.pos_embed", None)
                self._original_extras = {} if null is None else {"y_embedder.y_embedding": null}
                weights = state
            else:
                self._original_extras = {k: state[k] for k in SKIPPED if k in state}
                weights = original_to_diffusers({k: v for k, v in state.items() if k not in SKIPPED})
            config = config_from_state(state, config)
            transformer = PixArtTransformer2DModel.from_config(config)
            transformer.load_state_dict(weights, strict=True)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a PixArt transformer of the size its "
                                 f"config describes ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). Set "
                                 "model.config_path to a diffusers PixArt folder whose transformer/config.json fits.",
                                 key="model.path", value=self.source.display) from None
        transformer.to(dtypes["transformer"])
        if scales:  # kept in fp8 with these scales once the adapters exist (memory/precision.py apply_storage)
            transformer.fp8_file_scales = scales
        try:
            return pipe_cls.from_pretrained(rest, transformer=transformer, local_files_only=local or bool(
                getattr(mcfg, "hub_offline", False)), dtype={k: v for k, v in dtypes.items() if k != "transformer"})
        except Exception as exc:
            raise ModelLoadError(
                f"model.path '{self.source.display}' is the PixArt transformer alone; its VAE and T5 come from "
                f"model.config_path ('{rest}'), which could not be loaded ({type(exc).__name__}). Set "
                f"model.config_path to a diffusers PixArt folder (or the hub id {OFFICIAL[variant]}).",
                key="model.config_path", value=rest) from None

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions, grads: bool = False):
        # as the pipelines' _text_preprocessing (clean_caption=False) and the original PixArt T5 feature
        # extraction (which lower-cases while cleaning): T5's vocabulary is case-sensitive, so "Sks" trained
        # un-lowered would be another token than the "sks" the sampling pipeline feeds it
        captions = [str(c).lower().strip() for c in captions]
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            embeds = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        return embeds, mask

    def encode_captions(self, captions) -> Dict[str, Any]:
        with torch.no_grad():  # only as long as the longest caption: the step cuts the rest off anyway
            embeds, mask = cut_to_longest(*self._encode(captions))
        return {"prompt_embeds": embeds.float().cpu(), "prompt_attention_mask": mask.float().cpu()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        lengths = None
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
            mask = batch["prompt_attention_mask"].to(self.device).long()
            lengths = batch.get("prompt_lengths")  # counted on the host by the data pipeline
        else:
            embeds, mask = self._encode(expand(batch["captions"]), grads=bool({"text_encoder", "embedding"}
                                                                               & set(train_text)))
        if drop_te1 is not None and any(drop_te1):
            if self._empty is None:
                self._empty = self.encode_captions([""])
            embeds, mask = rows_replaced(drop_te1, embeds, mask, self._empty["prompt_embeds"],
                                         self._empty["prompt_attention_mask"], owner=self)
            n = int(self._empty["prompt_attention_mask"].sum())  # a host tensor
            lengths = None if lengths is None else [n if dropped else k for k, dropped in zip(lengths, drop_te1)]
        return PixArtConditioning(embeds, mask, lengths)

    # --- the denoiser -------------------------------------------------------------------------
    _variance = None  # the variance half of the last predict (learned σ)

    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        added = {"resolution": None, "aspect_ratio": None}
        if self.transformer.config.get("use_additional_conditions"):
            height, width = h * self.vae_scale_factor, w * self.vae_scale_factor
            added = {"resolution": torch.tensor([[height, width]], dtype=model_input.dtype,
                                                device=model_input.device).repeat(b, 1),
                     "aspect_ratio": torch.tensor([[height / width]], dtype=model_input.dtype,
                                                  device=model_input.device).repeat(b, 1)}
        # the batch's longest caption (the pipeline pads T5 to 120/300 tokens, which the cross-attention's mask hides)
        embeds, mask = longest_caption(conditioning, model_input.device, model_input.dtype)
        out = self.transformer(model_input, encoder_hidden_states=embeds,
                               encoder_attention_mask=None if mask is None else mask.long(),
                               timestep=timesteps, added_cond_kwargs=added, return_dict=False)[0]
        self._variance = None
        if out.shape[1] == 2 * c:  # learned σ: ε ‖ variance; the ε loss is on the first half, the variance's
            out, self._variance = out.chunk(2, dim=1)  # own loss (variance_loss) on the second
        return out

    def variance_loss(self, latents, noisy, timesteps, eps_pred):
        """The variational-bound loss of the variance half of the last :meth:`predict` (per image, in bits):
        PixArt predicts its variance, and was trained with this term (Improved DDPM); None when the
        transformer has no learned variance. ``eps_pred`` is detached inside: the mean learns from the ε loss."""
        if self._variance is None or self.prediction_type != "epsilon":
            return None
        vb = variational_bound(self.noise_scheduler.alphas_cumprod, latents, noisy, timesteps, eps_pred,
                               self._variance)
        return vb.mean(dim=list(range(1, vb.dim())))

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """The variant's pipeline over the live modules; ``sampler`` (a ``sampling.scheduler``) or the
        model's own DPM-Solver."""

        cls = getattr(diffusers, SAMPLERS[sampler]) if sampler else self._sched_class
        pipe = self._pipe_cls(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae,
                              transformer=self.transformer, scheduler=cls.from_config(self._sched_config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        # the sample size the user asked for, not the pipelines' aspect-ratio bins
        # clean_caption=False: the pipelines' default (True) cleans prompts only where bs4 and ftfy happen to be
        # installed; training sees the lower-cased caption (_encode), which is what clean_caption=False feeds
        return {"max_sequence_length": self.max_sequence_length, "use_resolution_binning": False,
                "clean_caption": False}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:lower"

    # --- export -----------------------------------------------------------------------------
    def lora_targets(self, slot: str, preset: str):
        return list(TARGETS[preset]) if slot == "unet" else list(T5_TARGETS)

    def lora_namer(self):
        """kohya/LyCORIS names: ``lycoris_<diffusers module path>`` for the transformer, ``lora_te1_`` for T5."""
        return {"unet": ("lycoris", lambda p: p), "text_encoder": ("lora_te1", lambda p: p)}

    def peft_file_names(self):
        return {"unet": ("transformer", lambda p: p)}  # (a T5 LoRA is kohya-named: lora_te1_…)

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        out = peft_layout_state_dict({k: v for k, v in modules.items() if k == "unet"}, {"unet": "transformer"},
                                     adapter_name)
        if "text_encoder" in modules:
            out.update(kohya_lora_state_dict(modules={"text_encoder": modules["text_encoder"]},
                                             namer=self.lora_namer(), adapter_name=adapter_name))
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        used = load_peft_layout(state, {k: v for k, v in modules.items() if k == "unet"}, {"unet": "transformer"},
                                adapter_name)
        rest = {k: v for k, v in state.items() if k not in used}
        if "text_encoder" in modules:
            load_lora_kohya_into_peft(rest, modules={"text_encoder": modules["text_encoder"]},
                                      namer=self.lora_namer(), adapter_name=adapter_name)
        elif rest:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(sorted(rest)[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        meta = modelspec_common(title=title, resolution=resolution)
        meta.update({"modelspec.architecture": f"{self.family}/lora", "modelspec.prediction_type": "epsilon",
                     "modelspec.implementation": "https://github.com/PixArt-alpha/PixArt-sigma",
                     "ss_base_model_version": self.family.replace("-", "_")})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer in the original PixArt layout (VAE and T5 stay separate files)."""
        state = diffusers_to_original(self.transformer.state_dict())
        state.update(self._original_extras)  # y_embedding / pos_embed of the file it was loaded from
        state = cast_state_dict({k: v.detach().cpu().contiguous() for k, v in state.items()}, dtype)
        write_checkpoint(Path(path), state, metadata or {})


def load_lora_into_pipeline(pipe: Any, path: Any, adapter_name: str = "default") -> None:
    """Load an Atelier PixArt LoRA file into a diffusers PixArt pipeline through peft (diffusers has no
    PixArt ``load_lora_weights``): an adapter of the file's rank on the file's modules, then its weights."""
    state = {k[len("transformer."):]: v for k, v in load_file(str(path)).items() if k.startswith("transformer.")}
    if not state:
        raise ValueError(f"{path}: no transformer LoRA keys (transformer.<module>.lora_A/lora_B.weight)")
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    rank = int(next(v for k, v in state.items() if k.endswith("lora_A.weight")).shape[0])
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=modules), pipe.transformer, adapter_name)
    result = set_peft_model_state_dict(pipe.transformer, state, adapter_name)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: keys that fit no module: {result.unexpected_keys[:5]}")
