"""HunyuanImage 2.1 on diffusers' ``HunyuanImagePipeline`` classes: a dual/single-stream MMDiT over Qwen2.5-VL features
(and ByT5 features of the caption's quoted text) and the 32× VAE's 64-channel latents.

What differs, and where it lives here (read in diffusers 0.42.1 ``pipeline_hunyuanimage.py`` and
``transformer_hunyuanimage.py``):

- Text: the pipeline's own ``encode_prompt`` is called as is (on the parts it reads): Qwen2.5-VL's third-last hidden
  layer of the caption in the pipeline's system template, the template's first 34 tokens dropped, padded to 1000
  tokens; and the glyph path: the text in quotes (``extract_glyph_text``) through ByT5 padded to 128 tokens, or zeros
  with an empty mask when the caption quotes nothing. Caption dropout of the first encoder gives the empty caption's
  Qwen features, of the second the no-glyph zeros.
- Latents: the VAE's posterior times ``scaling_factor`` (the pipeline's decode divides by it alone); no packing (the
  transformer's patch is 1×1).
- Flow matching: the transformer takes t = 1000·σ and predicts the velocity ε − x; σ as the scheduler's fixed shift
  (5) draws it.
- Samples: the pipeline with its adaptive projected guider; ``cfg_scale`` is that guider's ``guidance_scale``.
- Files: LoRA in Tencent's original layout (``diffusion_model.<module>``, q/k/v stacked: lora_keys.py says why) that
  ComfyUI reads; diffusers 0.42.1's pipeline has no LoRA loader, so :func:`load_lora_into_pipeline` gives its
  transformer's ``load_lora_adapter`` the diffusers layout of the file. Fine-tunes as Tencent's original single file
  (keys.py). Single files in: the transformer, with the rest from ``model.config_path`` (a diffusers folder or hub id;
  default hunyuanvideo-community/HunyuanImage-2.1-Diffusers).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint
from diffusers import HunyuanImagePipeline, HunyuanImageTransformer2DModel
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import is_fake

from trainer.data.text_rows import prefix_lengths
from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.host_copy import flags_on
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    PeftLayoutLora,
    pipeline_with_transformer_file,
    rows_replaced,
    save_transformer_file,
)
from trainer.families.hunyuanimage import lora_keys
from trainer.families.hunyuanimage.joined_text import join, join_texts
from trainer.families.hunyuanimage.keys import (
    config_from_original,
    diffusers_to_original,
    original_module,
    original_to_diffusers,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.formats.kohya import lora_layers
from trainer.objectives import flow_objective_for

OFFICIAL = "hunyuanvideo-community/HunyuanImage-2.1-Diffusers"
MAX_TOKENS = 1000  # HunyuanImagePipeline.tokenizer_max_length
ENCODE_BATCH = 4  # captions through Qwen2.5-VL at once when the text cache is built
DROP = 34  # HunyuanImagePipeline.prompt_template_encode_start_idx: the template's tokens dropped
_DOUBLE = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out"]
_SINGLE = ["attn.to_q", "attn.to_k", "attn.to_v"]
ATTN = [f"transformer_blocks.*.{m}" for m in _DOUBLE] + [f"single_transformer_blocks.*.{m}" for m in _SINGLE]
MLP = [f"transformer_blocks.*.{m}" for m in ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                             "ff_context.net.2")] + \
      [f"single_transformer_blocks.*.{m}" for m in ("proj_mlp", "proj_out")]
MOD = ["transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
       "single_transformer_blocks.*.norm.linear"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + MLP, "all": ATTN + MLP + MOD}


def _linear_rows(transformer: Any) -> Dict[str, int]:
    """{module path: out features} of the transformer's Linears (through peft's wrappers): the sizes of the stacked
    parts a LoRA file leaves zero (:func:`lora_keys.to_original`)."""
    return {name[: -len(".base_layer")] if name.endswith(".base_layer") else name: m.out_features
            for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


class HunyuanText:
    """The pipeline's four text tensors: Qwen features and mask, ByT5 glyph features and mask; ``.to()`` like a
    tensor (the masks keep their dtype). ``lengths``: each row's real Qwen and glyph tokens, on the host (``(qwen,
    glyph)`` lists), where the text cache's batch carries them; else None (the step reads the masks)."""

    def __init__(self, embeds, mask, embeds_2, mask_2, lengths: Optional[Tuple[List[int], List[int]]] = None):
        self.embeds, self.mask, self.embeds_2, self.mask_2 = embeds, mask, embeds_2, mask_2
        self.lengths = lengths

    def to(self, *args: Any, **kwargs: Any) -> "HunyuanText":
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        move = (lambda m: m) if device is None else (lambda m: m.to(device))
        return HunyuanText(self.embeds.to(*args, **kwargs), move(self.mask), self.embeds_2.to(*args, **kwargs),
                           move(self.mask_2), self.lengths)


def _host_lengths(batch: Dict[str, Any]) -> Optional[Tuple[List[int], List[int]]]:
    """A cached batch's real Qwen and glyph tokens per row, counted on the host by the data pipeline; else None."""
    qwen, glyph = batch.get("prompt_lengths"), batch.get("glyph_lengths")
    return None if qwen is None or glyph is None else (list(qwen), list(glyph))


def _cut_padding(text: HunyuanText) -> Tuple[Any, Any, Any, Any]:
    """The Qwen and glyph features cut to the batch's longest real run of each (at least one token), as diffusion-pipe
    pads them: the pipeline pads to 1000 and 128 tokens, and every padded token ran through the token refiner, the
    text streams and the joint attention, where the masks then left it out, so the image tokens' prediction is the
    same (``tests/test_family_hunyuanimage.py``). A caption of 60 tokens at 1024 px (1024 image tokens) is about half
    the step's tokens of before. The real tokens come first in both (right padding). A cached batch says its rows'
    lengths on the host (``text.lengths``); captions encoded at the step are read once (the two masks' longest runs).
    On the VRAM estimate's fake tensors (no values) every token is kept."""
    if text.lengths is not None:
        longest, longest_2 = (max(max(n), 1) for n in text.lengths)
    elif is_fake(text.mask):
        return text.embeds, text.mask, text.embeds_2, text.mask_2
    else:
        longest, longest_2 = (max(int(n), 1) for n in torch.stack([text.mask.sum(1).max(), text.mask_2.sum(1).max()])
                              .tolist())
    return (text.embeds[:, :longest], text.mask[:, :longest], text.embeds_2[:, :longest_2],
            text.mask_2[:, :longest_2])


class _TextView:
    """What ``HunyuanImagePipeline.encode_prompt`` reads of its pipeline, without building one (the VRAM estimate's
    fake tensors cannot build a scheduler)."""

    encode_prompt = HunyuanImagePipeline.encode_prompt
    _get_qwen_prompt_embeds = HunyuanImagePipeline._get_qwen_prompt_embeds
    _get_byt5_prompt_embeds = HunyuanImagePipeline._get_byt5_prompt_embeds

    def __init__(self, model: "HunyuanImage", max_length: int):
        # the language model without its head: the same hidden states, without logits over 152k tokens for each of
        # the 1034 positions (GiBs at encode time)
        self.tokenizer, self.text_encoder = model.tokenizer, model.text_encoder.model
        self.tokenizer_2, self.text_encoder_2 = model.tokenizer_2, model.text_encoder_2
        self._execution_device = model.device
        self.tokenizer_max_length, self.tokenizer_2_max_length = max_length, 128
        self.prompt_template_encode = model.template
        self.prompt_template_encode_start_idx = DROP


class HunyuanImageSampler(HunyuanImagePipeline):
    """``HunyuanImagePipeline`` taking ``guidance_scale`` (what Atelier's samples pass): its guiders' scale, the
    pipeline's own call otherwise. The value also goes in as ``distilled_guidance_scale``, the pipeline's one guidance
    argument, which a base model (no guidance embedding) does not read."""

    def __call__(self, *args: Any, guidance_scale: Optional[float] = None, **kwargs: Any):
        if guidance_scale is not None:
            if self.guider is not None:
                self.guider = self.guider.new(guidance_scale=float(guidance_scale))
            if self.ocr_guider is not None:  # what a caption quoting text samples with, where the model has one
                self.ocr_guider = self.ocr_guider.new(guidance_scale=float(guidance_scale))
            kwargs.setdefault("distilled_guidance_scale", float(guidance_scale))
        return super().__call__(*args, **kwargs)


def checkpointed(module: Any, *args: Any, **kwargs: Any) -> Any:
    """Gradient checkpointing that passes keyword arguments on (the default of :func:`enable_checkpointing`; the
    trainer passes its own, ``trainer.memory.checkpointing.checkpointed``, which does the same)."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


def enable_checkpointing(transformer: Any, gradient_checkpointing_func: Any = checkpointed) -> None:
    """``HunyuanImageTransformer2DModel`` calls its blocks' checkpointing with ``attention_mask=`` and
    ``image_rotary_emb=``, which diffusers 0.42.1's default function (positional arguments only) refuses: the
    trainer's passes them on."""
    type(transformer).enable_gradient_checkpointing(transformer, gradient_checkpointing_func)


class HunyuanImage(PeftLayoutLora, Family):
    name = "hunyuanimage"
    family = "hunyuan-image"
    prediction_type = "flow"
    # the embedders and the output norm stay in bf16 (the blocks' big modulation Linears, norm1.linear and
    # norm.linear, do not: a substring "norm" would keep 4.5B parameters out of fp8)
    fp8_skip = ("x_embedder", "context_embedder", "time_guidance_embed", "norm_out")
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")
    targets = TARGETS
    modelspec = ("hunyuan-image-2.1", "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1", "hunyuan-image-2.1")
    _empty: Optional[Dict[str, Any]] = None  # the empty caption's cached entry (host tensors)

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        self.family = detect_source_family(self.source, mcfg) or "hunyuan-image"
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder",
                                      text_encoder_2="text_encoder_2")
        if self.source.kind == "single_file":
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=HunyuanImagePipeline,
                                                  transformer_cls=HunyuanImageTransformer2DModel,
                                                  config=config_from_original, to_diffusers=original_to_diffusers,
                                                  official=OFFICIAL, layout="Tencent's original layout")
        else:
            pipe = sources.load_pipeline(HunyuanImagePipeline, self.source, mcfg, workspace, family=self.family,
                                         dtype=dtypes)
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.transformer.enable_gradient_checkpointing = partial(enable_checkpointing, self.transformer)
        join_texts(self.transformer)  # the step's two text streams joined without reading the masks back
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self.text_encoder_2, self.tokenizer_2 = pipe.text_encoder_2, pipe.tokenizer_2
        self.guider, self.ocr_guider = pipe.guider, pipe.ocr_guider
        self.template = pipe.prompt_template_encode
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        self.objective = flow_objective_for(self._sched_config, patch=1)
        # the pipeline's 1000 tokens after the template's 34 (a tokenizer that takes fewer: the tiny model's)
        self.max_sequence_length = min(MAX_TOKENS, int(self.tokenizer.model_max_length) - DROP)
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "text_encoder_2", "vae"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: HunyuanImage 2.1 runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str]) -> HunyuanText:
        view = _TextView(self, self.max_sequence_length)
        with torch.no_grad():
            e, m, e2, m2 = view.encode_prompt(list(captions), device=self.device, batch_size=len(captions))
        return HunyuanText(e, m.bool(), e2, m2.bool())

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        """The four text tensors on the CPU, encoded a few captions at a time: every caption is 1034 tokens through a
        7B model, whose activations for 16 at once are ~6 GiB."""
        parts = [self._encode(list(captions[i:i + ENCODE_BATCH])) for i in range(0, len(captions), ENCODE_BATCH)]
        text = HunyuanText(*(torch.cat([getattr(t, k) for t in parts])
                             for k in ("embeds", "mask", "embeds_2", "mask_2")))
        # only as long as the longest real run of each: the step cuts the rest off anyway (14 kB a Qwen token in fp32)
        embeds, mask, embeds_2, mask_2 = _cut_padding(text)
        return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu(),
                "glyph_embeds": embeds_2.float().cpu(), "glyph_mask": mask_2.float().cpu()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if batch.get("prompt_embeds") is not None:
            d = self.device
            text = HunyuanText(batch["prompt_embeds"].to(d), batch["prompt_mask"].to(d).bool(),
                               batch["glyph_embeds"].to(d), batch["glyph_mask"].to(d).bool(), _host_lengths(batch))
        else:
            text = self._encode(list(expand(batch["captions"])))
        for flags, which in ((drop_te1, 0), (drop_te2, 1)):
            if flags is None or not any(flags):
                continue
            lengths = text.lengths
            if which == 0:  # the empty caption's Qwen features (cut to its tokens, as cached features are)
                if self._empty is None:
                    self._empty = self.encode_captions([""])
                text.embeds, text.mask = rows_replaced(flags, text.embeds, text.mask, self._empty["prompt_embeds"],
                                                       self._empty["prompt_mask"], owner=self)
                new = (prefix_lengths(self._empty["prompt_mask"]) or [None])[0]  # counted on the host
            else:  # no quoted text: the pipeline's zeros and empty mask
                on = flags_on(flags, text.embeds.device)
                text.embeds_2 = torch.where(on[:, None, None], torch.zeros_like(text.embeds_2), text.embeds_2)
                text.mask_2 = text.mask_2 & ~on[:, None]
                new = 0
            if lengths is not None and new is not None and len(lengths[which]) == len(flags):
                rows = [new if dropped else n for n, dropped in zip(lengths[which], flags)]
                text.lengths = (rows, lengths[1]) if which == 0 else (lengths[0], rows)
            else:
                text.lengths = None
        return text

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        dtype, device = model_input.dtype, model_input.device
        embeds, mask, embeds_2, mask_2 = _cut_padding(conditioning.to(device))
        # the two streams joined as diffusers' forward joins them, without its boolean indexes (joined_text.py)
        text, text_mask = join(embeds.to(dtype), mask, embeds_2.to(dtype), mask_2)
        # t = 1000·σ in fp32 (the pipeline passes the scheduler's timestep in the latents' dtype)
        return self.transformer(hidden_states=model_input, timestep=timesteps.to(device, torch.float32) * 1000.0,
                                encoder_hidden_states=text, encoder_attention_mask=text_mask, return_dict=False)[0]

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        pipe = HunyuanImageSampler(scheduler=self._sched_class.from_config(self._sched_config), vae=self.vae,
                                   text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                   text_encoder_2=self.text_encoder_2, tokenizer_2=self.tokenizer_2,
                                   transformer=self.transformer, guider=self.guider, ocr_guider=self.ocr_guider)
        pipe.tokenizer_max_length = self.max_sequence_length
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def text_fingerprint(self, mcfg: Any) -> str:
        return (f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{part_dtype(mcfg, 'text_encoder_2')}:"
                f"{self.max_sequence_length}:hunyuan-image-template")

    # --- LoRA files ---------------------------------------------------------------------------
    def peft_file_names(self):
        """The model tools' names of the transformer's Linears in a LoRA file: ``diffusion_model.<original>`` (the
        stacked q/k/v and ``linear1`` as one layer); the text stream's stacked ``txt_attn_qkv`` is left out, as its
        Linears are not in stacking order in the module tree."""
        return {"unet": ("diffusion_model", _tool_name)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        """The transformer's LoRA in the original layout (α/r baked into ``lora_B``; stacked Linears block-diagonal)."""
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return lora_keys.to_original(out, out_features=_linear_rows(modules["unet"]))

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any],
                             adapter_name: str = "default") -> int:
        """An original-layout file into fresh peft layers (a diffusers-layout file as :class:`PeftLayoutLora` reads
        it)."""
        if not any(k.startswith(lora_keys.PREFIX) for k in state):
            return super().load_lora_state_dict(state, modules, adapter_name)
        shapes = {path: (layer.r[adapter_name], layer.base_layer.out_features)
                  for path, layer in lora_layers(modules["unet"], adapter_name)}
        tensors, used = lora_keys.from_original(state, shapes, out_features=_linear_rows(modules["unet"]))
        loaded = load_peft_layout(tensors, {"unet": modules["unet"]}, {"unet": "transformer"}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(loaded) // 2

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as Tencent's original single file (keys.py): what ComfyUI's diffusion-model
        loader reads, and model.path here."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)


def _tool_name(path: str) -> str:
    if ".attn.add_" in path:
        raise KeyError(path)
    return original_module(path)[0]


def load_lora_into_pipeline(pipe: Any, path: Any) -> None:
    """A LoRA file of this family into a ``HunyuanImagePipeline``'s transformer as diffusers loads adapters: the
    pipeline has no ``load_lora_weights``, the transformer's ``load_lora_adapter`` reads the diffusers layout
    (:func:`lora_keys.to_diffusers` of the original-layout file)."""
    rows = {n: m.out_features for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    pipe.transformer.load_lora_adapter(lora_keys.to_diffusers(load_file(str(path)), rows), prefix="transformer")
