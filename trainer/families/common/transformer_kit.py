"""What the transformer families whose text encoders stay frozen share (Chroma, Z-Image, Qwen-Image, Flux.2):
LoRA files in the diffusers/peft layout (``transformer.<module>.lora_A/lora_B``, α/r baked into lora_B; LoHa/LoKr
as ``lycoris_<module>``), their metadata, loading the transformer from one file with the rest of the pipeline from
``model.config_path``, and writing a fine-tuned transformer back as one file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import is_fake

from trainer.data.text_rows import prefix_lengths
from trainer.errors import ModelLoadError
from trainer.families.common.fp8_weights import dequantise_fp8, fp8_layer_scales
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict, target_regex
from trainer.families.sources import hub_offline, load_by_component
from trainer.formats.checkpoint import cast_state_dict, write_checkpoint
from trainer.formats.metadata import modelspec_common


class MaskedText:
    """A text model's features [B, L, D] padded, with the mask of its real tokens [B, L] (bool); ``.to()`` like a
    tensor (the mask keeps its dtype). ``lengths``: each row's number of real tokens, on the host, where every row's
    real tokens come first (the text cache's batches carry them: ``prompt_lengths``); else None."""

    def __init__(self, prompt_embeds, prompt_mask, lengths: Optional[List[int]] = None):
        self.prompt_embeds, self.prompt_mask, self.lengths = prompt_embeds, prompt_mask, lengths

    def to(self, *args: Any, **kwargs: Any) -> "MaskedText":
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        return MaskedText(self.prompt_embeds.to(*args, **kwargs),
                          self.prompt_mask if device is None else self.prompt_mask.to(device), self.lengths)


def longest_caption(conditioning: MaskedText, device: Any, dtype: Any) -> Tuple[Any, Any]:
    """Masked text features cut to the batch's longest caption, and no mask when every row fills it: what
    ``QwenImagePipeline._get_qwen_prompt_embeds`` pads to and its ``encode_prompt`` hands the transformer, where the
    cache keeps ``max_sequence_length`` tokens, mostly padding (every padded token went through each block's text
    stream and joint attention, and the mask left it out). The real tokens come first; their lengths come from the
    host when the captions were cached (no device read). On the VRAM estimate's fake tensors (no values) every token
    is kept, with the mask."""
    mask = conditioning.prompt_mask.to(device)
    embeds = conditioning.prompt_embeds
    if is_fake(mask):
        return embeds.to(device, dtype), mask
    lengths = conditioning.lengths or mask.sum(dim=1).tolist()
    longest = max(max(int(n) for n in lengths), 1)
    embeds = embeds[:, :longest].to(device, dtype)
    return embeds, None if all(int(n) == longest for n in lengths) else mask[:, :longest]


def real_tokens_first(embeds: Any, mask: Any) -> Tuple[Any, Any]:
    """Each row's real tokens moved to the front, in their order, and the padding (zeroed) to the end: features
    [B, L, D] whose mask [B, L] is not a prefix (Krea 2 pads in the middle of its template) as features whose real
    tokens come first, so a step can cut the padding off (:func:`longest_caption`). Only for a transformer that gives
    text tokens no positions of their own; no device read (a stable sort of the mask)."""
    mask = mask.bool()
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    mask = torch.gather(mask, 1, order)
    embeds = torch.gather(embeds, 1, order[..., None].expand(-1, -1, embeds.shape[-1]))
    return embeds * mask[..., None].to(embeds.dtype), mask


def cut_to_longest(embeds: Any, mask: Any) -> Tuple[Any, Any]:
    """Features [B, L, D] whose real tokens come first, and their mask, cut after the longest row's real tokens (what
    a text cache keeps of a family whose step cuts its padding anyway: :func:`longest_caption`). On the VRAM
    estimate's fake tensors (no values) every token is kept."""
    if is_fake(mask):
        return embeds, mask
    longest = max(int(mask.sum(dim=1).max()), 1)
    return embeds[:, :longest], mask[:, :longest]


class ChannelNormalisedLatents:
    """Latents of the Wan-style VAEs (Wan, Qwen-Image, Krea 2, Qwen-Image 2.1), whose config holds per-channel
    ``latents_mean``/``latents_std``: a latent is drawn from the cached posterior and normalised per channel, as the
    pipelines' decode inverts it (images [B, C, h, w] and clips [B, C, F, h, w] alike)."""

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        mean, std = dist["mean"].to(self.device), dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype,  # on the generator's device
                          device=None if generator is None else generator.device).to(self.device)
        shift, scale = self._latent_norm(mean.dtype)
        view = (1, -1) + (1,) * (mean.ndim - 2)
        return (mean + std * eps - shift.view(view)) / scale.view(view)

    def _latent_norm(self, dtype):
        """The VAE config's per-channel ``latents_mean``/``latents_std`` on the device, made once per (device, dtype):
        a tensor made from Python numbers is a blocking host-to-device copy, here once instead of every step."""
        key = (str(self.device), dtype)
        made = self.__dict__.setdefault("_latent_norm_made", {})
        if key not in made:
            c = self.vae.config
            made[key] = (torch.tensor(c.latents_mean, dtype=dtype, device=self.device),
                         torch.tensor(c.latents_std, dtype=dtype, device=self.device))
        return made[key]


class MaskedTextConditioning:
    """Caption caching and conditioning of a family whose ``_encode(captions, grads)`` returns padded features and
    the bool mask of the real tokens (Z-Image, Qwen-Image); caption dropout gives the empty caption's."""

    _empty: Optional[Dict[str, Any]] = None
    # the step cuts the padding off (the real tokens first, the transformer never sees the rest): the cache keeps
    # only as many tokens as the longest caption encoded with an entry (:func:`cut_to_longest`)
    cache_cut = False

    def encode_captions(self, captions: List[str]) -> Dict[str, Any]:
        with torch.no_grad():
            embeds, mask = self._encode(list(captions))
            if self.cache_cut:
                embeds, mask = cut_to_longest(embeds, mask)
        return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.float().cpu()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        lengths = None
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
            mask = batch["prompt_mask"].to(self.device).bool()
            lengths = batch.get("prompt_lengths")
        else:
            embeds, mask = self._encode(list(expand(batch["captions"])), "text_encoder" in train_text)
        if drop_te1 is not None and any(drop_te1):
            if self._empty is None:
                self._empty = self.encode_captions([""])
            embeds, mask = rows_replaced(drop_te1, embeds, mask, self._empty["prompt_embeds"],
                                         self._empty["prompt_mask"], owner=self)
            empty = prefix_lengths(self._empty["prompt_mask"])
            lengths = None if lengths is None or empty is None else \
                [empty[0] if dropped else n for n, dropped in zip(lengths, drop_te1)]
        return MaskedText(embeds, mask, lengths)


def rows_replaced(flags: Any, embeds: Any, mask: Any, new: Any, new_mask: Any, owner: Any = None) -> Tuple[Any, Any]:
    """Features [B, L, D] and their mask [B, L] with the rows where ``flags`` is true taken from ``new``/``new_mask``
    ([1, L', D], caption dropout's empty caption): both zero-padded at the end to the longer first, since cached
    features are cut to their captions' length (:func:`cut_to_longest`). ``owner``: the family that keeps ``new``
    and ``new_mask`` on the host, which keeps their copies on the device too (:func:`host_copy.kept_on`)."""
    on = flags_on(flags, embeds.device)
    if owner is not None:
        new, new_mask = kept_on(owner, "empty", new, embeds), kept_on(owner, "empty_mask", new_mask, mask)
    new, new_mask = new.to(embeds), new_mask.to(device=mask.device, dtype=mask.dtype)
    longest = max(embeds.shape[1], new.shape[1])
    embeds, mask = pad_tokens(embeds, mask, longest)
    new, new_mask = pad_tokens(new, new_mask, longest)
    return torch.where(on[:, None, None], new, embeds), torch.where(on[:, None], new_mask, mask)


def pad_tokens(embeds: Any, mask: Any, length: int) -> Tuple[Any, Any]:
    """Features [B, L, D] and mask [B, L] zero-padded (not real tokens) at the end to ``length`` (cached features
    cut to their captions' length meet others, or the empty caption's, of another length)."""
    extra = length - embeds.shape[1]
    if extra <= 0:
        return embeds, mask
    return (torch.nn.functional.pad(embeds, (0, 0, 0, extra)), torch.nn.functional.pad(mask, (0, extra)))


class PeftLayoutLora:
    """LoRA methods of a family whose LoRA adapts the transformer alone. Class attributes: ``targets``
    (``parts.denoiser.lora_targets`` preset -> module-name endings, '*' for one path part) and ``modelspec``
    (architecture, implementation URL, ``ss_base_model_version``)."""

    targets: Dict[str, List[str]] = {}
    modelspec = ("", "", "")

    def lora_targets(self, slot: str, preset: str):
        return target_regex(self.targets[preset])

    def lora_namer(self):
        """LyCORIS (LoHa/LoKr) names: ``lycoris_<diffusers module path>``."""
        return {"unet": ("lycoris", lambda p: p)}

    def peft_file_names(self):
        return {"unet": ("transformer", lambda p: p)}

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        out = peft_layout_state_dict(modules, {"unet": "transformer"}, adapter_name)
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return out

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any], adapter_name: str = "default") -> int:
        used = load_peft_layout(state, modules, {"unet": "transformer"}, adapter_name)
        extra = sorted(set(state) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        architecture, implementation, version = self.modelspec
        meta = modelspec_common(title=title, resolution=resolution)
        meta.update({"modelspec.architecture": f"{architecture}/lora", "modelspec.prediction_type": "flow",
                     "modelspec.implementation": implementation, "ss_base_model_version": version})
        meta.update(extra or {})
        return meta


def pipeline_with_transformer_file(family: Any, mcfg: Any, dtypes: Dict[str, Any], *, pipeline_cls: Any,
                                   transformer_cls: Any, config: Callable[[Dict[str, Any], dict], dict],
                                   to_diffusers: Callable[[Dict[str, Any]], Dict[str, Any]] = dict,
                                   official: str, layout: str, by_component: bool = False,
                                   component: str = "transformer", **components: Any) -> Any:
    """``model.path`` is the transformer alone (``layout`` names its key layout in messages): build it from the
    file (``config(state, base)`` with ``base`` the ``transformer/config.json`` of a local ``model.config_path``),
    load its weights strictly (``to_diffusers``: the file's keys → diffusers'), and the rest of the pipeline from
    ``model.config_path`` (default ``official``; ``by_component``: one component at a time, not through
    ``from_pretrained``: see :func:`trainer.families.sources.load_by_component`). ``component``: the pipeline
    component the file is (``transformer_2``: Wan 2.2 A14B's low-noise expert). ``components``: pipeline components
    given instead of loaded (None: left out)."""

    source = family.source
    rest = getattr(mcfg, "config_path", "") or official
    try:
        state = {k.split("model.diffusion_model.", 1)[-1]: v for k, v in load_file(source.location).items()}
    except Exception as exc:
        raise ModelLoadError(f"model.path '{source.display}' could not be read as a .safetensors file: {exc}",
                             key="model.path", value=source.display) from None
    scales = fp8_layer_scales(state, to_diffusers)  # an fp8 release: which layers, with which scales
    state = dequantise_fp8(state, dtypes["transformer"], source.display)  # floats to build the model from
    local = Path(rest) / component / "config.json"
    base = json.loads(local.read_text()) if local.is_file() else {}
    try:
        transformer = transformer_cls.from_config(config(state, base))
        weights = to_diffusers(state)
        for name, tensor in transformer.state_dict().items():  # learned pads some files leave out: the model's own
            if name.endswith("pad_token"):
                weights.setdefault(name, tensor)
        transformer.load_state_dict(weights, strict=True)
    except Exception as exc:
        raise ModelLoadError(f"model.path '{source.display}': not a complete {family.info.label} transformer in "
                             f"{layout} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                             key="model.path", value=source.display) from None
    if transformer.dtype != dtypes["transformer"]:
        transformer.to(dtypes["transformer"])
    if scales:  # stored back in fp8 with these scales once the adapters exist (memory/precision.py apply_storage)
        transformer.fp8_file_scales = scales
    kw: Dict[str, Any] = {"dtype": {k: v for k, v in dtypes.items() if k != "transformer"}}
    if not Path(rest).is_dir():
        kw.update(cache_dir=getattr(mcfg, "cache_dir", "") or None, revision=getattr(mcfg, "revision", "") or None)
    try:
        if by_component:
            return load_by_component(pipeline_cls, rest, mcfg, kw["dtype"], skip=(component, *components),
                                     **{component: transformer}, **components)
        return pipeline_cls.from_pretrained(rest, **{component: transformer},
                                            local_files_only=Path(rest).is_dir() or hub_offline(mcfg), **components,
                                            **kw)
    except Exception as exc:
        raise ModelLoadError(
            f"model.path '{source.display}' is the {family.info.label} transformer alone; the rest of the model comes "
            f"from model.config_path ('{rest}'), which could not be loaded ({type(exc).__name__}). Set "
            f"model.config_path to a diffusers {family.info.label} folder (or the hub id {official}, downloaded once "
            "with network access).", key="model.config_path", value=rest) from None


def save_transformer_file(path: Any, state: Dict[str, Any], dtype: str, metadata: Optional[Dict[str, str]]) -> None:
    """A fine-tuned transformer's tensors (in the layout the caller chose) as one file, in ``dtype``."""
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    write_checkpoint(Path(path), cast_state_dict(state, dtype), metadata or {})
