"""ERNIE-Image on diffusers' ``ErnieImagePipeline`` classes: a single-stream DiT (image tokens then text tokens, one
AdaLN modulation shared by every block) over a Mistral3 text model and the Flux.2 VAE's latents.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_ernie_image.py``,
``transformer_ernie_image.py`` and the ``ErnieImage`` modular blocks):

- Text: ``ErnieImagePipeline.encode_prompt``: each caption tokenised alone (special tokens, no padding; an empty one
  is the BOS token), the second-to-last hidden state of its real tokens. Here captions are right-padded with their
  mask (the model is causal: a real token's state does not see the padding) and capped at ``model.t5_max_length``
  tokens (default 512); :meth:`predict` zeroes the padding and trims to the longest caption, which is
  ``ErnieImagePipeline._pad_text``. Caption dropout gives the empty caption's, the negative prompt the pipeline samples
  with.
- Latents: the Flux.2 VAE (32 channels), patchified 2×2 into 128 channels (``_patchify_latents``), normalised by the
  VAE's BatchNorm running statistics with the pipeline's ε = 1e-5 (its decode inverts exactly that).
- Flow matching: the transformer takes σ·1000 and predicts the velocity ε − x, the loop's own objective, with the
  scheduler config's shift (the pipeline's linear σ schedule goes through the scheduler's shift). The timestep goes
  in fp32 (the pipeline passes it in the transformer's dtype; the embedding reads it in fp32).
- The image tokens' RoPE starts after each caption's real length (``text_lens``), as diffusers builds it; ComfyUI and
  diffusion-pipe start it after the padded batch length, which is the same for a batch of one.
- Samples: ``ErnieImagePipeline`` without its prompt enhancer (``pe``); ``cfg_scale`` is its ``guidance_scale``
  (uncond + g·(cond − uncond), guidance above 1).
- Files: LoRA as ``diffusion_model.<module>.lora_A/lora_B.weight`` (α/r baked into ``lora_B``), which ComfyUI's
  generic key map and ``ErnieImagePipeline.load_lora_weights`` both read; fine-tunes as the transformer's one file
  (keys.py). Single files in: the transformer, with VAE, text model and tokenizer from ``model.config_path`` (a
  diffusers ERNIE-Image folder or hub id; default baidu/ERNIE-Image).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel
from torch._subclasses.fake_tensor import is_fake

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    MaskedTextConditioning,
    PeftLayoutLora,
    cut_to_longest,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.ernieimage.keys import config_from_state
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import flow_objective_for

OFFICIAL = "baidu/ERNIE-Image"
MAX_TOKENS = 512  # the default cap on a caption's tokens (the pipeline's is its tokenizer's model_max_length)
BN_EPS = 1e-5  # the pipeline's ε for the VAE's BatchNorm statistics (its config's value is not the trained one)
PREFIX = "diffusion_model"
ATTN = [f"layers.*.self_attention.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0")]
MLP = [f"layers.*.mlp.{m}" for m in ("gate_proj", "up_proj", "linear_fc2")]
# "all" adds the Linears outside the blocks (ComfyUI's generic key map names every one of them)
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP,
           "all": ATTN + MLP + ["text_proj", "adaLN_modulation.1", "time_embedding.linear_1",
                                "time_embedding.linear_2", "final_norm.linear", "final_linear"]}


def _same(path: str) -> str:
    return path


class ErnieImage(MaskedTextConditioning, PeftLayoutLora, Family):
    name = "ernieimage"
    family = "ernie-image"
    prediction_type = "flow"
    fp8_skip = ("x_embedder", "text_proj", "time_embedding", "adaLN_modulation", "final_norm", "final_linear", "norm")
    swap_blocks = ("layers",)
    targets = TARGETS
    modelspec = ("ernie-image", "https://github.com/baidu/ERNIE-Image", "ernie_image")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        self.family = detect_source_family(self.source, mcfg) or "ernie-image"
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=ErnieImagePipeline,
                                                  transformer_cls=ErnieImageTransformer2DModel,
                                                  config=config_from_state, official=OFFICIAL,
                                                  layout="ERNIE-Image's layout", pe=None, pe_tokenizer=None)
        else:
            pipe = sources.load_pipeline(ErnieImagePipeline, self.source, mcfg, workspace, family=self.family,
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config, patch=1)  # tokens are already 2×2 patches
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: ERNIE-Image runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """The posterior's mean and std, patchified 2×2 (the transformer's 128 channels, before normalising)."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        patch = ErnieImagePipeline._patchify_latents
        return {"mean": patch(dist.mean).float().cpu(), "std": patch(dist.std).float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        """A latent drawn from the cached posterior, normalised by the VAE's BatchNorm statistics as the pipeline's
        decode inverts them."""
        mean, std = dist["mean"].to(self.device), dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype,  # on the generator's device
                          device=None if generator is None else generator.device).to(self.device)
        bn = self.vae.bn
        shift = bn.running_mean.view(1, -1, 1, 1).to(self.device, mean.dtype)
        scale = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(self.device, mean.dtype) + BN_EPS)
        return (mean + std * eps - shift) / scale

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """``ErnieImagePipeline.encode_prompt`` for a batch: features [B, max_sequence_length, D] (zero past each
        caption's tokens) and the mask of its real tokens [B, L] (bool)."""
        tok = self.tokenizer
        ids = []
        for caption in captions:
            one = tok(str(caption), add_special_tokens=True, truncation=True, max_length=self.max_sequence_length,
                      padding=False)["input_ids"]
            ids.append(one or [tok.bos_token_id if tok.bos_token_id is not None else 0])
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        length = self.max_sequence_length
        input_ids = torch.tensor([one + [pad] * (length - len(one)) for one in ids], device=self.device)
        mask = torch.tensor([[True] * len(one) + [False] * (length - len(one)) for one in ids], device=self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(input_ids=input_ids, attention_mask=mask.long(),
                                       output_hidden_states=True).hidden_states[-2]
        return hidden * mask[..., None].to(hidden.dtype), mask

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """As :class:`MaskedTextConditioning`, with the features kept in the text model's dtype (half the cache)."""
        with torch.no_grad():  # only as long as the longest caption: the step cuts the rest off anyway
            embeds, mask = cut_to_longest(*self._encode(list(captions)))
        return {"prompt_embeds": embeds.cpu(), "prompt_mask": mask.float().cpu()}

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        """``ErnieImagePipeline``'s transformer call: the captions' features zero-padded to the longest one
        (``_pad_text``) with their lengths, σ·1000 as the timestep (fp32)."""
        device, dtype = model_input.device, model_input.dtype
        mask = conditioning.prompt_mask.to(device).bool()
        lens = mask.sum(dim=1)
        # the VRAM estimate's fake tensors have no values: every token kept, as for the longest caption
        lengths = getattr(conditioning, "lengths", None)  # known on the host when cached (no device read)
        longest = mask.shape[1] if is_fake(mask) else max(max(lengths) if lengths else int(lens.max()), 1)
        embeds = conditioning.prompt_embeds[:, :longest].to(device, dtype) * mask[:, :longest, None].to(dtype)
        return self.transformer(hidden_states=model_input, timestep=timesteps.to(device, torch.float32) * 1000.0,
                                text_bth=embeds, text_lens=lens.long(), return_dict=False)[0]

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = ErnieImagePipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                  text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                  transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:ernie-hidden-2"

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file: ``diffusion_model.<module>``."""
        return {"unet": (PREFIX, _same)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """``diffusion_model.<module>.lora_A/lora_B.weight``, α/r baked into ``lora_B`` (no ``.alpha``: every key of
        diffusers' ERNIE-Image loader must name a LoRA)."""
        out = peft_layout_state_dict(modules, {"unet": PREFIX}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any],
                             adapter_name: str = "default") -> int:
        """A ``diffusion_model.`` file into fresh peft layers (a ``transformer.`` one as :class:`PeftLayoutLora`)."""
        if not any(k.startswith(PREFIX + ".") for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        used = load_peft_layout(state, {"unet": modules["unet"]}, {"unet": PREFIX}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as one file under its own names: what ComfyUI's diffusion-model loader and
        ``ErnieImageTransformer2DModel.from_single_file`` read, and model.path here."""
        save_transformer_file(path, dict(self.transformer.state_dict()), dtype, metadata)
