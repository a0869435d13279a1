"""What Stable Cascade (Würstchen 3) and Würstchen 2 share: a text-conditional prior that denoises
EfficientNet image embeddings, and decoder stages that turn the prior's output into pictures.

- Latents: the EfficientNet encoder the prior was trained against (``trainer.families.common.effnet``),
  images resized to ¾ of the training size (1024 px → 768 px → 24×24×16), cached like VAE latents.
  The encoder is not part of the diffusers repos: ``model.effnet_path``, else ``effnet_encoder.safetensors``
  in the model folder, else (Cascade) the official file from the hub.
- Objective: :class:`trainer.objectives.CosineObjective` (continuous t, their cosine schedule, ε, P2 weight).
- Loading: each component from its own subfolder with its class named here, not through diffusers'
  ``from_pretrained`` of the pipeline: the model_index.json of every Cascade/Würstchen repo names
  ``PaellaVQModel``, which diffusers 0.36+ no longer exports at its top level, so the pipelines' own
  ``from_pretrained`` fails on them. Folders: a prior pipeline (``prior/``, ``text_encoder/``, ``tokenizer/``)
  or a combined pipeline as ``save_pretrained`` writes it (``prior_prior/``, ``prior_text_encoder/`` …, plus the
  decoder's ``decoder/``, ``vqgan/``, ``text_encoder/`` …).
- Samples: the combined pipeline (prior, then the decoder stages) over the live prior and text encoder, the
  decoder loaded on first use from ``model.decoder_path`` (default: the model folder when it holds one, else
  the official decoder), behind :class:`TwoStageSampler`, which takes the arguments every family's pipeline takes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import diffusers
import torch
import transformers
from diffusers import DDPMWuerstchenScheduler
from diffusers.pipelines.deprecated import wuerstchen
from huggingface_hub import hf_hub_download, snapshot_download

from trainer.errors import ModelLoadError
from trainer.families.base import Family, part_dtype
from trainer.families.common.effnet import effnet_preprocess, load_effnet
from trainer.families.common.host_copy import flags_on, kept_on
from trainer.families.sources import classify_source, detect_source_family, hub_kwargs, hub_offline
from trainer.objectives import CosineObjective

# the first folder name found wins: prior pipeline layout, combined pipeline layout
PRIOR_DIRS = {"prior": ("prior", "prior_prior"), "text_encoder": ("text_encoder", "prior_text_encoder"),
              "tokenizer": ("tokenizer", "prior_tokenizer")}


def _subdir(folder: Path, names: Tuple[str, ...]) -> Optional[Path]:
    return next((folder / n for n in names if (folder / n / ("config.json" if "token" not in n else
                                                              "tokenizer_config.json")).is_file()), None)


def given_prior_config(mcfg: Any) -> Optional[Path]:
    """The prior's config.json in the local folder ``model.config_path`` names (prior or combined layout), if any."""
    given = str(getattr(mcfg, "config_path", "") or "")
    if not given or not Path(given).is_dir():
        return None
    sub = _subdir(Path(given), PRIOR_DIRS["prior"])
    return None if sub is None else sub / "config.json"


def local_copy(location: str, mcfg: Any, patterns: List[str], what: str, key: str) -> Path:
    """A local folder for ``location``: the folder itself, or the snapshot of the hub repo's files that match
    ``patterns`` (downloaded on first use; from the cache when offline)."""
    p = Path(location).expanduser()
    if p.is_dir():
        return p

    try:
        return Path(snapshot_download(location, allow_patterns=patterns, local_files_only=hub_offline(mcfg),
                                      **hub_kwargs(mcfg)))
    except Exception as exc:
        offline = " (model.hub_offline is on and it is not in the hub cache)" if hub_offline(mcfg) else ""
        raise ModelLoadError(f"{key} '{location}': the {what} could not be read from the hub{offline}: "
                             f"{type(exc).__name__}. Download it once online, or point {key} at a local folder.",
                             key=key, value=location) from None


class TwoStageSampler:
    """The combined pipeline behind the arguments every Atelier family's pipeline takes: ``guidance_scale``
    and ``num_inference_steps`` drive the prior (the decoder runs its own few steps without guidance, as the
    combined pipelines default); sizes are rounded up to multiples of 128 px (the prior's latents times the
    decoder's 10.67 must give whole decoder patches: 64 px would give 21 rows); ``.prior_pipe`` and ``.pipe``
    reach diffusers' own objects."""

    def __init__(self, pipe: Any, decoder_steps: int):
        self.pipe, self.decoder_steps = pipe, decoder_steps

    @property
    def prior_pipe(self):
        return self.pipe.prior_pipe

    def __call__(self, prompt, num_inference_steps: int = 20, guidance_scale: float = 4.0, **kwargs: Any):
        for side in ("width", "height"):  # the decoder needs whole patches: sides in multiples of 128 px
            if side in kwargs:
                kwargs[side] = max(128, -(-int(kwargs[side]) // 128) * 128)
        kwargs.setdefault("num_inference_steps", self.decoder_steps)
        kwargs.setdefault("decoder_guidance_scale", 0.0)
        return self.pipe(prompt, prior_num_inference_steps=num_inference_steps, prior_guidance_scale=guidance_scale,
                         **kwargs)

    def save_pretrained(self, folder: Any, **kwargs: Any) -> None:
        """A fine-tune saved as a diffusers folder: the prior pipeline (what ``model.path`` loads)."""
        self.pipe.prior_pipe.save_pretrained(folder, **kwargs)


class CascadePrior(Family):
    """Base of the two prior families; subclasses set the class attributes and :meth:`_prior_inputs`."""

    prediction_type = "epsilon"
    prior_class: str = ""  # diffusers class of the prior
    text_class: str = ""  # transformers class of its text encoder
    pipelines: Dict[str, str] = {}  # "prior" / "decoder" / "combined" -> diffusers pipeline class name
    official: Dict[str, str] = {}  # "prior" / "decoder" -> hub id
    effnet_hub: Optional[Tuple[str, str]] = None  # (repo, file) of the official encoder, if on the hub
    effnet_hint: str = ""  # where users get the encoder
    latent_scale: Tuple[float, float] = (1.0, 0.0)  # prior latent = (effnet output + b) / a, as (a, b)
    decoder_steps: int = 10
    decoder_subfolder: str = "decoder"
    original_timestep_stretch: float = 1.0  # loss.cosine_timesteps = original: t·stretch + 0.001 (OneTrainer's)
    decoder_class: str = ""  # diffusers class of the decoder (stage B / Würstchen 2 stage B)

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        self.family = detect_source_family(self.source, mcfg) or self.info.choices[0]
        self._mcfg, self._workspace = mcfg, workspace
        self._dtypes = dtypes = self._storage_dtypes(mcfg, prior="unet", text_encoder="text_encoder")
        if self.source.kind == "single_file":
            self.prior, rest = self._prior_from_single_file(mcfg), None
            text_from = getattr(mcfg, "config_path", "") or self.official["prior"]
            self._text_folder = local_copy(text_from, mcfg, ["text_encoder/*", "tokenizer/*", "prior_text_encoder/*",
                                                             "prior_tokenizer/*", "model_index.json"],
                                           "text encoder and tokenizer", "model.config_path")
        else:
            rest = local_copy(self.source.location, mcfg, self._prior_patterns(mcfg), "prior", "model.path")
            self.prior = self._load_prior(rest, mcfg)
            self._text_folder = rest
        self.text_encoder, self.tokenizer = self._load_text(self._text_folder)
        # where an effnet_encoder.safetensors and a decoder may sit: the model folder, or for a single file the
        # folder its text encoder came from
        self._model_folder = rest if rest is not None else self._text_folder
        self.effnet = self._load_effnet(mcfg, self._model_folder)
        self.objective = CosineObjective(self.original_timestep_stretch)
        self.device = torch.device(device)
        dtypes["effnet"] = dtypes["vae"]
        self._place_frozen(dtypes, ("prior", "text_encoder", "effnet"))
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError(f"model.attention = xformers: {self.info.label} runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype
        self._decoder: Optional[Dict[str, Any]] = None
        self._empty: Optional[Dict[str, Any]] = None
        self._text_keys: Optional[List[str]] = None

    # --- loading ----------------------------------------------------------------------------
    def _prior_patterns(self, mcfg: Any) -> List[str]:
        return ["prior/*", "text_encoder/*", "tokenizer/*", "scheduler/*", "model_index.json"]

    def _prior_dir(self, folder: Path, mcfg: Any) -> Optional[Path]:
        return _subdir(folder, PRIOR_DIRS["prior"])

    def _load_prior(self, folder: Path, mcfg: Any):
        sub = self._prior_dir(folder, mcfg)
        if sub is None:
            raise ModelLoadError(f"model.path '{self.source.display}' has no prior folder ({', '.join(PRIOR_DIRS['prior'])}"
                                 f"/config.json). Point it at a {self.info.label} prior pipeline folder or hub id "
                                 f"(e.g. {self.official['prior']}), or at a prior .safetensors file.",
                                 key="model.path", value=self.source.display)
        cls = getattr(diffusers, self.prior_class, None) or wuerstchen_class(self.prior_class)
        try:
            return cls.from_pretrained(str(sub), dtype=self._dtypes["prior"])
        except Exception as exc:
            raise ModelLoadError(f"model.path '{self.source.display}': the prior in {sub.name}/ could not be "
                                 f"loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}).",
                                 key="model.path", value=self.source.display) from None

    def _load_text(self, folder: Path):
        te, tok = _subdir(folder, PRIOR_DIRS["text_encoder"]), _subdir(folder, PRIOR_DIRS["tokenizer"])
        key = "model.config_path" if self.source.kind == "single_file" else "model.path"
        if te is None or tok is None:
            raise ModelLoadError(f"{key} '{folder}': no text encoder and tokenizer folders (text_encoder/, tokenizer/). "
                                 f"Point it at a {self.info.label} prior pipeline folder or hub id "
                                 f"({self.official['prior']}).", key=key, value=str(folder))
        try:
            return (getattr(transformers, self.text_class).from_pretrained(str(te), dtype=self._dtypes["text_encoder"]),
                    transformers.CLIPTokenizer.from_pretrained(str(tok)))
        except Exception as exc:
            raise ModelLoadError(f"{key} '{folder}': its text encoder could not be loaded ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}).", key=key, value=str(folder)) from None

    def _prior_from_single_file(self, mcfg: Any):
        raise NotImplementedError

    def _load_effnet(self, mcfg: Any, folder: Optional[Path]):
        given = str(getattr(mcfg, "effnet_path", "") or "")
        if given:
            path = Path(given).expanduser()
            if not path.is_file():
                raise ModelLoadError(f"model.effnet_path '{given}' does not exist. {self.effnet_hint}",
                                     key="model.effnet_path", value=given)
        elif folder is not None and (folder / "effnet_encoder.safetensors").is_file():
            path = folder / "effnet_encoder.safetensors"
        elif self.effnet_hub is not None:
            path = self._hub_effnet(mcfg)
        else:
            raise ModelLoadError(f"model.effnet_path is empty: {self.info.label} trains on the image embeddings of "
                                 f"an EfficientNet encoder that its diffusers files do not include. "
                                 f"{self.effnet_hint}", key="model.effnet_path")
        try:
            return load_effnet(path)
        except ValueError as exc:
            raise ModelLoadError(f"model.effnet_path: {exc}. {self.effnet_hint}", key="model.effnet_path",
                                 value=str(path)) from None

    def _hub_effnet(self, mcfg: Any) -> Path:
        repo, name = self.effnet_hub
        try:
            return Path(hf_hub_download(repo, name, local_files_only=hub_offline(mcfg),
                                        cache_dir=hub_kwargs(mcfg)["cache_dir"]))
        except Exception as exc:
            raise ModelLoadError(f"model.effnet_path is empty and {name} could not be read from the hub repo {repo} "
                                 f"({type(exc).__name__}). {self.effnet_hint}", key="model.effnet_path") from None

    # --- latents ----------------------------------------------------------------------------
    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """EfficientNet embeddings of the images (deterministic: ``std`` is zero), on the CPU in fp32."""

        h, w = pixels.shape[-2:]
        if h % 128 or w % 128:
            raise ValueError(f"{self.info.label} trains at sizes that are multiples of 128 pixels (1024 px → 24×24 "
                             f"latents); this batch is {w}×{h}. Set data.resolution and data.bucket_step to "
                             "multiples of 128.")
        with torch.no_grad():
            x = effnet_preprocess(pixels.float()).to(self.device, dtype=self.effnet.dtype)
            mean = self.effnet(x).float().cpu()
        return {"mean": mean, "std": torch.zeros_like(mean)}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        a, b = self.latent_scale
        return (dist["mean"].to(self.device) + b) / a

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.source.kind}:{self.source.location}:{self._vae_dtype_name}".encode())
        for name, t in self.effnet.state_dict().items():  # the encoder decides the latents
            h.update(name.encode())
            h.update(t.float().sum().item().hex().encode())
        return h.hexdigest()[:16]

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions, grads: bool = False) -> Dict[str, Any]:
        raise NotImplementedError

    def encode_captions(self, captions) -> Dict[str, Any]:
        with torch.no_grad():
            return {k: v.float().cpu() for k, v in self._encode(captions).items()}

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        if self._text_keys is None:  # which cached features a batch carries: once, not an encoding every step
            self._text_keys = list(self.encode_captions([""])) if self._empty is None else list(self._empty)
        keys = self._text_keys
        if all(batch.get(k) is not None for k in keys):
            cond = {k: batch[k].to(self.device) for k in keys}
        else:
            cond = self._encode(expand(batch["captions"]), grads=bool({"text_encoder", "embedding"} & set(train_text)))
        if drop_te1 is not None and any(drop_te1):  # the empty caption: what the pipelines feed as unconditional
            if self._empty is None:
                self._empty = self.encode_captions([""])
            flags = flags_on(drop_te1, self.device)
            cond = {k: torch.where(flags.view(-1, *([1] * (v.ndim - 1))), kept_on(self, k, self._empty[k], v), v)
                    for k, v in cond.items()}
        return cond

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{getattr(mcfg, 'config_path', '')}:{part_dtype(mcfg, 'text_encoder')}:{self.name}"

    # --- sampling ---------------------------------------------------------------------------
    def _decoder_parts(self) -> Dict[str, Any]:
        """The decoder stages (decoder, vqgan, its text encoder, tokenizer, scheduler), loaded once."""
        if self._decoder is None:
            self._decoder = self._load_decoder()
        return self._decoder

    def _decoder_location(self) -> Tuple[str, str]:
        given = str(getattr(self._mcfg, "decoder_path", "") or "")
        if given:
            return given, "model.decoder_path"
        folder = self._model_folder
        if folder is not None and (folder / self.decoder_subfolder / "config.json").is_file() \
                and (folder / "vqgan" / "config.json").is_file():
            return str(folder), "model.path"
        return self.official["decoder"], "model.decoder_path"

    def _load_decoder(self) -> Dict[str, Any]:
        location, key = self._decoder_location()
        sub = self.decoder_subfolder
        folder = local_copy(location, self._mcfg, [f"{sub}/*", "vqgan/*", "text_encoder/*", "tokenizer/*",
                                                   "scheduler/*", "model_index.json"], "decoder", key)
        missing = [d for d in (sub, "vqgan", "text_encoder", "tokenizer") if not (folder / d).is_dir()]
        if missing:
            raise ModelLoadError(f"{key} '{location}': not a {self.info.label} decoder (no {', '.join(missing)} "
                                 f"folder). Set model.decoder_path to the decoder pipeline folder or hub id "
                                 f"({self.official['decoder']}).", key="model.decoder_path", value=location)
        decoder_cls = getattr(diffusers, self.decoder_class, None) or wuerstchen_class(self.decoder_class)
        dtype = next(self.prior.parameters()).dtype
        dtype = torch.float32 if dtype not in (torch.float16, torch.bfloat16, torch.float32) else dtype
        try:
            parts = {"decoder": decoder_cls.from_pretrained(str(folder / sub), dtype=dtype),
                     "vqgan": wuerstchen_class("PaellaVQModel").from_pretrained(str(folder / "vqgan")),
                     "text_encoder": getattr(transformers, self.text_class).from_pretrained(
                         str(folder / "text_encoder"), dtype=dtype),
                     "tokenizer": transformers.CLIPTokenizer.from_pretrained(str(folder / "tokenizer")),
                     "scheduler": DDPMWuerstchenScheduler()}
        except Exception as exc:
            raise ModelLoadError(f"{key} '{location}': the decoder could not be loaded ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}).", key="model.decoder_path",
                                 value=location) from None
        for m in (parts["decoder"], parts["vqgan"], parts["text_encoder"]):
            m.to(self.device).requires_grad_(False).eval()
        return parts

    def pipeline(self, sampler: Optional[str] = None):
        """Prior (the live, training modules) then decoder; ``sampler`` is not used: both stages sample with
        their own DDPM-Würstchen scheduler."""
        d = self._decoder_parts()
        cls = getattr(diffusers, self.pipelines["combined"])
        pipe = cls(tokenizer=d["tokenizer"], text_encoder=d["text_encoder"], decoder=d["decoder"],
                   scheduler=d["scheduler"], vqgan=d["vqgan"], prior_prior=self.prior,
                   prior_text_encoder=self.text_encoder, prior_tokenizer=self.tokenizer,
                   prior_scheduler=DDPMWuerstchenScheduler())
        pipe.set_progress_bar_config(disable=True)
        return TwoStageSampler(pipe, self.decoder_steps)

    # --- the denoiser -----------------------------------------------------------------------
    def predict(self, model_input, timesteps, conditioning):
        return self._run_prior(model_input, timesteps.to(model_input.dtype), conditioning)

    def _run_prior(self, x, r, cond):
        raise NotImplementedError

    targets: Dict[str, List[str]] = {}  # lora.unet_targets preset -> prior module-name endings

    def lora_targets(self, slot: str, preset: str):
        return list(self.targets[preset]) if slot == "unet" else list(CLIP_TARGETS)


CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def wuerstchen_class(name: str):
    """A class diffusers keeps under pipelines.deprecated.wuerstchen (Würstchen 2's prior and decoder, the VQGAN)."""
    return getattr(wuerstchen, name)


def tiny_clip(tokenizer: Any, projection: bool):
    """A 2-layer, 32-wide CLIP text encoder for the tiny built-in models (with the projection head Cascade's
    pooled conditioning reads, or without for Würstchen 2)."""
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, projection_dim=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return cls(config)


def fill_zero_weights(*modules: Any) -> None:
    """Give weights that start at zero (the priors' and decoders' output convs, some mappers) random values of a
    layer's usual scale (1/√fan-in), so a tiny random model's output depends on its input and its adapters, as a
    trained one's does (uses the caller's RNG)."""
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                if name.endswith("weight") and p.ndim > 1 and not p.any():
                    p.normal_(0.0, (p[0].numel()) ** -0.5)
