"""Wan 2.1 text-to-video and Wan 2.2 TI2V-5B on diffusers' ``WanPipeline`` classes: a DiT over 3-D patches of video
latents, cross-attending to UMT5 features.

What differs, and where it lives here:

- Latents are video: [B, C, F, H, W] from the causal 3-D VAE (8× in space, 4× in time after the first frame:
  F = (frames − 1)/4 + 1). An image batch [B, 3, H, W] is a one-frame clip; clip batches [B, 3, F, H, W] pass as
  they are. Latents are normalised per channel with the VAE config's ``latents_mean``/``latents_std``, as
  ``WanPipeline`` inverts them before decoding.
- Text: ``WanPipeline._get_t5_prompt_embeds``: the cleaned caption through UMT5 up to ``max_sequence_length`` (512)
  tokens, the real tokens' features kept and zeros after them (no mask reaches the transformer). The cache keeps
  those features with the mask; caption dropout gives the empty caption's.
- Flow matching, target ε − x, with the shift of the pipeline's scheduler config (``flow_shift`` of its UniPC
  scheduler: 3.0 in Wan-AI's diffusers folders); the transformer takes σ·1000 in fp32 (its sinusoidal embedding
  is computed in fp32, then cast to the time embedder's dtype).
- Files: LoRA in the original layout (``diffusion_model.blocks.N.self_attn.q.lora_A/lora_B.weight``, α/r baked into
  lora_B), which ComfyUI's Wan nodes and ``WanPipeline.load_lora_weights`` read; fine-tunes as the original single
  file (keys.py). Single files in: the transformer, with VAE, UMT5 and tokenizer from ``model.config_path`` (a
  diffusers Wan folder or hub id; default Wan-AI/Wan2.1-T2V-1.3B-Diffusers).
- Samples are videos (``WanPipeline`` at the training size, ``sampling.frames`` frames).
- Image-to-video (Wan 2.1 I2V 14B, Wan 2.2 I2V A14B: ``WanImageToVideoPipeline``): each window's first frame becomes
  the condition the pipeline builds from a start image (first_frame.py), computed once with the latents
  (``encode_first_frames``: the data pipeline caches it in its own entries beside the latents), concatenated to the
  noisy latents (``model_input``) and, for Wan 2.1, its CLIP features passed to the transformer (``predict``).
  Neither diffusers nor musubi-tuner drops the image condition (their unconditional pass keeps it), so no
  conditioning dropout here beyond the captions'. Samples start from ``sampling.prompts.N.image``.
- Wan 2.2 TI2V-5B (``wan22-ti2v-5b``): the 2.2 VAE (48 channels, 16× in space), the pipeline's ``expand_timesteps``:
  the transformer gets one timestep per latent token ([B, F'·H'/2·W'/2], all equal in text-to-video), as the
  pipeline passes them; 24 fps (its samples are written at that rate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from PIL import Image

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import Family, part_dtype
from trainer.families.common.peft_lora import load_peft_layout, peft_layout_state_dict
from trainer.families.common.transformer_kit import (
    ChannelNormalisedLatents,
    MaskedTextConditioning,
    PeftLayoutLora,
    pipeline_with_transformer_file,
    save_transformer_file,
)
from trainer.families.sources import classify_source, detect_source_family
from trainer.families.wan.experts import LOW_FILE_PREFIX, LOW_SUFFIX, TwoExperts, split_experts
from trainer.families.wan.first_frame import (
    ImageText,
    PromptFirst,
    condition_video,
    first_frame_mask,
    frames_as_images,
)
from trainer.families.wan.info import IMAGE_TO_VIDEO, T2V_14B
from trainer.families.wan.keys import (
    config_from_original,
    diffusers_to_original,
    module_to_original,
    original_to_diffusers,
)
from trainer.objectives import FlowMatchingObjective

# model.config_path's default for a single file of each variant
A14B = "wan22-t2v-a14b"
I2V_A14B = "wan22-i2v-a14b"
EXPERTS = (A14B, I2V_A14B)  # two experts split at the pipeline's boundary_ratio
OFFICIAL = {"wan21-t2v": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan22-ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            A14B: "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan21-i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            I2V_A14B: "Wan-AI/Wan2.2-I2V-A14B-Diffusers"}
MODELSPEC = {"wan21-t2v": ("wan-2.1-t2v", "https://github.com/Wan-Video/Wan2.1", "wan_2_1_t2v"),
             "wan22-ti2v-5b": ("wan-2.2-ti2v-5b", "https://github.com/Wan-Video/Wan2.2", "wan_2_2_ti2v_5b"),
             A14B: ("wan-2.2-t2v-a14b", "https://github.com/Wan-Video/Wan2.2", "wan_2_2_t2v_a14b"),
             "wan21-i2v": ("wan-2.1-i2v-14b", "https://github.com/Wan-Video/Wan2.1", "wan_2_1_i2v_14b"),
             I2V_A14B: ("wan-2.2-i2v-a14b", "https://github.com/Wan-Video/Wan2.2", "wan_2_2_i2v_a14b")}
MAX_TOKENS = 512  # WanPipeline's max_sequence_length
LORA_PREFIX = "diffusion_model"  # ComfyUI's key map for Wan (and diffusers' converter) read this prefix
LOW_MARK = "@low@"  # both A14B experts: marks the low expert's module paths on their way to LOW_FILE_PREFIX keys
ATTN = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
        "attn2.add_k_proj", "attn2.add_v_proj"]  # Wan 2.1 I2V's image key/value (k_img/v_img), as musubi-tuner's LoRA
FFN = ["ffn.net.0.proj", "ffn.net.2"]
TARGETS = {"attn": ATTN, "attn_mlp": ATTN + FFN,
           # the shared time/text embedders, the time projection and the output head too (diffusers' converter and
           # ComfyUI map them)
           "all": ATTN + FFN + ["condition_embedder.time_proj", "condition_embedder.time_embedder.linear_1",
                                "condition_embedder.time_embedder.linear_2",
                                "condition_embedder.text_embedder.linear_1",
                                "condition_embedder.text_embedder.linear_2", "proj_out"]}


def flow_shift_of(scheduler_config: Dict[str, Any]) -> float:
    """The shift a Wan pipeline samples with: ``flow_shift`` of its UniPC scheduler, ``shift`` of a flow-match Euler
    one."""
    return float(scheduler_config.get("flow_shift", scheduler_config.get("shift", 1.0)) or 1.0)


class OtherExpertOnDevice:
    """A Wan 2.2 A14B pipeline whose untrained expert waits in CPU RAM: on the device for the pipeline's call only.
    Anything else (``load_lora_weights`` …) reaches the pipeline."""

    def __init__(self, pipe: Any, other: Any, device: Any):
        self.pipe, self.other, self.device = pipe, other, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.other.to(self.device)
        try:
            return self.pipe(*args, **kwargs)
        finally:
            self.other.to("cpu")


class Wan(ChannelNormalisedLatents, MaskedTextConditioning, PeftLayoutLora, Family):
    name = "wan"
    family = "wan21-t2v"
    prediction_type = "flow"
    fp8_skip = ("norm", "patch_embedding", "condition_embedder", "proj_out", "scale_shift_table")
    swap_blocks = ("blocks",)
    targets = TARGETS
    modelspec = MODELSPEC["wan21-t2v"]
    expand_timesteps = False  # Wan 2.2 TI2V-5B: a timestep per latent token
    image_to_video = False  # the transformer takes a start frame's condition (first_frame.py)
    image_encoder: Any = None  # Wan 2.1 I2V: CLIP ViT-H/14

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu"):
        self.source = classify_source(mcfg.path, workspace)
        found = detect_source_family(self.source, mcfg)
        chosen = getattr(mcfg, "family", "auto")
        self.family = found or (chosen if chosen in OFFICIAL else "wan21-t2v")
        if chosen == A14B and found == "wan21-t2v" and self.source.kind == "single_file":
            self.family = A14B  # one expert's file has Wan 2.1 14B's keys: only model.family tells
        self.modelspec = MODELSPEC[self.family]
        self.fps = self.info.video_for(self.family).fps
        self.expert = str(getattr(mcfg, "wan_expert", "low")) if self.family in EXPERTS else ""
        self.image_to_video = self.family in IMAGE_TO_VIDEO
        pipeline_cls = WanImageToVideoPipeline if self.image_to_video else WanPipeline
        dtypes = self._storage_dtypes(mcfg, transformer="unet", text_encoder="text_encoder")
        if self.image_to_video:  # Wan 2.1 I2V's CLIP: frozen, in the text encoder's dtype
            dtypes["image_encoder"] = dtypes["text_encoder"]
        if self.source.kind == "single_file":  # an A14B expert's file: the one model.wan_expert trains
            pipe = pipeline_with_transformer_file(self, mcfg, dtypes, pipeline_cls=pipeline_cls,
                                                  transformer_cls=WanTransformer3DModel, config=config_from_original,
                                                  to_diffusers=original_to_diffusers, official=OFFICIAL[self.family],
                                                  layout="the original Wan layout",
                                                  component="transformer_2" if self.expert == "low" else "transformer")
        else:
            # family: which full-size configs the VRAM estimate builds for a hub id (the 14B's where it names 14B)
            sized = T2V_14B if self.family == "wan21-t2v" and self.source.kind == "hub" \
                and "14b" in str(self.source.location).lower() else self.family
            pipe = sources.load_pipeline(pipeline_cls, self.source, mcfg, workspace, family=sized, dtype=dtypes)
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        self.boundary_ratio = pipe.config.get("boundary_ratio")
        self.other = None  # A14B: the expert that does not train (samples need it), kept in CPU RAM
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.image_encoder = getattr(pipe, "image_encoder", None)
        self.image_processor = getattr(pipe, "image_processor", None)
        if self.family == "wan21-i2v" and (self.image_encoder is None or self.image_processor is None):
            raise ModelLoadError(f"model.path '{self.source.display}': Wan 2.1 I2V needs its CLIP image encoder "
                                 "(image_encoder/ and image_processor/ of a WanImageToVideoPipeline folder); point "
                                 "model.path (or model.config_path, for a single file) at its diffusers folder.",
                                 key="model.path", value=self.source.display)
        if self.family in EXPERTS:
            if self.boundary_ratio is None or getattr(pipe, "transformer_2", None) is None:
                raise ModelLoadError(f"model.path '{self.source.display}': a Wan 2.2 A14B model needs both experts "
                                     "(transformer/ and transformer_2/) and the pipeline's boundary_ratio; point "
                                     "model.path (or model.config_path, for one expert's file) at its diffusers "
                                     "folder.", key="model.path", value=self.source.display)
            high, low = pipe.transformer, pipe.transformer_2
            if self.expert == "both":  # one module: each sample goes to the expert of its timestep
                self.transformer = TwoExperts(high, low, float(self.boundary_ratio) * 1000.0)
            else:
                self.transformer, self.other = (high, low) if self.expert == "high" else (low, high)
        self.text_encoder, self.tokenizer = pipe.text_encoder, pipe.tokenizer
        self._sched_config = dict(pipe.scheduler.config)
        self._sched_class = type(pipe.scheduler)
        boundary = float(self.boundary_ratio) if self.family in EXPERTS and self.expert != "both" else None
        # an A14B expert trains on its own σ range, split where the pipeline switches experts (t ≥ boundary·1000:
        # the high-noise one), as musubi-tuner's --timestep_boundary; the shape of the distribution is kept
        self.objective = FlowMatchingObjective(
            shift=flow_shift_of(self._sched_config),
            sigma_range=None if boundary is None else ((boundary, 1.0) if self.expert == "high" else (0.0, boundary)))
        self.max_sequence_length = min(int(getattr(mcfg, "t5_max_length", 0) or MAX_TOKENS),
                                       int(self.tokenizer.model_max_length))
        self.device = torch.device(device)
        self._place_frozen(dtypes, ("transformer", "text_encoder", "vae")
                           + (("image_encoder",) if self.image_encoder is not None else ()))
        if self.other is not None:  # frozen, in the trained expert's storage dtype, on the CPU until a sample
            self.other.requires_grad_(False).eval().to("cpu", dtype=dtypes["transformer"])
        if getattr(mcfg, "attention", "sdpa") == "xformers":
            raise ModelLoadError("model.attention = xformers: Wan runs on PyTorch SDPA. Use sdpa.",
                                 key="model.attention")
        self._vae_dtype_name = mcfg.vae_dtype

    # --- latents ----------------------------------------------------------------------------
    @property
    def temporal_factor(self) -> int:
        return int(getattr(self.vae.config, "scale_factor_temporal", 4) or 4)

    def latent_shape(self, width: int, height: int, frames: int = 1) -> Tuple[int, ...]:
        """[C, F', H/8, W/8] of a ``frames``-frame clip (one frame: an image), without running the VAE."""
        spatial = int(getattr(self.vae.config, "scale_factor_spatial", 8) or 8)
        return (int(self.vae.config.z_dim), (int(frames) - 1) // self.temporal_factor + 1, height // spatial,
                width // spatial)

    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """Images [B, 3, H, W] (one-frame clips) or clips [B, 3, F, H, W] through the VAE: the posterior's mean and
        std [B, C, F', h, w] on the CPU in fp32."""
        clip = pixels if pixels.ndim == 5 else pixels.unsqueeze(2)
        with torch.no_grad():
            dist = self.vae.encode(clip.to(self.device, dtype=self.vae.dtype)).latent_dist
        return {"mean": dist.mean.float().cpu(), "std": dist.std.float().cpu()}

    def encode_first_frames(self, pixels) -> Dict[str, Any]:
        """Image-to-video: what each clip's first frame conditions (first_frame.py), for the data cache: the
        condition latents [B, 16, F', h, w] (normalised), and for Wan 2.1 the CLIP image features [B, N, D]; on the
        CPU in fp32."""
        clip = pixels if pixels.ndim == 5 else pixels.unsqueeze(2)
        with torch.no_grad():
            dist = self.vae.encode(condition_video(clip).to(self.device, dtype=self.vae.dtype)).latent_dist
            mean = dist.mean.float()
            c = self.vae.config
            view = (1, -1, 1, 1, 1)
            shift = torch.tensor(c.latents_mean, dtype=mean.dtype, device=mean.device).view(view)
            scale = 1.0 / torch.tensor(c.latents_std, dtype=mean.dtype, device=mean.device).view(view)
            out = {"latents": ((mean - shift) * scale).cpu()}
            if self.image_encoder is not None:  # WanImageToVideoPipeline.encode_image
                inputs = self.image_processor(images=frames_as_images(clip[:, :, 0]), return_tensors="pt")
                pixel_values = inputs["pixel_values"].to(self.device, dtype=self.image_encoder.dtype)
                hidden = self.image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]
                out["image_embeds"] = hidden.float().cpu()
        return out

    # --- text -------------------------------------------------------------------------------
    def _encode(self, captions: List[str], grads: bool = False):
        """As ``WanPipeline._get_t5_prompt_embeds``: (features [B, L, D] zero after the real tokens, their mask)."""
        tokens = self.tokenizer([prompt_clean(str(c)) for c in captions], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
            hidden = self.text_encoder(tokens.input_ids.to(self.device), mask).last_hidden_state
        keep = mask.gt(0)
        return hidden * keep.unsqueeze(-1).to(hidden.dtype), keep

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        """The text conditioning; Wan 2.1 I2V adds the start frames' CLIP features (never dropped: the pipelines'
        unconditional pass keeps them too)."""
        text = super().batch_condition(batch, expand, train_text, drop_te1, drop_te2)
        if self.image_encoder is None:
            return text
        embeds = self._first_frame(batch)["image_embeds"].to(self.device)
        return ImageText(text.prompt_embeds, text.prompt_mask, embeds)

    def _first_frame(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        first = batch.get("first_frame")
        if first is None:
            raise ValueError("an image-to-video Wan model trains on batches with their first frames' condition "
                             "(batch['first_frame']: DataPipeline.prepare(first_frame_fn=encode_first_frames))")
        return first

    # --- the denoiser -------------------------------------------------------------------------
    def model_input(self, noisy_latents, batch: Dict[str, Any], generator=None, warn=None):
        """Image-to-video: noisy latents ‖ mask ‖ first-frame latents (36 channels), as the pipeline's each step."""
        if not self.image_to_video:
            return noisy_latents
        video = noisy_latents if noisy_latents.ndim == 5 else noisy_latents.unsqueeze(2)
        condition = self._first_frame(batch)["latents"].to(video.device, video.dtype)
        mask = first_frame_mask(condition, self.temporal_factor)
        return torch.cat([video, mask, condition], dim=1)

    def predict(self, model_input, timesteps, conditioning):
        dtype, device = model_input.dtype, model_input.device
        video = model_input if model_input.ndim == 5 else model_input.unsqueeze(2)
        embeds = conditioning.prompt_embeds.to(device, dtype)
        embeds = embeds * conditioning.prompt_mask.to(device).unsqueeze(-1).to(dtype)  # zeros after the tokens
        # σ·1000 in fp32, as the pipeline's scheduler timesteps (the transformer embeds it in fp32)
        t = timesteps.to(device, torch.float32) * 1000.0
        if self.expand_timesteps:  # TI2V-5B: one per latent token, as WanPipeline's expand_timesteps builds them
            p_t, p_h, p_w = self.transformer.config.patch_size
            tokens = (video.shape[2] // p_t) * (video.shape[3] // p_h) * (video.shape[4] // p_w)
            t = t.view(-1, 1).expand(-1, tokens)
        extra = {}
        if getattr(conditioning, "image_embeds", None) is not None:  # Wan 2.1 I2V: the start frame's CLIP features
            extra["encoder_hidden_states_image"] = conditioning.image_embeds.to(device, dtype)
        out = self.transformer(hidden_states=video, timestep=t, encoder_hidden_states=embeds, return_dict=False,
                               **extra)[0]
        return out if model_input.ndim == 5 else out.squeeze(2)

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        experts: Dict[str, Any] = {"transformer": self.transformer}
        if isinstance(self.transformer, TwoExperts):
            experts = {"transformer": self.transformer.high, "transformer_2": self.transformer.low,
                       "boundary_ratio": self.boundary_ratio}
        elif self.other is not None:  # A14B: the high-noise expert is the pipeline's transformer
            high, low = (self.transformer, self.other) if self.expert == "high" else (self.other, self.transformer)
            experts = {"transformer": high, "transformer_2": low, "boundary_ratio": self.boundary_ratio}
        if self.image_to_video:
            experts.update(image_encoder=self.image_encoder, image_processor=self.image_processor)
        pipeline_cls = WanImageToVideoPipeline if self.image_to_video else WanPipeline
        pipe = pipeline_cls(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae,
                            scheduler=self._sched_class.from_config(self._sched_config),
                            expand_timesteps=self.expand_timesteps, **experts)
        pipe.set_progress_bar_config(disable=True)
        if self.image_to_video:
            pipe = PromptFirst(pipe, lambda texts: self._encode(texts)[0])
        return pipe if self.other is None else OtherExpertOnDevice(pipe, self.other, self.device)

    def sampling_modules(self) -> List[Any]:
        """What a sample brings to the device besides the parts and the VAE (the VRAM estimate counts it): Wan 2.2
        A14B's untrained expert, on the device for the pipeline's call (:class:`OtherExpertOnDevice`)."""
        return [] if self.other is None else [self.other]

    def sampling_kwargs(self) -> Dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Image-to-video: the prompt's start image (``image``; validate refuses a prompt without one)."""
        if not self.image_to_video:
            return {}
        path = str(getattr(sample_prompt, "image", "") or "")
        if not path:
            raise ValueError(f"{self.family} samples start from an image: start image required "
                             "(sampling.prompts.N.image)")
        with Image.open(path) as img:
            return {"image": img.convert("RGB")}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.max_sequence_length}:umt5-zero-padded"

    # --- LoRA files: the original layout ------------------------------------------------------
    def lora_namer(self):
        return {"unet": ("lycoris", module_to_original)}

    def peft_file_names(self):
        return {"unet": (LORA_PREFIX, module_to_original)}

    @staticmethod
    def _expert_path(path: str) -> str:
        """A module path of the trained transformer as a key after ``diffusion_model.``; both A14B experts training
        (``high.…``/``low.…``): the low expert's under :data:`LOW_FILE_PREFIX` (its own file once saved)."""
        if path.startswith("high."):
            return module_to_original(path[len("high."):])
        if path.startswith("low."):
            return LOW_MARK + module_to_original(path[len("low."):])  # moved under LOW_FILE_PREFIX by _file_key
        return module_to_original(path)

    @staticmethod
    def _file_key(key: str) -> str:
        """``diffusion_model.<LOW_MARK>X`` → ``low_noise.diffusion_model.X``."""
        mark = f"{LORA_PREFIX}.{LOW_MARK}"
        return LOW_FILE_PREFIX + LORA_PREFIX + "." + key[len(mark):] if key.startswith(mark) else key

    def lora_state_dict(self, modules: Dict[str, Any], adapter_name: str = "default") -> Dict[str, Any]:
        out = peft_layout_state_dict(modules, {"unet": LORA_PREFIX}, adapter_name, {"unet": self._expert_path})
        if not out:
            raise ValueError(f"no peft LoRA layers with adapter {adapter_name!r} found")
        return {self._file_key(k): v for k, v in out.items()}

    def load_lora_state_dict(self, state: Dict[str, Any], modules: Dict[str, Any],
                             adapter_name: str = "default") -> int:
        ours = {(f"{LORA_PREFIX}.{LOW_MARK}" + k[len(LOW_FILE_PREFIX + LORA_PREFIX) + 1:]
                 if k.startswith(LOW_FILE_PREFIX) else k): k for k in state}
        used = load_peft_layout({k: state[v] for k, v in ours.items()}, modules, {"unet": LORA_PREFIX}, adapter_name,
                                {"unet": self._expert_path})
        extra = sorted(ours[k] for k in set(ours) - used)
        if extra:
            raise ValueError(f"LoRA file keys match no LoRA layer of the model: {', '.join(extra[:5])}")
        return len(used) // 2

    def split_lora_file(self, state: Dict[str, Any], meta: Dict[str, str]):
        """The result's files: [(name suffix, tensors, header)] — both A14B experts: the high expert's file and the
        low expert's beside it (``…_low_noise.safetensors``), each in the original layout."""
        if not isinstance(self.transformer, TwoExperts):
            return [("", state, meta)]
        high, others = split_experts(state)
        return [("", high, dict(meta, **{"wan.expert": "high"}))] + \
            [(suffix, low, dict(meta, **{"wan.expert": "low"})) for suffix, low in others.items()]

    def read_lora_files(self, path: Any) -> Dict[str, Any]:
        """A result as :meth:`split_lora_file` wrote it, back in one state dict (``lora.init_weights``)."""
        state = dict(load_file(str(path)))
        if isinstance(self.transformer, TwoExperts):
            low = Path(path).with_name(Path(path).stem + LOW_SUFFIX + Path(path).suffix)
            if not low.is_file():
                raise ValueError(f"both Wan experts train, but the low-noise expert's file {low.name} is not beside it")
            state.update({LOW_FILE_PREFIX + k: v for k, v in load_file(str(low)).items()})
        return state

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        """The common header; an A14B file also says which expert it is for (``wan.expert``: high or low)."""
        meta = super().lora_metadata(title=title, resolution=resolution, extra=extra)
        if self.expert:
            meta["wan.expert"] = self.expert  # "both": split_lora_file writes each file's own
            meta["wan.boundary_ratio"] = str(self.boundary_ratio)
        return meta

    # --- export -----------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The fine-tuned transformer as the original single file (keys.py)."""
        save_transformer_file(path, diffusers_to_original(self.transformer.state_dict()), dtype, metadata)
