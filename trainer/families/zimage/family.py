"""Z-Image (Turbo and base) on diffusers' ``ZImagePipeline`` classes: a single-stream DiT over patchified latents
and Qwen3 text features.

What differs, and where it lives here:

- Text: the caption in Qwen3's chat template (one user turn, generation prompt), the second-to-last hidden layer,
  and only the real tokens (``ZImagePipeline._encode_prompt``: a list of variable-length features). The cache keeps
  the padded features with their mask; :meth:`predict` hands the transformer each caption's real tokens. Caption
  dropout gives the empty caption's features.
- The transformer's clock runs the other way: it takes 1 − σ and returns −(ε − x) (the pipeline passes
  ``(1000 − t)/1000`` and negates the output), so :meth:`predict` turns both around and the loop keeps the common
  flow objective (σ, target ε − x), with the scheduler config's shift.
- Latents: the Flux VAE's 16 channels, ``(z − shift) · scale``; the transformer takes each image as [C, 1, H, W].
- Files: LoRA in the diffusers/peft layout (``transformer.<module>``) that ``ZImagePipeline.load_lora_weights``
  reads; fine-tunes as the original single file (keys.py). Single files in: the transformer, with VAE, Qwen3 and
  tokenizer from ``model.config_path`` (a diffusers Z-Image folder or hub id; default Tongyi-MAI/Z-Image-Turbo).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.families.base import Family, ModelLoadError, part_dtype

OFFICIAL = "Tongyi-MAI/Z-Image-Turbo"
MAX_TOKENS = 512
ATTN = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
           "all": ATTN + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0"]}


class ZImageConditioning:
    """Qwen3 features [B, L, D] padded, with the mask of the real tokens [B, L]; ``.to()`` like a tensor."""

    def __init__(self, prompt_embeds, prompt_mask):
        self.prompt_embeds, self.prompt_mask = prompt_embeds, prompt_mask

    def to(self, *args: Any, **kwargs: Any) -> "ZImageConditioning":
        import torch
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        return ZImageConditioning(self.prompt_embeds.to(*args, **kwargs),
                                  self.prompt_mask if device is None else self.prompt_mask.to(device))


class ZImage(Family):
    name = "zimage"
    family = "z-image"
    prediction_type = "flow"
    fp8_skip = ("norm", "x_embedder", "cap_embedder", "t_embedder", "final_layer", "adaLN")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        import torch
        from diffusers import ZImagePipeline

        from trainer.models.base import classify_source, detect_source_family, load_pipeline
        from trainer.objectives import flow_objective_for
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, dtypes)
        else:
            pipe = load_pipeline(ZImagePipeline, self.source, mcfg, workspace, family="z-image", dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config)
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Z-Image runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    def _from_single_file(self, mcfg: Any, dtypes: Dict[str, Any]):
        from diffusers import ZImagePipeline, ZImageTransformer2DModel
        from safetensors.torch import load_file

        from trainer.families.zimage.keys import config_from_original, original_to_diffusers
        from trainer.models.base import _hub_offline
        rest = getattr(mcfg, "config_path", "") or OFFICIAL
        try:
            state = {k.split("model.diffusion_model.", 1)[-1]: v for k, v in load_file(self.source.location).items()}
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}' could not be read as a .safetensors file: {exc}",
                                 key="model.path", value=self.source.display) from None
        local = Path(rest) / "transformer" / "config.json"
        base = json.loads(local.read_text()) if local.is_file() else {}
        try:
            transformer = ZImageTransformer2DModel.from_config(config_from_original(state, base))
            weights = original_to_diffusers(state)
            for pad in ("x_pad_token", "cap_pad_token"):  # learned pads some files leave out: keep the model's
                weights.setdefault(pad, transformer.state_dict()[pad])
            transformer.load_state_dict(weights, strict=True)
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': not a complete Z-Image transformer in the original "
                                 f"layout ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                                 key="model.path", value=self.source.display) from None
        transformer.to(dtypes["transformer"])
        kw: Dict[str, Any] = {"dtype": {k: v for k, v in dtypes.items() if k != "transformer"}}
        if not Path(rest).is_dir():
            kw.update(cache_dir=getattr(mcfg, "cache_dir", "") or None, revision=getattr(mcfg, "revision", "") or None)
        try:
            return ZImagePipeline.from_pretrained(rest, transformer=transformer,
                                                  local_files_only=Path(rest).is_dir() or _hub_offline(mcfg), **kw)
        except Exception as exc:
            raise ModelLoadError(
                f"model.path '{self.source.display}' is the Z-Image transformer alone; its VAE and Qwen3 come from "
                f"model.config_path ('{rest}'), which could not be loaded ({type(exc).__name__}). Set model.config_path "
                f"to a diffusers Z-Image folder (or the hub id {OFFICIAL}, downloaded once with network access).",
                key="model.config_path", value=rest) from None

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``ZImagePipeline._encode_prompt``, padded: (features [B, L, D], mask of the real tokens [B, L])."""
        import torch
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": str(c)}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True) for c in captions]
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device).bool()
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                                       output_hidden_states=True).hidden_states[-2]
        return hidden, mask

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        import torch
        with torch.no_grad():
            embeds, mask = self._encode(list(captions))
        return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        import torch
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
            mask = batch["prompt_mask"].to(self.device).bool()
        else:
            embeds, mask = self._encode(list(expand(batch["captions"])), "text_encoder" in train_text)
        if drop_te1 is not None and any(drop_te1):
            if self._empty is None:
                self._empty = self.encode_captions([""])
            flags = torch.as_tensor(list(drop_te1), dtype=torch.bool, device=embeds.device)
            embeds = torch.where(flags[:, None, None], self._empty["prompt_embeds"].to(embeds), embeds)
            mask = torch.where(flags[:, None], self._empty["prompt_mask"].to(mask.device).bool(), mask)
        return ZImageConditioning(embeds, mask)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        import torch
        dtype, device = model_input.dtype, model_input.device
        images = list(model_input.unsqueeze(2).unbind(dim=0))  # each [C, 1, H, W]
        embeds = conditioning.prompt_embeds.to(device, dtype)
        mask = conditioning.prompt_mask.to(device).bool()
        captions = [embeds[i][mask[i]] for i in range(embeds.shape[0])]
        out = self.transformer(images, (1.0 - timesteps.to(device, dtype)), captions, return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)  # the transformer predicts x − ε

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        from diffusers import ZImagePipeline
        pipe = ZImagePipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                              text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:qwen3-chat"

    # --- export -----------------------------------------------------------------------------
    def lora_targets(self, slot: str, preset: str):
        return list(TARGETS[preset])

    def lora_namer(self):
        """LyCORIS (LoHa/LoKr) names: ``lycoris_<diffusers module path>``."""
        return {"unet": ("lycoris", lambda p: p)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        from trainer.families.common.peft_lora import peft_layout_state_dict
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        from trainer.families.common.peft_lora import load_peft_layout
        used = load_peft_layout(state, modules, {"unet": "transformer"}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        from trainer.export import modelspec_common
        meta = modelspec_common(title=title, resolution=resolution)
        meta.update({"modelspec.architecture": "z-image/lora", "modelspec.prediction_type": "flow",
                     "modelspec.implementation": "https://github.com/Tongyi-MAI/Z-Image", "ss_base_model_version": "z_image"})
        meta.update(extra or {})
        return meta

    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        from trainer.export import _cast, _write_checkpoint
        from trainer.families.zimage.keys import diffusers_to_original
        state = diffusers_to_original({k: v.detach().cpu() for k, v in self.transformer.state_dict().items()})
        _write_checkpoint(Path(path), _cast({k: v.contiguous() for k, v in state.items()}, dtype), metadata or {})
