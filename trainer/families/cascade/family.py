"""Stable Cascade (Würstchen 3): the stage C prior (full 3.6B or lite 1B) on diffusers' ``StableCascadeUNet``.

What differs from the SD lineage is shared with Würstchen 2 (trainer/families/common/cascade_kit.py: EfficientNet
latents, the continuous cosine objective, the two-stage sampler). Here:

- Text: CLIP-G with projection; the prior takes its last hidden states and its pooled, projected output
  (``StableCascadePriorPipeline.encode_prompt``), and an image-embedding slot left at zeros for text-to-image.
- Files: LoRA with the names ComfyUI maps for Cascade (comfy/lora.py: ``lora_prior_unet_<module>`` over the
  stage C modules with in_proj split into to_q/to_k/to_v and ``out_proj``; ``lora_prior_te_<module>`` over the
  CLIP-G text model), as OneTrainer writes them; LoRA/DoRA/LoHa/LoKr through the kohya/LyCORIS writers.
  Fine-tunes as ComfyUI's stage C checkpoint (the prior in the original layout under ``model.diffusion_model.``,
  CLIP-G under ``text_encoder.clip_g.``; trainer/families/common/cascade_keys.py ``COMFY_CHECKPOINT``), which
  ComfyUI's checkpoint and UNET loaders read; diffusers users take output.format = diffusers (a prior pipeline
  folder). Single files in: Stability's stage C file alone (text encoder and tokenizer from ``model.config_path``,
  default the official prior repo) or ComfyUI's checkpoint with the text encoder inside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from diffusers import StableCascadeUNet
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file

from trainer.errors import ModelLoadError
from trainer.families.common.cascade_keys import (
    CONFIG_FULL,
    CONFIG_LITE,
    comfy_checkpoint,
    comfy_lora_name,
    config_from_state,
    diffusers_to_original,
    is_lite,
    original_to_diffusers,
    split_comfy_checkpoint,
)
from trainer.families.common.cascade_kit import CascadePrior, given_prior_config
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.metadata import modelspec_common

ATTN = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
TARGETS = {
    "attn": ATTN + ["kv_mapper.1"],
    "attn_mlp": ATTN + ["kv_mapper.1", "channelwise.0", "channelwise.4"],
    "all": ATTN + ["kv_mapper.1", "channelwise.0", "channelwise.4", "mapper", "mapper_sca", "mapper_crp",
                   "clip_txt_mapper", "clip_txt_pooled_mapper", "clip_img_mapper"],
}


class StableCascade(CascadePrior):
    name = "cascade"
    prior_class = "StableCascadeUNet"
    decoder_class = "StableCascadeUNet"
    text_class = "CLIPTextModelWithProjection"
    pipelines = {"combined": "StableCascadeCombinedPipeline"}
    official = {"prior": "stabilityai/stable-cascade-prior", "decoder": "stabilityai/stable-cascade"}
    effnet_hub = ("stabilityai/stable-cascade", "effnet_encoder.safetensors")
    effnet_hint = ("Download effnet_encoder.safetensors from https://huggingface.co/stabilityai/stable-cascade (files, "
                   "top level) and set model.effnet_path to it.")
    latent_scale = (1.0, 0.0)
    decoder_steps = 10
    targets = TARGETS
    fp8_skip = ("embedding", "clf", "clip_", "norm")
    _comfy_text: Optional[Dict[str, Any]] = None

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.decoder_subfolder = "decoder_lite" if getattr(mcfg, "cascade_variant", "full") == "lite" else "decoder"
        super().__init__(mcfg, workspace, device)
        if self._comfy_text:  # ComfyUI's checkpoint carries its own (maybe fine-tuned) text encoder
            result = self.text_encoder.load_state_dict(self._comfy_text, strict=False)
            if result.unexpected_keys or len(result.missing_keys) > 2:  # position ids may be absent
                raise ModelLoadError(f"model.path '{self.source.display}': its text_encoder.* weights do not fit the "
                                     f"CLIP-G of model.config_path (unexpected {result.unexpected_keys[:3]}, missing "
                                     f"{result.missing_keys[:3]}).", key="model.path", value=self.source.display)
        c = self.prior.config
        self.family = "stable-cascade-lite" if tuple(c.block_out_channels)[0] < 2048 else "stable-cascade"

    def _prior_patterns(self, mcfg: Any) -> List[str]:
        prior = "prior_lite" if getattr(mcfg, "cascade_variant", "full") == "lite" else "prior"
        return [f"{prior}/*", "text_encoder/*", "tokenizer/*", "model_index.json", "effnet_encoder.safetensors"]

    def _prior_dir(self, folder: Path, mcfg: Any) -> Optional[Path]:
        if getattr(mcfg, "cascade_variant", "full") == "lite":
            lite = folder / "prior_lite"
            if not (lite / "config.json").is_file():
                raise ModelLoadError(f"model.cascade_variant = lite, but '{self.source.display}' has no prior_lite/ "
                                     "folder. Set model.cascade_variant to full, or use a repo with the lite prior "
                                     "(stabilityai/stable-cascade-prior).", key="model.cascade_variant", value="lite")
            return lite
        return super()._prior_dir(folder, mcfg)

    def _prior_from_single_file(self, mcfg: Any):
        """stage_c(_lite).safetensors, original layout; or ComfyUI's checkpoint (prior + ``text_encoder.*``)."""

        try:
            prior_state, text_state = split_comfy_checkpoint(load_file(self.source.location))
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}' could not be read as a .safetensors file: {exc}",
                                 key="model.path", value=self.source.display) from None
        self._comfy_text = text_state or None
        cfg_file = given_prior_config(mcfg)
        base = (json.loads(cfg_file.read_text()) if cfg_file is not None else
                CONFIG_LITE if is_lite({k: tuple(v.shape) for k, v in prior_state.items()}) else CONFIG_FULL)
        try:
            prior = StableCascadeUNet.from_config(config_from_state(prior_state, dict(base)))
            prior.load_state_dict(original_to_diffusers(prior_state), strict=True)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a Stable Cascade stage C prior of the size "
                                 f"its config describes ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                                 key="model.path", value=self.source.display) from None
        return prior if prior.dtype == self._dtypes["prior"] else prior.to(self._dtypes["prior"])

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions, grads: bool = False) -> Dict[str, Any]:
        tokens = self.tokenizer([str(c) for c in captions], padding="max_length",
                                max_length=self.tokenizer.model_max_length, truncation=True, return_tensors="pt")
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            out = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=tokens.attention_mask.to(self.device),
                                    output_hidden_states=True)
        return {"prompt_embeds": out.hidden_states[-1], "prompt_embeds_pooled": out.text_embeds.unsqueeze(1)}

    # --- the denoiser -----------------------------------------------------------------------
    def _run_prior(self, x, r, cond):
        dtype = x.dtype
        clip_img = torch.zeros(x.shape[0], 1, self.prior.config.clip_image_in_channels, device=x.device, dtype=dtype)
        return self.prior(sample=x, timestep_ratio=r, clip_text_pooled=cond["prompt_embeds_pooled"].to(dtype),
                          clip_text=cond["prompt_embeds"].to(dtype), clip_img=clip_img, return_dict=False)[0]

    # --- export -----------------------------------------------------------------------------
    def lora_namer(self):
        """ComfyUI's Cascade names: ``lora_prior_unet_<stage C module>``, ``lora_prior_te_<CLIP-G module>``."""
        return {"unet": ("lora_prior_unet", comfy_lora_name), "text_encoder": ("lora_prior_te", lambda p: p)}

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        meta = modelspec_common(title=title, resolution=resolution)
        meta.update({"modelspec.architecture": "stable-cascade-v1-prior/lora", "modelspec.prediction_type": "epsilon",
                     "modelspec.implementation": "https://github.com/Stability-AI/StableCascade",
                     "ss_base_model_version": "stable_cascade"})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned prior with its CLIP-G as ComfyUI's stage C checkpoint (``model.diffusion_model.`` + original
        layout, ``text_encoder.clip_g.…``): what its checkpoint loader and its UNET loader read, and model.path here."""

        def cpu(module):
            return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        state = comfy_checkpoint(diffusers_to_original(cpu(self.prior)), cpu(self.text_encoder))
        state = cast_state_dict({k: v.contiguous() for k, v in state.items()}, dtype)
        write_checkpoint(Path(path), state, metadata or {})


def load_lora_into_pipeline(pipe: Any, path: Any, adapter_name: str = "default") -> None:
    """Load an Atelier (ComfyUI-named) Cascade LoRA into a diffusers Stable Cascade pipeline through peft
    (diffusers has no Cascade ``load_lora_weights``): adapters of the file's rank on the prior (and the prior's
    text encoder), then their weights. ``pipe``: the family's sampler, a combined or a prior pipeline."""

    prior_pipe = getattr(pipe, "prior_pipe", pipe)
    state = load_file(str(path))
    alphas = {k.rsplit(".", 1)[0]: float(v) for k, v in state.items() if k.endswith(".alpha")}
    for prefix, module, rename in (("lora_prior_unet_", prior_pipe.prior, comfy_lora_name),
                                   ("lora_prior_te_", prior_pipe.text_encoder, lambda n: n)):
        names = {rename(n).replace(".", "_"): n for n, _ in module.named_modules() if n}
        peft_state, targets, rank, alpha = {}, [], None, None
        for key, tensor in state.items():
            if not key.startswith(prefix) or not key.endswith(("lora_down.weight", "lora_up.weight")):
                continue
            stem, kind = key[len(prefix):].rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            target = names.get(stem)
            if target is None:
                raise ValueError(f"{path}: {key} fits no module of the pipeline")
            targets.append(target)
            peft_state[f"{target}.{'lora_A' if kind == 'lora_down' else 'lora_B'}.weight"] = tensor
            if kind == "lora_down":
                rank = int(tensor.shape[0])
                alpha = alphas.get(prefix + stem, rank)
        if not peft_state:
            continue
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(set(targets))), module,
                                adapter_name)
        result = set_peft_model_state_dict(module, peft_state, adapter_name)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{path}: keys that fit no module: {result.unexpected_keys[:5]}")
