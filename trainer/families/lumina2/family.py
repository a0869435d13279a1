"""Lumina 2 (Lumina-Image-2.0 and its fine-tunes such as Neta-Lumina) on diffusers' ``Lumina2Pipeline`` classes: a
single-stream NextDiT over patchified latents and Gemma-2 text features.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_lumina2.py`` and
``transformer_lumina2.py``):

- Text: the pipeline prepends its system prompt to every caption (``system_prompt + " <Prompt Start> " + caption``),
  pads to 256 tokens and takes Gemma's second-to-last hidden layer with the attention mask; the transformer gets the
  padded features and the mask. The unconditional pass (negative prompt "") is encoded without the system prompt,
  so caption dropout gives exactly that.
- The transformer's clock runs the other way: it takes 1 − σ and returns x − ε (the pipeline passes
  ``1 − t/1000`` and negates the output), so :meth:`predict` turns both around and the loop keeps the common flow
  objective (σ, target ε − x), with the scheduler config's shift.
- Latents: the Flux VAE's 16 channels, ``(z − shift) · scale``, as [B, C, H, W].
- Files: LoRA in the original layout (``diffusion_model.<module>``, :mod:`trainer.families.lumina2.lora_keys` says
  why) that ComfyUI and ``Lumina2Pipeline.load_lora_weights`` read; fine-tunes as the original single file (keys.py).
  Single files in: the transformer (Alpha-VLLM's, ComfyUI's, Neta-Lumina's), with VAE, Gemma and tokenizer from
  ``model.config_path`` (a diffusers Lumina 2 folder or hub id; default Alpha-VLLM/Lumina-Image-2.0).
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any, Dict, List, Optional

import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel
from torch._subclasses.fake_tensor import is_fake

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    MaskedTextConditioning,
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.lumina2 import lora_keys
from trainer.families.lumina2.keys import (
    config_from_original,
    diffusers_to_original,
    original_module,
    original_to_diffusers,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.formats.kohya import lora_layers
from trainer.objectives import flow_objective_for

OFFICIAL = "Alpha-VLLM/Lumina-Image-2.0"
MAX_TOKENS = 256  # Lumina2Pipeline's max_sequence_length
# Lumina2Pipeline.__init__'s system prompt and the marker encode_prompt joins it to the caption with
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
PROMPT_START = " <Prompt Start> "
ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
MLP = ["feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3"]
# "all" adds the blocks' modulation Linear: exactly the modules diffusers' LoRA converter reads
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP, "all": ATTN + MLP + ["norm1.linear"]}


class _Counted:
    """What the transformer's RoPE embedder reads of a text mask (its shape and each row's token count,
    ``mask.sum(dim=1).tolist()``, a device read) when the counts are known on the host: a cached batch's lengths
    (``MaskedText.lengths``), or every token for a mask without values (the VRAM estimate's fake tensors, whose
    ``.tolist()`` cannot run)."""

    def __init__(self, shape, counts: List[int]):
        self.shape, self.counts = tuple(shape), list(counts)

    def sum(self, dim: int) -> "_Counted":
        return self

    def tolist(self) -> List[int]:
        return self.counts


def _counted(counts: Optional[List[int]], _module, args):
    """The RoPE embedder's pre-hook: its mask argument as :class:`_Counted` (``counts`` None: every token). Inside a
    whole compiled transformer (``training.compile_scope: denoiser``) the mask stays (host counts would be guarded
    on: a recompile for each new set of caption lengths)."""
    if counts is not None and torch.compiler.is_compiling():
        return None
    hidden_states, mask = args
    return hidden_states, _Counted(mask.shape, counts if counts is not None else [mask.shape[1]] * mask.shape[0])


class Lumina2(MaskedTextConditioning, PeftLayoutLora, Family):
    cache_cut = True  # the transformer cuts each caption to its mask's length itself: the cache keeps no more
    name = "lumina2"
    family = "lumina2"
    prediction_type = "flow"
    fp8_skip = ("norm", "x_embedder", "time_caption_embed", "norm_out")
    swap_blocks = ("layers",)
    targets = TARGETS
    modelspec = ("lumina-2", "https://github.com/Alpha-VLLM/Lumina-Image-2.0", "lumina2")

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        detect_source_family(self.source, mcfg)
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=Lumina2Pipeline,
                                                  transformer_cls=Lumina2Transformer2DModel,
                                                  config=config_from_original, to_diffusers=original_to_diffusers,
                                                  official=OFFICIAL, layout="the original layout")
        else:
            pipe = sources.load_pipeline(Lumina2Pipeline, self.source, mcfg, workspace, family="lumina2",
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.tokenizer.padding_side = "right"  # as Lumina2Pipeline sets it
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config)
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Lumina 2 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self.system_prompt = str(getattr(mcfg, "system_prompt", "") or "") or SYSTEM_PROMPT

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False, system: bool = True):
        """As ``Lumina2Pipeline.encode_prompt`` (``system``: the prompt's system prompt; the negative prompt has none):
        (features [B, L, D] padded to the sequence length, mask of the real tokens [B, L])."""
        texts = [self.system_prompt + PROMPT_START + str(c) if system else str(c) for c in captions]
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask,
                                       output_hidden_states=True).hidden_states[-2]
        return hidden, mask.bool()

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if drop_te1 is not None and any(drop_te1) and self._empty is None:
            # the unconditional features the pipeline samples with: "" without the system prompt
            with torch.no_grad():
                embeds, mask = self._encode([""], system=False)
            self._empty = {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu()}
        return super().batch_condition(batch, expand, train_text, drop_te1, drop_te2)

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        device, dtype = model_input.device, model_input.dtype
        embeds = conditioning.prompt_embeds.to(device, dtype)
        mask = conditioning.prompt_mask.to(device).bool()
        hook = None
        rope = self.transformer.rope_embedder
        lengths = getattr(conditioning, "lengths", None)  # a cached batch's, counted on the host
        if is_fake(mask):  # the VRAM estimate: every caption token kept, the longest joint sequence
            hook = rope.register_forward_pre_hook(partial(_counted, None))
        else:
            if device.type != "mps" and rope.__dict__.get("_tables_on") != str(device):
                # diffusers keeps the rotary tables in a list, not buffers: the model's move leaves them on the CPU
                # and every forward copied them over (three blocking copies); here they move once (MPS: diffusers
                # looks them up on the CPU, and they are float64)
                rope.freqs_cis = [f.to(device) for f in rope.freqs_cis]
                rope._tables_on = str(device)
            if lengths is not None and len(lengths) == mask.shape[0]:  # the captions' lengths without a device read
                hook = rope.register_forward_pre_hook(partial(_counted, list(lengths)))
        try:
            # the timestep in fp32, as Lumina2Pipeline passes it (1 − t/1000): the time embedding is computed from it
            out = self.transformer(hidden_states=model_input, timestep=1.0 - timesteps.to(device, torch.float32),
                                   encoder_hidden_states=embeds, encoder_attention_mask=mask, return_dict=False)[0]
        finally:
            if hook is not None:
                hook.remove()
        return -out  # the transformer predicts x − ε

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = Lumina2Pipeline(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                               text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length, "system_prompt": self.system_prompt}

    def text_fingerprint(self, mcfg: Any) -> str:
        key = f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:gemma2-system-prompt"
        if self.system_prompt != SYSTEM_PROMPT:  # its own system prompt is part of every cached caption's features
            key += "-" + hashlib.sha1(self.system_prompt.encode()).hexdigest()[:12]
        return key

    # --- LoRA files ---------------------------------------------------------------------------
    def _linears(self) -> Dict[str, tuple]:
        out = {}
        for path, module in self.transformer.named_modules():
            weight = getattr(getattr(module, "base_layer", module), "weight", None)
            if isinstance(getattr(module, "base_layer", module), torch.nn.Linear) and weight is not None:
                out[path.replace(".base_layer", "")] = tuple(weight.shape)
        return out

    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file (``diffusion_model.<original>``); q/k/v
        share the fused ``qkv``."""
        return {"unet": ("diffusion_model", original_module)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA in the original layout (α/r baked into ``lora_B``; q/k/v fused block-diagonally;
        zero LoRAs where diffusers' converter expects a module the run did not adapt)."""
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return lora_keys.to_original(out, self._linears())

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        """An original-layout file into fresh peft layers (a diffusers-layout file as :class:`PeftLayoutLora` reads
        it); the zero padding for diffusers is skipped."""
        if not any(k.startswith(lora_keys.PREFIX) for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        ranks = {path: layer.r[adapter_name] for path, layer in lora_layers(modules["unet"], adapter_name)}
        tensors, used = lora_keys.from_original(state, ranks, self._linears())
        loaded = load_peft_layout(tensors, {"unet": modules["unet"]}, {"unet": "transformer"}, adapter_name)
        extra = sorted(set(state) - used - lora_keys.zero_entries(state))
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(loaded) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py): what ComfyUI's diffusion-model loader and
        ``Lumina2Transformer2DModel.from_single_file`` (at the released sizes) read, and model.path here."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
