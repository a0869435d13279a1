"""Krea 2 (Krea-2-Raw, Krea-2-Turbo) on diffusers' ``Krea2Pipeline`` classes: a single-stream MMDiT over a fused stack
of Qwen3-VL hidden layers and the Qwen-Image VAE's latents.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_krea2.py`` and ``transformer_krea2.py``):

- Text: the pipeline's own ``get_text_hidden_states`` (the Qwen-Image chat template, the caption padded in the middle
  of the template and the assistant suffix after the padding, positions counting real tokens only, the hidden states
  of ``text_encoder_select_layers`` stacked, the system prefix dropped) is called as is. The features
  [B, L, layers, D] are cached flattened to [B, L, layers·D] with their mask, the real tokens first (the padding in
  the middle moved to the end: text has no positions in the transformer, and padding takes no part in its attention)
  and cut to the longest; a step hands the transformer the batch's longest caption, unflattened.
  Caption dropout gives the empty caption's, which is the negative prompt the pipeline samples with.
- Latents: the Qwen-Image VAE (one-frame video), normalised per channel with ``latents_mean``/``latents_std`` as the
  pipeline inverts them; packed 2×2 into tokens with the pipeline's ``prepare_position_ids`` (text at the origin).
- Flow matching: the transformer takes σ (1 is noise) and predicts the velocity ε − x, the loop's own objective.
  Raw: σ as diffusers' trainers draw it for a resolution-shifted scheduler (the pipeline's μ of the image size with
  ``loss.resolution_shift``). Turbo: the fixed μ = 1.15 its pipeline samples with at every size, i.e. a fixed shift
  e^1.15.
- Samples: ``Krea2Pipeline`` with ``is_distilled`` for Turbo; ``cfg_scale`` is the pipeline's ``guidance_scale``
  (cond + g·(cond − uncond); 0 = no guidance, as Turbo samples).
- Files: LoRA in the original layout (``diffusion_model.<original module>.lora_A/lora_B.weight``, α/r baked into
  ``lora_B``) that ComfyUI and ``Krea2Pipeline.load_lora_weights`` read; fine-tunes as the original single file
  (keys.py). Single files in: the transformer, with VAE, Qwen3-VL and tokenizer from ``model.config_path`` (a diffusers
  Krea 2 folder or hub id; default krea/Krea-2-Raw, whose other parts Turbo shares).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    ChannelNormalisedLatents,
    MaskedTextConditioning,
    PeftLayoutLora,
    cut_to_longest,
    longest_caption,
    pipeline_with_transformer_file,
    real_tokens_first,
    save_transformer_file,
)
from trainer.families.krea2.keys import (
    config_from_original,
    diffusers_to_original,
    original_module,
    original_to_diffusers,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import FlowMatchingObjective, flow_objective_for

OFFICIAL = "krea/Krea-2-Raw"  # diffusers' single-file default repo for Krea 2
MAX_TOKENS = 512  # Krea2Pipeline's max_sequence_length
TURBO_MU = 1.15  # Krea2Pipeline's fixed time shift for the distilled checkpoint
PATCH = 2
# what Krea2Pipeline.get_text_hidden_states reads of its pipeline besides the tokenizer, text encoder and taps
TEMPLATE = ("prompt_template_encode_prefix", "prompt_template_encode_suffix", "prompt_template_encode_start_idx",
            "prompt_template_encode_num_suffix_tokens")
PREFIX = "diffusion_model"
_BLOCK = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate"]
_FF = ["ff.gate", "ff.up", "ff.down"]
ATTN = [f"transformer_blocks.*.{m}" for m in _BLOCK]
MLP = [f"transformer_blocks.*.{m}" for m in _FF]
# "all" adds the text fusion's blocks (what ai-toolkit's whole-transformer LoRA also adapts)
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP, "all": ATTN + MLP + [f"text_fusion.*.*.{m}" for m in _BLOCK + _FF]}


def pack(latents):
    """[B, C, H, W] -> [B, H/2·W/2, C·4], as ``Krea2Pipeline._pack_latents``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens, h: int, w: int):
    """The inverse of :func:`pack` (``Krea2Pipeline._unpack_latents`` without the frame axis)."""
    b, _, ch = tokens.shape
    c = ch // (PATCH * PATCH)
    x = tokens.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class Krea2(ChannelNormalisedLatents, MaskedTextConditioning, PeftLayoutLora, Family):
    name = "krea2"
    family = "krea2"
    prediction_type = "flow"
    fp8_skip = ("norm", "img_in", "time_embed", "time_mod_proj", "txt_in", "text_fusion", "final_layer")
    swap_blocks = ("transformer_blocks",)
    targets = TARGETS
    modelspec = ("krea-2", "https://github.com/krea-ai/krea-2", "krea2")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        self.family = found or (chosen if chosen in self.info.variants else "krea2")
        if chosen == "krea2-turbo" and self.source.kind == "single_file":
            self.family = chosen  # Raw and Turbo files hold the same tensors: only model.family tells
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=Krea2Pipeline,
                                                  transformer_cls=Krea2Transformer2DModel,
                                                  config=config_from_original, to_diffusers=original_to_diffusers,
                                                  official=OFFICIAL, layout="the original layout")
        else:
            pipe = sources.load_pipeline(Krea2Pipeline, self.source, mcfg, workspace, family=self.family,
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.select_layers = tuple(pipe.text_encoder_select_layers)
        self._template = {k: getattr(pipe, k) for k in TEMPLATE}
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.turbo = self.family == "krea2-turbo"
        self.objective = (FlowMatchingObjective(shift=math.exp(TURBO_MU)) if self.turbo
                          else flow_objective_for(self._sched_config, patch=PATCH))
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Krea 2 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """One-frame video through the VAE: the posterior's mean and std [B, C, h, w] on the CPU in fp32."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype).unsqueeze(2)).latent_dist
        return {"mean": dist.mean.squeeze(2).float().cpu(), "std": dist.std.squeeze(2).float().cpu()}

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """``Krea2Pipeline.get_text_hidden_states``: features flattened to [B, L, layers·D], mask [B, L] (bool)."""
        # the pipeline's function on what it reads of the pipeline (a whole pipeline would build a scheduler, which
        # the VRAM estimate's fake tensors cannot)
        view = SimpleNamespace(tokenizer=self.tokenizer, text_encoder=self.text_encoder,
                               text_encoder_select_layers=self.select_layers, **self._template)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden, mask = Krea2Pipeline.get_text_hidden_states(view, list(captions), self.max_sequence_length,
                                                                self.device)
        # the template pads in its middle; the transformer gives text no positions (its text rows of position_ids
        # are zero) and leaves padded tokens out of every attention, so the real tokens can come first
        return real_tokens_first(hidden.flatten(2), mask)

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """As :class:`MaskedTextConditioning`, but the features kept in the text encoder's dtype and only as long as
        the longest caption encoded with them: 12 tapped layers of 2560 are 61 kB a token in bf16, 32 MB for the
        pipeline's 520."""
        with torch.no_grad():
            embeds, mask = cut_to_longest(*self._encode(list(captions)))
        return {"prompt_embeds": embeds.cpu(), "prompt_mask": mask.float().cpu()}

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        b, c, h, w = model_input.shape
        if h % PATCH or w % PATCH:
            raise ValueError(f"Krea 2 packs 2×2 latent patches: latents of {h}×{w} must be even (image sizes a "
                             "multiple of 16)")
        dtype, device = model_input.dtype, model_input.device
        embeds, mask = longest_caption(conditioning, device, dtype)  # the batch's longest; no mask when full
        embeds = embeds.unflatten(-1, (len(self.select_layers), -1))
        positions = Krea2Pipeline.prepare_position_ids(embeds.shape[1], h // PATCH, w // PATCH, device)
        # σ in fp32 (the pipeline passes t/1000 in the latents' dtype; the time embedding is computed from it)
        out = self.transformer(hidden_states=pack(model_input), encoder_hidden_states=embeds,
                               timestep=timesteps.to(device, torch.float32), position_ids=positions,
                               encoder_attention_mask=None if mask is None else mask.bool(), return_dict=False)[0]
        return unpack(out, h, w)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = Krea2Pipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                             text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer,
                             text_encoder_select_layers=self.select_layers, is_distilled=self.turbo)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        layers = ",".join(map(str, self.select_layers))
        return (f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:krea2-template:{layers}"
                ":real-first")

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file: ``diffusion_model.<original>``."""
        return {"unet": (PREFIX, original_module)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA in the original layout (α/r baked into ``lora_B``; no ``.alpha``, which diffusers'
        Krea 2 converter refuses)."""
        out = peft_layout_state_dict(modules, {"unet": PREFIX}, adapter_name, renames={"unet": original_module})
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        """An original-layout file into fresh peft layers (a diffusers-layout file as :class:`PeftLayoutLora` reads
        it)."""
        if not any(k.startswith(PREFIX + ".") for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        used = load_peft_layout(state, {"unet": modules["unet"]}, {"unet": PREFIX}, adapter_name,
                                renames={"unet": original_module})
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py): what ComfyUI's diffusion-model loader and
        ``Krea2Transformer2DModel.from_single_file`` read, and model.path here."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
