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

from typing import Any, Dict, List, Optional

import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.transformer_kit import (
    MaskedTextConditioning,
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.families.zimage.keys import config_from_original, diffusers_to_original, original_to_diffusers
from trainer.objectives import flow_objective_for

OFFICIAL = "Tongyi-MAI/Z-Image-Turbo"
MAX_TOKENS = 512
ATTN = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
           # the blocks' modulation Linear (the final layer's adaLN_modulation.0 is its SiLU)
           "all": ATTN + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "layers.*.adaLN_modulation.0",
                          "noise_refiner.*.adaLN_modulation.0"]}


class ZImage(MaskedTextConditioning, PeftLayoutLora, Family):
    cache_cut = True  # the step cuts captions to their length: the cache keeps no more
    name = "zimage"
    family = "z-image"
    prediction_type = "flow"
    fp8_skip = ("norm", "x_embedder", "cap_embedder", "t_embedder", "final_layer", "adaLN")
    swap_blocks = ("layers",)
    targets = TARGETS
    modelspec = ("z-image", "https://github.com/Tongyi-MAI/Z-Image", "z_image")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = self._from_single_file(mcfg, dtypes)
        else:
            pipe = sources.load_pipeline(ZImagePipeline, self.source, mcfg, workspace, family="z-image", dtype=dtypes)
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

    def _from_single_file(self, mcfg: Any, dtypes: Dict[str, Any]):
        return pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=ZImagePipeline,
                                              transformer_cls=ZImageTransformer2DModel, config=config_from_original,
                                              to_diffusers=original_to_diffusers, official=OFFICIAL,
                                              layout="the original layout")

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``ZImagePipeline._encode_prompt``, padded: (features [B, L, D], mask of the real tokens [B, L])."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": str(c)}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True) for c in captions]
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device).bool()
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                                       output_hidden_states=True).hidden_states[-2]
        return hidden, mask

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        dtype, device = model_input.dtype, model_input.device
        images = list(model_input.unsqueeze(2).unbind(dim=0))  # each [C, 1, H, W]
        embeds = conditioning.prompt_embeds.to(device, dtype)
        lengths = getattr(conditioning, "lengths", None)
        if lengths is not None:  # the real tokens come first: cut at the lengths the host knows (no device read)
            captions = [embeds[i, :n] for i, n in enumerate(lengths)]
        else:
            mask = conditioning.prompt_mask.to(device).bool()
            captions = [embeds[i][mask[i]] for i in range(embeds.shape[0])]
        # the timestep in fp32, as ZImagePipeline passes it ((1000 − t) / 1000): the transformer embeds it in fp32
        out = self.transformer(images, (1.0 - timesteps.to(device, torch.float32)), captions, return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)  # the transformer predicts x − ε

    def before_compile(self, device: Any) -> None:
        """diffusers' ``RopeEmbedder`` makes its tables at its first call, under ``with torch.device("cpu")``, which
        torch.compile cannot trace: the whole transformer's first compiled call broke three times (and the run
        warned so), and the next call compiled it again whole. Made here, on the device the step's ids are on."""
        rope = self.transformer.rope_embedder
        rope(torch.zeros((1, len(rope.axes_dims)), dtype=torch.long, device=device))

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = ZImagePipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                              text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:qwen3-chat"

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py)."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
