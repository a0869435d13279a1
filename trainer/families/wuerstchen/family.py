"""Würstchen 2: the text-conditional prior (diffusers' ``WuerstchenPrior``) over EfficientNet embeddings.

Shared with Stable Cascade (trainer/families/common/cascade_kit.py): EfficientNet latents, the continuous cosine
objective, the two-stage sampler. Here:

- Latents: the prior denoises (effnet + 1) / 42, the inverse of ``WuerstchenPriorPipeline``'s output
  ``latents · latent_mean − latent_std`` (42, 1), as the diffusers Würstchen training example scales them.
- Text: CLIP-G's last hidden states with the padding mask (``WuerstchenPriorPipeline.encode_prompt``).
- Files: LoRA in the diffusers/peft layout (``prior.<module>.lora_A/lora_B``, ``text_encoder.<module>…``; α/r baked
  into lora_B) that ``WuerstchenPriorPipeline.load_lora_weights`` reads (ComfyUI has no Würstchen 2 model).
  Fine-tunes: the prior's state dict as one file (diffusers layout), or a diffusers prior pipeline folder with
  output.format = diffusers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from safetensors.torch import load_file

from trainer.errors import ModelLoadError
from trainer.families.common.cascade_keys import (
    CONFIG_WUERSTCHEN,
    original_to_diffusers,
    strip_prefix,
    wuerstchen_config_from_state,
)
from trainer.families.common.cascade_kit import CascadePrior, given_prior_config, wuerstchen_class
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.metadata import modelspec_common

ATTN = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
TARGETS = {
    "attn": ATTN + ["kv_mapper.1"],
    "attn_mlp": ATTN + ["kv_mapper.1", "channelwise.0", "channelwise.4"],
    "all": ATTN + ["kv_mapper.1", "channelwise.0", "channelwise.4", "mapper", "cond_mapper.0", "cond_mapper.2"],
}


class Wuerstchen(CascadePrior):
    name = "wuerstchen"
    family = "wuerstchen-2"
    prior_class = "WuerstchenPrior"
    decoder_class = "WuerstchenDiffNeXt"
    text_class = "CLIPTextModel"
    pipelines = {"combined": "WuerstchenCombinedPipeline"}
    official = {"prior": "warp-ai/wuerstchen-prior", "decoder": "warp-ai/wuerstchen"}
    effnet_hint = ("Download model_v2_stage_b.pt from https://huggingface.co/dome272/wuerstchen (its effnet_state_dict "
                   "is the encoder) and set model.effnet_path to it.")
    latent_scale = (42.0, 1.0)
    decoder_steps = 12
    original_timestep_stretch = 1.08  # the Würstchen v2 trainer's t·1.08 + 0.001 (OneTrainer keeps it)
    targets = TARGETS
    fp8_skip = ("norm", "projection", "cond_mapper", "out")

    def _prior_from_single_file(self, mcfg: Any):
        """The prior alone in one file: diffusers layout, or the original one (attention as in_proj/out_proj)."""

        try:
            state = strip_prefix(load_file(self.source.location))
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}' could not be read: {exc}", key="model.path",
                                 value=self.source.display) from None
        cfg_file = given_prior_config(mcfg)
        base = json.loads(cfg_file.read_text()) if cfg_file is not None else dict(CONFIG_WUERSTCHEN)
        try:
            prior = wuerstchen_class("WuerstchenPrior").from_config(wuerstchen_config_from_state(state, base))
            prior.load_state_dict(original_to_diffusers(state), strict=True)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a Würstchen 2 prior of the size its config "
                                 f"describes ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                                 key="model.path", value=self.source.display) from None
        return prior if prior.dtype == self._dtypes["prior"] else prior.to(self._dtypes["prior"])

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions, grads: bool = False) -> Dict[str, Any]:
        tokens = self.tokenizer([str(c) for c in captions], padding="max_length",
                                max_length=self.tokenizer.model_max_length, truncation=True, return_tensors="pt")
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            out = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=tokens.attention_mask.to(self.device))
        return {"prompt_embeds": out.last_hidden_state}

    # --- the denoiser -----------------------------------------------------------------------
    def _run_prior(self, x, r, cond):
        return self.prior(x, r=r, c=cond["prompt_embeds"].to(x.dtype))

    # --- export -----------------------------------------------------------------------------
    def lora_namer(self):
        """kohya names (used only for the text encoder inside the peft-layout file's writer/reader)."""
        return {"unet": ("lora_unet", lambda p: p), "text_encoder": ("lora_te", lambda p: p)}

    def peft_file_names(self):
        return {"unet": ("prior", lambda p: p), "text_encoder": ("text_encoder", lambda p: p)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        return peft_layout_state_dict(modules, {"unet": "prior", "text_encoder": "text_encoder"}, adapter_name)

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        used = load_peft_layout(state, modules, {"unet": "prior", "text_encoder": "text_encoder"}, adapter_name)
        rest = sorted(k for k in state if k not in used)
        if rest:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(rest[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        meta = modelspec_common(title=title, resolution=resolution)
        meta.update({"modelspec.architecture": "wuerstchen-v2-prior/lora", "modelspec.prediction_type": "epsilon",
                     "modelspec.implementation": "https://github.com/dome272/Wuerstchen",
                     "ss_base_model_version": "wuerstchen_2"})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned prior's weights in one file (diffusers layout; loads back as model.path)."""
        state = {k: v.detach().cpu().contiguous() for k, v in self.prior.state_dict().items()}
        write_checkpoint(Path(path), cast_state_dict(state, dtype), metadata or {})


def load_lora_into_pipeline(pipe: Any, path: Any, adapter_name: str = "default") -> None:
    """Load an Atelier Würstchen 2 LoRA with diffusers' own loader (``WuerstchenPriorPipeline.load_lora_weights``);
    ``pipe``: the family's sampler, a combined or a prior pipeline."""
    getattr(pipe, "prior_pipe", pipe).load_lora_weights(str(path), adapter_name=adapter_name)
