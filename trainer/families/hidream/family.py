"""HiDream-I1 (full, dev, fast) on diffusers' ``HiDreamImagePipeline`` classes: a 17B sparse mixture-of-experts DiT
(dual-stream then single-stream blocks, each feed-forward a shared expert plus two of four routed experts) conditioned
on four text encoders.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_hidream_image.py`` and
``transformer_hidream_image.py``):

- Text, as ``HiDreamImagePipeline.encode_prompt`` builds it: the pooled vector is CLIP-L's ‖ CLIP-G's projected
  outputs (both padded to 128 tokens: HiDream's CLIPs take 248 positions); T5-XXL's last hidden state over 128
  tokens; Llama-3.1-8B-Instruct's hidden states of every layer (``hidden_states[1:]``, padded with its eos), of
  which each transformer block reads the one ``transformer.config.llama_layers`` names. Only the layers some block
  reads are kept (19 of 32 for the released model) and the cache holds those. Each encoder has its own caption
  dropout (its encoding of the empty caption, which is what the pipeline's negative prompt "" gives) and its own
  switch (``parts.text_encoder_N.enabled``: off, it sees only the empty caption, in training and in samples).
- The transformer's clock is the pipeline's: t = σ·1000 (fp32), and it predicts x − ε (the pipeline negates it), so
  :meth:`predict` negates and the loop keeps the common flow objective (σ, target ε − x). The shift is the loaded
  scheduler's (full 3.0, dev 6.0, fast 3.0). In training mode the transformer returns its output still in patches
  ([B, C, tokens, p·p], the routed experts run the differentiable path); :meth:`predict` unpatchifies it.
- The MoE router's load-balancing loss: diffusers computes it in training mode and drops it (its
  ``AddAuxiliaryLoss`` is commented out); ai-toolkit adds none either. Here too none: a LoRA does not touch the
  router (its gate is a bare Parameter, not a Linear), and a fine-tune trains it by the diffusion loss alone.
  The routed experts' training path is diffusers' with the rows sorted by expert (``moe.py``): the same result,
  one device read per feed-forward instead of two per expert.
- Latents: the Flux VAE's 16 channels, ``(z − shift) · scale``, as [B, C, H, W]; non-square latents are padded to
  the transformer's ``max_seq`` tokens with a mask, as the transformer itself does.
- Files: LoRA in the diffusers/peft layout (``transformer.<module>``; the original layout has diffusers' own module
  names), which ``HiDreamImagePipeline.load_lora_weights`` and ComfyUI (``transformer.<key>`` for its HiDream
  model) read. Fine-tunes as the original single file (``model.diffusion_model.<module>``); single files in: the
  transformer, with VAE and text encoders from ``model.config_path`` (default HiDream-ai/HiDream-I1-Full).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel
from torch._subclasses.fake_tensor import is_fake

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.common.transformer_kit import (
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.hidream.detect import variant_of
from trainer.families.hidream.keys import PREFIX, config_from_original, strip_prefix
from trainer.families.hidream.moe import sort_experts_rows
from trainer.families.sources import classify_source, detect_source_family
from trainer.objectives import FlowMatchingObjective

OFFICIAL = "HiDream-ai/HiDream-I1-Full"
MAX_TOKENS = 128  # HiDreamImagePipeline's max_sequence_length
TEXT_SLOTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
SHIFT = {"hidream-full": 3.0, "hidream-dev": 6.0, "hidream-fast": 3.0}  # HiDream-I1's inference script
ATTN = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out", "attn1.to_q_t", "attn1.to_k_t", "attn1.to_v_t",
        "attn1.to_out_t"]
MLP = ["ff_i.shared_experts.w1", "ff_i.shared_experts.w2", "ff_i.shared_experts.w3", "ff_i.experts.*.w1",
       "ff_i.experts.*.w2", "ff_i.experts.*.w3", "ff_t.w1", "ff_t.w2", "ff_t.w3"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP, "all": ATTN + MLP + ["adaLN_modulation.1"]}
# cache keys of each encoder's outputs (the pooled CLIPs, T5's and Llama's features)
KEYS = {"text_encoder": "clip_l_pooled", "text_encoder_2": "clip_g_pooled", "text_encoder_3": "t5",
        "text_encoder_4": "llama"}


class HiDreamConditioning:
    """The transformer's text inputs: T5 features [B, L, D], the Llama layers it reads [B, layers, L, D] and the pooled
    CLIP-L ‖ CLIP-G vector [B, P]."""

    def __init__(self, t5, llama, pooled):
        self.t5, self.llama, self.pooled = t5, llama, pooled

    def to(self, *args: Any, **kwargs: Any) -> "HiDreamConditioning":
        return HiDreamConditioning(self.t5.to(*args, **kwargs), self.llama.to(*args, **kwargs),
                                   self.pooled.to(*args, **kwargs))


class _SwitchedPipeline(HiDreamImagePipeline):
    """``HiDreamImagePipeline`` whose switched-off text encoders (``atelier_off``: slots) read the empty caption, as
    they did in training (the pipeline's own ``prompt_N`` cannot say "empty": it falls back to ``prompt``)."""

    atelier_off: frozenset = frozenset()

    def _blank(self, slot: str, prompt):
        if slot not in self.atelier_off:
            return prompt
        return [""] * (1 if isinstance(prompt, str) else len(prompt))

    def _get_clip_prompt_embeds(self, tokenizer, text_encoder, prompt, *args, **kwargs):
        slot = "text_encoder" if text_encoder is self.text_encoder else "text_encoder_2"
        return super()._get_clip_prompt_embeds(tokenizer, text_encoder, self._blank(slot, prompt), *args, **kwargs)

    def _get_t5_prompt_embeds(self, prompt=None, *args, **kwargs):
        return super()._get_t5_prompt_embeds(self._blank("text_encoder_3", prompt), *args, **kwargs)

    def _get_llama3_prompt_embeds(self, prompt=None, *args, **kwargs):
        return super()._get_llama3_prompt_embeds(self._blank("text_encoder_4", prompt), *args, **kwargs)


class HiDream(PeftLayoutLora, Family):
    name = "hidream"
    prediction_type = "flow"
    fp8_skip = ("t_embedder", "p_embedder", "x_embedder", "final_layer", "caption_projection", "gate")
    swap_blocks = ("double_stream_blocks", "single_stream_blocks")
    targets = TARGETS
    modelspec = ("hidream-i1", "https://github.com/HiDream-ai/HiDream-I1", "hidream_i1")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder",
                                      text_encoder_2="text_encoder_2", text_encoder_3="text_encoder_3",
                                      text_encoder_4="text_encoder_4")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=HiDreamImagePipeline,
                                                  transformer_cls=HiDreamImageTransformer2DModel,
                                                  config=config_from_original, to_diffusers=strip_prefix,
                                                  official=OFFICIAL, layout="the original layout")
        else:
            pipe = sources.load_pipeline(HiDreamImagePipeline, self.source, mcfg, workspace,
                                         family=found or "hidream-full", dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        sort_experts_rows(self.transformer)  # one device read per routed feed-forward in training, not eight
        for slot in TEXT_SLOTS:
            setattr(self, slot, getattr(pipe, slot))
            setattr(self, slot.replace("text_encoder", "tokenizer"), getattr(pipe, slot.replace("text_encoder",
                                                                                                  "tokenizer")))
        self.tokenizer_4.pad_token = self.tokenizer_4.eos_token  # as HiDreamImagePipeline.__init__ sets it
        # Llama's hidden states are read, never its logits: its vocabulary head (0.5B weights, 1 GiB in bf16, and a
        # [tokens, 128256] product at each encode) is left out; the forward then returns hidden states as "logits"
        self.text_encoder_4.lm_head = torch.nn.Identity()
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        # model.family where it names a variant (a single file does not say which it is), else what detection found
        self.family = chosen if chosen in SHIFT else found or variant_of(
            str(mcfg.path), self._sched_config | {"_class_name": self._sched_class.__name__})
        # the scheduler's fixed shift (UniPC names it flow_shift), else the variant's
        shift = self._sched_config.get("shift", self._sched_config.get("flow_shift")) or SHIFT[self.family]
        self.objective = FlowMatchingObjective(shift=float(shift))
        self.disabled = frozenset(getattr(mcfg, "disabled", ()) or ())
        self.max_sequence_length = int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS)
        self.llama_used = sorted(set(int(k) for k in self.transformer.config.llama_layers))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", *TEXT_SLOTS, "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: HiDream-I1 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._empty: Optional[Dict[str, Any]] = None

    # --- text -------------------------------------------------------------------------------
    def _clip(self, slot: str, captions: List[str], grads: frozenset):
        tokenizer = self.tokenizer if slot == "text_encoder" else self.tokenizer_2
        ids = tokenizer(captions, padding="max_length", max_length=min(self.max_sequence_length, 218),
                        truncation=True, return_tensors="pt").input_ids
        with torch.set_grad_enabled(torch.is_grad_enabled() and slot in grads):
            return getattr(self, slot)(ids.to(self.device), output_hidden_states=True)[0]

    def _t5(self, captions: List[str], grads: frozenset):
        tokens = self.tokenizer_3(captions, padding="max_length", truncation=True, add_special_tokens=True,
                                  max_length=min(self.max_sequence_length, self.tokenizer_3.model_max_length),
                                  return_tensors="pt")
        with torch.set_grad_enabled(torch.is_grad_enabled() and "text_encoder_3" in grads):
            return self.text_encoder_3(tokens.input_ids.to(self.device),
                                       attention_mask=tokens.attention_mask.to(self.device))[0]

    def _llama(self, captions: List[str], grads: frozenset):
        """The Llama layers the transformer reads, [B, layers, L, D]. The pipeline also asks for the attention maps
        (which forces eager attention); the hidden states are the same without them."""
        tokens = self.tokenizer_4(captions, padding="max_length", truncation=True, add_special_tokens=True,
                                  max_length=min(self.max_sequence_length, self.tokenizer_4.model_max_length),
                                  return_tensors="pt")
        with torch.set_grad_enabled(torch.is_grad_enabled() and "text_encoder_4" in grads):
            hidden = self.text_encoder_4(tokens.input_ids.to(self.device),
                                         attention_mask=tokens.attention_mask.to(self.device),
                                         output_hidden_states=True).hidden_states[1:]
        return torch.stack([hidden[k] for k in self.llama_used], dim=1)

    def _encode(self, captions: List[str], grads: frozenset = frozenset()) -> Dict[str, Any]:
        return {KEYS["text_encoder"]: self._clip("text_encoder", captions, grads),
                KEYS["text_encoder_2"]: self._clip("text_encoder_2", captions, grads),
                KEYS["text_encoder_3"]: self._t5(captions, grads),
                KEYS["text_encoder_4"]: self._llama(captions, grads)}

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """The four encoders' features for the text cache: T5's and Llama's 19 layers in the dtype they come out in
        (bf16 from bf16/fp8/NF4 encoders: half the ~40 MB a caption in fp32; the step casts them to its compute dtype,
        which leaves a bf16 value as it is), the CLIPs' pooled vectors in fp32."""
        kept = (KEYS["text_encoder_3"], KEYS["text_encoder_4"])
        with torch.no_grad():
            return {k: (v if k in kept else v.float()).cpu() for k, v in self._encode(list(captions)).items()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None,
                        drop_te3=None, drop_te4=None):
        if all(batch.get(k) is not None for k in KEYS.values()):
            enc = {k: batch[k].to(self.device) for k in KEYS.values()}
        else:
            enc = self._encode(list(expand(batch["captions"])), frozenset(train_text) & set(TEXT_SLOTS))
        for key, flags in zip(KEYS.values(), (drop_te1, drop_te2, drop_te3, drop_te4)):
            if flags is None or not any(flags):
                continue
            if self._empty is None:  # each encoder's encoding of "", the pipeline's negative prompt
                self._empty = self.encode_captions([""])
            f = flags_on(flags, enc[key].device)
            empty = kept_on(self, key, self._empty[key], enc[key])
            enc[key] = torch.where(f.view(-1, *([1] * (enc[key].ndim - 1))), empty, enc[key])
        pooled = torch.cat([enc[KEYS["text_encoder"]], enc[KEYS["text_encoder_2"]]], dim=-1)
        return HiDreamConditioning(enc[KEYS["text_encoder_3"]], enc[KEYS["text_encoder_4"]], pooled)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        device, dtype = model_input.device, model_input.dtype
        llama = conditioning.llama.to(device, dtype)
        # the transformer indexes the Llama layers by number (llama_layers); the layers no block reads stay None
        layers: List[Any] = [None] * (max(self.llama_used) + 1)
        for i, k in enumerate(self.llama_used):
            layers[k] = llama[:, i]
        # the VRAM estimate's fake tensors: the inference path counts the experts' tokens (bincount) and reads the
        # patch grid back from a tensor, which a fake tensor cannot tell, so the sample phase runs the training path
        # (the same activations, without gradients there)
        inference = is_fake(model_input) and not self.transformer.training
        if inference:
            self.transformer.train()
        try:
            out = self._call(model_input, timesteps, conditioning, layers, device, dtype)
        finally:
            if inference:
                self.transformer.eval()
        if out.shape != model_input.shape:  # training mode: [B, C, tokens, p·p], padded to max_seq when not square
            out = self._unpatchify(out, model_input.shape)
        return -out  # the transformer predicts x − ε

    def _call(self, model_input, timesteps, conditioning, layers, device, dtype):
        # the timestep in fp32, σ·1000, as HiDreamImagePipeline passes the scheduler's
        return self.transformer(hidden_states=model_input, timesteps=timesteps.to(device, torch.float32) * 1000,
                                encoder_hidden_states_t5=conditioning.t5.to(device, dtype),
                                encoder_hidden_states_llama3=layers,
                                pooled_embeds=conditioning.pooled.to(device, dtype), return_dict=False)[0]

    def _unpatchify(self, out, shape):
        b, c, h, w = shape
        p = int(self.transformer.config.patch_size)
        out = out[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
        return out.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        """HiDreamImagePipeline over the live modules with the model's own scheduler; encoders switched off read the
        empty caption. Its default size (the area it rescales every sample to) is the transformer's
        ``max_resolution``: 128 latent pixels, 1024², for the released model, as the pipeline's own default."""
        pipe = _SwitchedPipeline(
            scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae, transformer=self.transformer,
            text_encoder=self.text_encoder, tokenizer=self.tokenizer, text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2, text_encoder_3=self.text_encoder_3, tokenizer_3=self.tokenizer_3,
            text_encoder_4=self.text_encoder_4, tokenizer_4=self.tokenizer_4)
        pipe.atelier_off = self.disabled
        pipe.default_sample_size = int(self.transformer.config.max_resolution[0])
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def text_fingerprint(self, mcfg: Any) -> str:
        dtypes = ":".join(part_dtype(mcfg, s) for s in TEXT_SLOTS)
        return f"{mcfg.path}:{dtypes}:{self.max_sequence_length}:llama{self.llama_used}"

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (``model.diffusion_model.<module>``): what
        ComfyUI's diffusion-model loader and ``HiDreamImageTransformer2DModel.from_single_file`` read."""
        save_transformer_file(path, {PREFIX + k: v for k, v in self.transformer.state_dict().items()}, dtype,
                              metadata)
