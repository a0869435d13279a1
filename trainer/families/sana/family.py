"""Sana and Sana 1.5 on diffusers' ``SanaPipeline``: a linear-attention DiT over the 32-channel latents of DC-AE
(32× compression) with Gemma-2 text features.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_sana.py`` and ``sana_transformer.py``):

- Text: the pipeline lower-cases each prompt, puts its complex human instruction (a prompt-enhancing preamble,
  ``complex_human_instruction``'s default) before it, pads to the preamble's tokens + 300 − 2, takes Gemma-2's last
  hidden state and keeps the first token and the last 299 (``select_index``). Training encodes captions the same way,
  with the pipeline's own default preamble, so a caption trains on the features a prompt samples with. The
  unconditional pass (negative prompt "") is encoded without the preamble at 300 tokens: caption dropout gives exactly
  that.
- Objective: rectified flow, target ε − x (the transformer's ``flow_prediction``), σ shifted by the scheduler's
  ``flow_shift`` (3 for the released 512-2K models), the transformer's timestep σ·1000 (× ``timestep_scale``) in
  fp32.
- Latents: DC-AE's deterministic encoding × ``scaling_factor`` (the pipeline decodes ``latents / scaling_factor``; no
  shift), [B, 32, H/32, W/32].
- Files: LoRA in the diffusers/peft layout (``transformer.<module>.lora_A/lora_B``) that
  ``SanaPipeline.load_lora_weights`` reads (ComfyUI has no Sana model: see docs/families.md). Fine-tunes as the
  original single file (keys.py). Single files in: the transformer in the original layout (Sana 1.0 and 1.5) or
  diffusers', with Gemma, DC-AE and tokenizer from ``model.config_path`` (a diffusers Sana folder or hub id; default
  Sana 1.6B 1024 px).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import torch
from diffusers import SanaPipeline, SanaTransformer2DModel
from safetensors import safe_open

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.transformer_kit import (
    MaskedTextConditioning,
    PeftLayoutLora,
    longest_caption,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.sana.keys import EXTRAS, config_from_original, diffusers_to_original, original_to_diffusers
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import flow_objective_for

OFFICIAL = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
MAX_TOKENS = 300  # SanaPipeline's max_sequence_length
# the preamble SanaPipeline.__call__ puts before every prompt, read from its signature so training follows the pipeline
INSTRUCTION = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
ATTN = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]
# the Mix-FFN's 1×1 convolutions (its depthwise 3×3 has one filter per channel: no low rank to learn)
MLP = ["ff.conv_inverted", "ff.conv_point"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP,
           "all": ATTN + MLP + ["caption_projection.linear_1", "caption_projection.linear_2", "time_embed.linear"]}


def _to_diffusers(state: Dict[str, Any]) -> Dict[str, Any]:
    """A transformer file's tensors as diffusers' (a diffusers-layout file passes as it is)."""
    if any(k.startswith("transformer_blocks.") for k in state):
        return {k: v for k, v in state.items() if k not in EXTRAS}
    return original_to_diffusers(state)


def _config(state: Dict[str, Any], base: dict) -> Dict[str, Any]:
    """The transformer's config: from the weights (original layout), or the ``model.config_path`` folder's
    (a diffusers-layout file, whose sizes the loader checks strictly)."""
    if not any(k.startswith("transformer_blocks.") for k in state):
        return config_from_original(state, base)
    if not base:
        raise ValueError("a diffusers-layout transformer file takes its config from a local model.config_path folder")
    return dict(base)


class Sana(MaskedTextConditioning, PeftLayoutLora, Family):
    cache_cut = True  # the step cuts captions to their length: the cache keeps no more
    name = "sana"
    family = "sana"
    prediction_type = "flow"
    fp8_skip = ("norm", "patch_embed", "time_embed", "caption_projection", "proj_out")
    swap_blocks = ("transformer_blocks",)
    targets = TARGETS
    modelspec = ("sana", "https://github.com/NVlabs/Sana", "sana")
    _original_extras: Dict[str, Any] = {}

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=SanaPipeline,
                                                  transformer_cls=SanaTransformer2DModel, config=_config,
                                                  to_diffusers=_to_diffusers, official=OFFICIAL,
                                                  layout="the original (NVlabs) or diffusers layout")
            with safe_open(self.source.location, "pt") as f:  # the original file's non-diffusers tensors
                names = {k.split("model.diffusion_model.", 1)[-1]: k for k in f.keys()}
                self._original_extras = {k: f.get_tensor(names[k]) for k in EXTRAS if k in names}
        else:
            pipe = sources.load_pipeline(SanaPipeline, self.source, mcfg, workspace, family="sana", dtype=dtypes)
        if pipe.transformer.config.get("guidance_embeds"):
            raise ModelLoadError(f"model.path '{self.source.display}' is Sana-Sprint (a few-step distilled model with "
                                 "a guidance embedding), which Atelier does not train; Sana and Sana 1.5 are.",
                                 key="model.path", value=self.source.display)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.tokenizer.padding_side = "right"  # as SanaPipeline sets it
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        cfg = self._sched_config  # DPM-Solver names the shift flow_shift, a flow Euler scheduler shift
        shift = cfg["flow_shift"] if "flow_shift" in cfg else cfg.get("shift", 1.0)
        self.objective = flow_objective_for({"shift": shift})
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Sana's attention is linear (plain matmuls) and its "
                                 "cross-attention runs on PyTorch SDPA. Use sdpa.", key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """DC-AE's encoding (deterministic: a zero std, so drawing from the cache gives it back)."""
        with torch.no_grad():
            latent = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent.float().cpu()
        return {"mean": latent, "std": torch.zeros_like(latent)}

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False, instruction: bool = True):
        """As ``SanaPipeline.encode_prompt`` with ``clean_caption=False`` (``instruction``: the prompt's preamble and
        token selection; the negative prompt has neither): (features [B, L, D], mask of the real tokens [B, L])."""
        texts = [str(c).lower().strip() for c in captions]
        length = self.max_sequence_length
        if instruction:
            preamble = "\n".join(INSTRUCTION)
            texts = [preamble + t for t in texts]
            length = len(self.tokenizer.encode(preamble)) + self.max_sequence_length - 2
        tokens = self.tokenizer(texts, padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        if instruction:  # the first token and the caption's end (Sana's paper, section 3.1)
            keep = [0] + list(range(-self.max_sequence_length + 1, 0))
            hidden, mask = hidden[:, keep], mask[:, keep]
        return hidden, mask.bool()

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if drop_te1 is not None and any(drop_te1) and self._empty is None:
            # the unconditional features the pipeline samples with: "" without the preamble
            with torch.no_grad():
                embeds, mask = self._encode([""], instruction=False)
            self._empty = {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu()}
        return super().batch_condition(batch, expand, train_text, drop_te1, drop_te2)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        device, dtype = model_input.device, model_input.dtype
        # the timestep in fp32 on the 0-1000 clock the pipeline passes (× timestep_scale, 1 in the released models)
        t = timesteps.to(device, torch.float32) * 1000.0 * float(self.transformer.config.get("timestep_scale", 1.0))
        # the batch's longest caption (the pipeline pads to 300 tokens, which the cross-attention's mask leaves out)
        embeds, mask = longest_caption(conditioning, device, dtype)
        return self.transformer(model_input, encoder_hidden_states=embeds,
                                encoder_attention_mask=None if mask is None else mask.long(), timestep=t,
                                return_dict=False)[0]

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = SanaPipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                            text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        # the size the user asked for, not the pipeline's aspect-ratio bins; the lower-cased caption training saw
        return {"max_sequence_length": self.max_sequence_length, "use_resolution_binning": False,
                "clean_caption": False}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:gemma2-instruction-lower"

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py), with the null caption and position
        table of the file it was loaded from: what NVlabs' code and ``SanaTransformer2DModel.from_single_file``
        (Sana 1.0) read, and model.path here."""
        state = diffusers_to_original(self.transformer.state_dict())
        state.update(self._original_extras)
        save_transformer_file(path, state, dtype, metadata)
