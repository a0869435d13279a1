"""Estimate the peak GPU memory of a run without a GPU and without weights.

    python -m trainer estimate-vram --preset sdxl-lora-8gb
    python -m trainer estimate-vram my-run.yaml --set training.batch_size=2 --card-gib 12
    python -m trainer estimate-vram --all-memory-presets            # every *-8gb/-12gb/-16gb preset
    python -m trainer estimate-vram --all-memory-presets --json     # one JSON object per preset

Why: the memory presets (``presets/*-8gb.yaml`` …) promise to fit a card, and no GPU is available to
check them; the web UI checks a config before Start the same way. How: the real, full-size model is built
from its configs (the shipped ones of its family for a hub id or single file) under
``torch._subclasses.fake_tensor.FakeTensorMode`` — tensors with shapes, dtypes and storages but no data, so an
SDXL UNet costs no RAM (:mod:`trainer.memory.estimate_session`) — and the trainer's own set-up runs on it:
``trainer.families.sources.load_model`` (only ``load_pipeline`` is swapped for a config-only builder),
``trainer.methods.finetune.make_method`` and the shared steps of ``trainer.train.setup`` (``place_parts``,
``build_optimizer_for``, ``setup_loss_ema_precision``: text-encoder offload and storage, block swap, fp8/NF4
storage, gradient checkpointing, the real optimizer class — bitsandbytes' 8-bit ops have fake kernels — EMA and
stochastic rounding), then ``trainer.train.step.forward_loss`` for the step itself.
:func:`~trainer.memory.estimate_tracker.live_tensor_tracker` counts the live tensor storages, rounded to the
CUDA caching allocator's 512-byte blocks, and records the peak, its breakdown and where it happened. An SDXL
preset takes 1-2 minutes and ~0.6 GB of RAM.

Phases, each with its own peak (the run's peak is the largest):

- ``load``: every component on the device in its storage dtype, before fp8 conversion (the SD/SDXL trainer
  moves the whole pipeline to the GPU first, then converts the UNet layer by layer; the transformer families
  quantise their denoiser layer by layer on its way to the GPU, so theirs counts it quantised);
- ``encode``: one VAE encode of a training batch (no grad) — the latent cache, or every step with
  ``data.cache_latents`` off — and the text-cache encode when captions are cached;
- with ``data.offload_text_encoders`` the text encoders leave the device after ``encode``: ``train`` counts
  them out, ``sample`` measures the prompt encoding (encoders in) and the denoising (encoders out) apart;
- ``train``: ``--steps`` optimizer steps (default 2, so the second runs with the optimizer state already
  there; the first is a step on zero gradients, without forward and backward, except with
  ``training.fused_backward``): forward with the preset's autocast, backward, gradient clipping,
  ``optimizer.step``, ``zero_grad``;
- ``sample``: one UNet call at the sampling size (batch 2 with classifier-free guidance) and one VAE
  decode, no grad, with the weights, adapters and optimizer state still on the device, and what the family's
  sampler brings there besides (``sampling_modules()``: Ideogram 4's unconditional transformer, where it joins).

What fake mode cannot give, and what is done instead:

- torch 2.13's FakeTensorMode makes "cuda" fake tensors on a CPU-only build, but autograd on them aborts
  the process (no CUDA device guard is registered: ``c10::impl::ensureCUDADeviceGuardSet`` only covers
  CUDA builds without a device). So the model is faked on the CPU, and bytes are counted as CUDA would
  allocate them. Two CPU/CUDA differences matter for memory and are handled:
  * autocast: CPU autocast runs group_norm / layer_norm / rms_norm / softmax in bf16, CUDA autocast in fp32
    (torch's "CUDA ops that can autocast to float32" list). ``estimate_session.cuda_autocast_fp32`` casts those
    ops' inputs above autograd, so the fp32 copies are what autograd saves, as on CUDA.
  * rms_norm: a CPU build computes it op by op and keeps an fp32 copy of its input for backward; CUDA's fused
    kernel keeps the input in its dtype and a statistic per row, which ``estimate_session.RmsNormAsCuda`` keeps.
  * attention: CPU SDPA picks its flash kernel (saves output + logsumexp), as CUDA's flash /
    memory-efficient kernels do, so attention never materialises the N×N matrix in either.
- not counted: the CUDA context and library handles (cuBLAS/cuDNN), cuDNN/cuBLAS workspaces, and the
  caching allocator's fragmentation (reserved − allocated). They are an allowance: ``--context-gib``
  (default 0.75 GiB) plus ``--fragmentation`` (default 15 %) of the peak's non-weight bytes
  (activations, gradients, optimizer state: what is allocated and freed step after step).
- the estimate is of one process: DDP's and FSDP's buffers and shards are not modelled.

The method is checked in ``tests/test_estimate_vram.py`` on a small SDXL-shaped model: the fake estimate
equals, byte for byte, the same run on real CPU tensors, and on real tensors the tracked peak is 90-93 %
of the CPU allocator's own count (``torch.profiler`` allocation events; the rest are kernel-internal
temporaries such as mkldnn's convolution buffers, the CPU's counterpart of cuDNN workspaces).

Exit status: 0 when every estimate fits its card (or names none), 1 otherwise, 2 for a config error.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import OmegaConf

from trainer.config.checks import load_config
from trainer.config.load import preset_names
from trainer.config.schema import ConceptConfig
from trainer.data.buckets import control_budget, control_size, parse_resolution
from trainer.data.cache import as_text_dict
from trainer.data.frames import parse_frames
from trainer.errors import ConfigError
from trainer.families.sources import classify_source, load_model
from trainer.memory.estimate_report import (
    CONTEXT_GIB,
    FRAGMENTATION,
    PHASES,
    Breakdown,
    Estimate,
    GiB,
    add_arguments,
    card_gib_of,
    format_report,
    format_table,
)
from trainer.memory.estimate_session import cpu_autocast, cuda_autocast_fp32, session
from trainer.memory.estimate_tracker import (
    LiveTensorTracker,
    live_tensor_tracker,
    module_tensors,
    optimizer_state_tensors,
    storage_bytes,
)
from trainer.memory.offload import TEXT_SLOTS, text_frozen
from trainer.methods.make import make_method
from trainer.optim.build import bitsandbytes_problem
from trainer.optim.registry import optimizer_spec
from trainer.parallel.strategy import make_strategy
from trainer.train.setup import build_optimizer_for, place_parts, setup_loss_ema_precision
from trainer.train.state import RunState
from trainer.train.step import forward_loss


def memory_presets() -> List[str]:
    """The presets made for a card size (``*-<N>gb``), by family, then card size."""
    return sorted((n for n in preset_names() if card_gib_of(n) is not None),
                  key=lambda n: (n.split("-")[0], card_gib_of(n) or 0, n))


# ----------------------------------------------------------------------------------------------
# the run, as trainer.train sets it up and steps it
# ----------------------------------------------------------------------------------------------

def estimate_state(cfg, workspace: str, warn: Optional[Callable[[str], None]] = None) -> RunState:
    """The ``trainer.train.state.RunState`` the set-up's shared steps and the training step work on: a run folder
    under ``workspace``, one process, the CPU (where the fake tensors live), the set-up's warnings to ``warn``
    (the estimate's notes; None: dropped)."""
    state = RunState(cfg, Path(workspace) / "runs" / "estimate-vram", progress=False)
    state.par = make_strategy(0, 1)  # the estimate is of one process
    state.device = torch.device("cpu")
    state.warn = warn or (lambda message: None)
    return state


class _Autocast:
    """What ``forward_loss`` asks of accelerate's ``Accelerator``: its ``autocast()``."""

    def __init__(self, autocast: Callable[[], Any]):
        self.autocast = autocast


def ready_to_step(state: RunState, autocast: Callable[[], Any]) -> RunState:
    """What ``forward_loss`` reads that ``trainer.train.setup.setup`` makes outside the shared steps: the run's
    generator and accelerate's autocast (here the CPU's, ``autocast``). The step's own warnings are not notes."""
    state.generator = torch.Generator().manual_seed(int(state.cfg.general.seed))
    state.accelerator = _Autocast(autocast)
    state.warn = lambda message: None
    return state


def step_trainer(model, method, cfg, autocast, workspace: str) -> RunState:
    """A state with ``model`` and ``method`` that ``forward_loss`` can step: so the step is the trainer's own."""
    state = estimate_state(cfg, workspace)
    state.model, state.method = model, method
    return ready_to_step(state, autocast)


def train_size(cfg, resolution: Optional[str] = None) -> Tuple[int, int]:
    """(width, height) of the largest-area training bucket: the resolution (or the largest of a list)."""
    sizes = parse_resolution(resolution or cfg.data.resolution)
    for concept in cfg.data.concepts or []:
        if concept.get("resolution"):
            sizes += parse_resolution(concept.resolution)
    return max(sizes, key=lambda s: (s[0] * s[1], s))


def latent_shape(model, size: Tuple[int, int], frames: int = 1) -> Tuple[int, ...]:
    """The cached posterior's shape for one image (or a ``frames``-frame clip) of ``size`` (w, h), as the
    family's ``encode_pixels`` makes it (packed, patchified or per-frame in some families): one encode, free on fake
    tensors."""
    with torch.no_grad():
        return model.latent_shape(*size, frames=frames) if frames > 1 else model.latent_shape(*size)


def train_frames(model, cfg) -> int:
    """The longest window a video family's training batch holds: the largest of the enabled concepts'
    ``target_frames`` (``frame_extraction: full``: their ``max_frames``, else the model's longest); 1 for an image
    family."""
    video = getattr(model.info, "video", None)
    if video is None:
        return 1
    concepts = [c for c in cfg.data.concepts or [] if c.get("enabled", True)]
    if not concepts:  # a preset without data: the clips a concept of the schema's defaults takes
        return max(parse_frames(ConceptConfig().target_frames))
    longest = 1
    for concept in concepts:
        if concept.get("frame_extraction") == "full":
            longest = max(longest, int(concept.get("max_frames") or 0) or video.max_frames)
        else:
            longest = max(longest, *parse_frames(concept.get("target_frames") or "1"))
    return longest


def sample_frames(model, cfg) -> int:
    """How many frames a video family's sample draws (``sampling.frames``, 0: the model's own); 1 for images."""
    if getattr(model.info, "video", None) is None:
        return 1
    return model.sample_defaults().frames_for(int(cfg.sampling.get("frames", 0) or 0))


def make_batch(model, method, cfg, size: Tuple[int, int], text_cached: bool, rows: Optional[int] = None,
               caption: str = "a photo of sks", frames: int = 1) -> Dict[str, Any]:
    """One data batch as ``trainer.data.pipeline`` hands it to the loop (cached latents' posterior;
    cached text outputs when the text cache serves this run); a video family's of ``frames``-frame clips."""
    b = int(cfg.training.batch_size) if rows is None else rows
    w, h = size
    lat = (b,) + latent_shape(model, size, frames)
    captions = [caption] * b
    batch: Dict[str, Any] = {"latent_dist": {"mean": torch.zeros(lat), "std": torch.ones(lat)},
                             "loss_weights": torch.ones(b), "captions": captions, "sizes": [size] * b,
                             "original_sizes": [(h, w)] * b, "crop_top_lefts": [(0, 0)] * b,
                             "target_sizes": [(h, w)] * b}
    if cfg.data.masks:  # a video batch's mask has the latent frame count: [B, 1, f, h, w]
        batch["mask"] = torch.ones(b, 1, *lat[2:]) if len(lat) == 5 else torch.ones(b, 1, lat[-2], lat[-1])
    if text_cached:
        with torch.no_grad():
            out = as_text_dict(model.encode_captions(method.expand_text(captions)))
        batch.update({k: v.detach().clone() for k, v in out.items()})
    if getattr(model, "inpainting", False):
        batch["inpaint_pixels"] = torch.zeros(b, 3, h, w)
    if getattr(model, "image_to_video", False):  # each clip's first-frame condition, as the latent cache serves it
        with torch.no_grad():
            batch["first_frame"] = model.encode_first_frames(torch.zeros(b, 3, frames, h, w))
    controls = max((len(c.get("control_paths", None) or []) for c in cfg.data.concepts or [] if c.enabled), default=0)
    if controls:  # edit pairs and references: their latents lengthen the denoiser's sequence
        csize = control_size(size, control_budget(cfg.data), int(cfg.data.bucket_step))
        clat = (b,) + latent_shape(model, csize)
        batch["control_latents"] = [{"mean": torch.zeros(clat), "std": torch.ones(clat)} for _ in range(controls)]
    return batch


def _components(model, offloaded: Sequence[str] = ()) -> List[Any]:
    """The model's parts (denoiser, text encoders) and its VAE, less the parts in CPU RAM (``offloaded``
    slots: data.offload_text_encoders)."""
    return [m for slot, m in model.parts().items() if slot not in offloaded] + [getattr(model, "vae", None)]


def _tracker(model, method, optimizer, extra=(), offloaded: Sequence[str] = (),
             more: Sequence[Any] = ()) -> LiveTensorTracker:
    modules = [m for m in _components(model, offloaded) if m is not None] + \
        [m for n, m in method.modules.items() if n not in model.parts()] + list(more)
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    return live_tensor_tracker(modules, trained, optimizer, extra)


def run_estimate(cfg, name: str = "config", *, fake: bool = True, steps: int = 2, emulate_cuda_autocast: bool = True,
                 phases: Sequence[str] = PHASES, workspace: Optional[str] = None, resolution: Optional[str] = None,
                 card_gib: Optional[float] = None, context_gib: float = CONTEXT_GIB,
                 fragmentation: float = FRAGMENTATION, around_phase=None) -> Estimate:
    """Set up ``cfg``'s run as ``trainer.train.setup.setup`` does (on fake tensors unless ``fake`` is
    False) and measure each phase's peak; see the module docstring. ``around_phase(name)``, when given,
    is a context manager entered around each measured phase, inside the tracker (the tests put the
    profiler there); ``details[<phase>_start]`` is the tracked bytes at the phase's start."""
    around = around_phase or (lambda name: contextlib.nullcontext())
    cfg = copy.deepcopy(cfg)
    workspace = workspace or str(Path(tempfile.gettempdir()) / "atelier-estimate-vram")
    OmegaConf.update(cfg, "general.workspace", workspace)
    OmegaConf.update(cfg, "model.hub_offline", True)  # only configs are read; never the network
    t = cfg.training
    est = Estimate(name=name, card_gib=card_gib if card_gib is not None else card_gib_of(name),
                   context_gib=context_gib, fragmentation=fragmentation)
    size = train_size(cfg, resolution)
    est.details.update(resolution=f"{size[0]}x{size[1]}", batch_size=int(t.batch_size),
                       gradient_accumulation_steps=int(t.gradient_accumulation_steps),
                       mixed_precision=t.mixed_precision, gradient_checkpointing=bool(t.gradient_checkpointing),
                       optimizer=t.optimizer.name, method=t.method, fp8_unet=bool(cfg.parts.denoiser.fp8),
                       unet_dtype=cfg.parts.denoiser.dtype, text_encoder_dtype=cfg.parts.text_encoder_1.dtype,
                       vae_dtype=cfg.model.vae_dtype, fake=fake, torch=torch.__version__)
    classify_source(cfg.model.path, workspace)  # builds a builtin:tiny-* model on disk (real tensors) first
    if optimizer_spec(t.optimizer.name).eight_bit:
        bitsandbytes_problem("cpu")  # the trainer's own check takes a real step: done here, outside fake mode

    with session(fake):
        state = estimate_state(cfg, workspace, est.notes.append)
        model = state.model = load_model(cfg, workspace, "cpu")
        components = [m for m in _components(model) if m is not None]
        deferred = bool(getattr(model, "deferred", ()))  # quantised on the way to the device (never whole)
        method = state.method = make_method(model, cfg)
        # the set-up's own steps, as trainer.train.setup.setup runs them (the estimate's captions are cacheable)
        place_parts(state, captions_cacheable=True)
        offloaded: Tuple[str, ...] = TEXT_SLOTS if state.text_offload is not None else ()
        if offloaded:  # in CPU RAM except while they encode (trainer.memory.offload)
            est.details["text_encoders_offloaded"] = True

        def on_device() -> int:
            return storage_bytes(module_tensors([m for m in _components(model, offloaded) if m is not None]
                                                + list(method.modules.values())))
        # the load phase: a model loaded whole (the SD lineage) is on the device before build_optimizer_for stores its
        # denoiser in fp8 there; a deferred one is quantised on its way to the device, so it counts after
        loaded = None if deferred else on_device()
        build_optimizer_for(state)
        optimizer, groups = state.optimizer, state.groups
        trained = [p for g in groups for p in g["params"]]
        trainable = storage_bytes(trained)
        est.details["trainable_params"] = sum(p.numel() for p in trained)
        est.phases["load"] = Breakdown(weights=(on_device() if loaded is None else loaded) - trainable,
                                       trainable=trainable)
        if cfg.ema.enabled and cfg.ema.device == "cpu":
            est.notes.append("EMA is kept in CPU RAM (ema.device = cpu): not counted.")
        setup_loss_ema_precision(state)
        extra = list(state.ema.shadow_params) if state.ema is not None and cfg.ema.device != "cpu" else []
        swap = getattr(model, "block_swap", None)  # parts.denoiser.blocks_to_swap
        est.details["weights_after_setup_gib"] = round(
            storage_bytes(module_tensors(components + list(method.modules.values()))) / GiB, 3)
        text_cached = text_frozen(method) and bool(cfg.data.cache_text)

        if "encode" in phases:
            w, h = size
            mt = _tracker(model, method, optimizer, extra, offloaded)
            with mt, torch.no_grad(), around("encode"):
                clip = (train_frames(model, cfg),) if getattr(model.info, "video", None) is not None else ()
                model.encode_pixels(torch.zeros(int(t.batch_size), 3, *clip, h, w))
                if getattr(model, "image_to_video", False):  # the first frames' condition, cached with the latents
                    model.encode_first_frames(torch.zeros(int(t.batch_size), 3, *clip, h, w))
                if text_cached and not offloaded:
                    model.encode_captions(["a photo of sks"] * 16)
            if text_cached and offloaded:  # the encoders in, the denoiser out (trainer.memory.offload)
                text = _tracker(model, method, optimizer, extra, ("unet",))
                with text, torch.no_grad(), around("encode"):
                    model.encode_captions(["a photo of sks"] * 16)
                saving = swap.bytes_swapped() if swap is not None else 0  # taken off the denoiser's phases below
                if text.breakdown().total > mt.breakdown().total - saving:
                    mt = text
                    est.details["encode_without_denoiser"] = True
            est.phases["encode"] = mt.breakdown()
            est.details.update(encode_peak_at=mt.peak_where, encode_start=mt.start)

        batch = make_batch(model, method, cfg, size, text_cached, frames=train_frames(model, cfg))
        est.details["frames"] = train_frames(model, cfg)
        autocast = cpu_autocast(t.mixed_precision)
        # for the whole phase, not only inside autocast: checkpointed blocks recompute in backward, under
        # the autocast state torch.utils.checkpoint restores, and must cast as the forward did
        policy = lambda: cuda_autocast_fp32(emulate_cuda_autocast)
        if "train" in phases:
            loop = ready_to_step(state, autocast)
            accum = int(t.gradient_accumulation_steps)
            mt = _tracker(model, method, optimizer, extra, offloaded)
            with mt, policy(), around("train"):
                primed = steps > 1 and _state_made(optimizer, trained, fake, t.optimizer.name)
                for _ in range(steps - 1 if primed else steps):
                    for _ in range(accum):
                        loss = forward_loss(loop, batch)
                        (loss / accum).backward()
                        del loss  # as the loop drops it: nothing of a step's graph reaches the next forward
                    if t.max_grad_norm > 0:
                        torch.nn.utils.clip_grad_norm_(trained, t.max_grad_norm)
                    _step(optimizer, fake, t.optimizer.name)
                    optimizer.zero_grad(set_to_none=True)
            est.phases["train"] = mt.breakdown()
            est.details.update(train_peak_at=mt.peak_where, train_start=mt.start)
            est.details["optimizer_state_gib"] = round(storage_bytes(optimizer_state_tensors(optimizer)) / GiB, 4)

        prompts = list(cfg.sampling.prompts or [])
        sampling_on = prompts and (cfg.sampling.every_n_epochs or cfg.sampling.every_n_steps or cfg.sampling.at_end
                                   or cfg.sampling.at_start)
        if "sample" in phases and sampling_on:
            sp = max(prompts, key=lambda p: p.width * p.height)  # the largest sample
            with policy():
                est.phases["sample"], est.details["sample_peak_at"], est.details["sample_start"] = _sample_phase(
                    model, method, optimizer, cfg, sp, autocast, extra, around, offloaded,
                    swap.bytes_swapped() if swap is not None else 0)
            est.details["sample_size"] = f"{sp.width}x{sp.height}"
        if swap is not None:  # the swapped blocks' frozen weights are in CPU RAM, but for one block at a time
            saved = swap.bytes_swapped()
            est.details["blocks_swapped_gib"] = round(saved / GiB, 3)
            for phase, b in est.phases.items():
                if not (phase == "encode" and est.details.get("encode_without_denoiser")) and \
                        not getattr(b, "without_denoiser", False):
                    b.weights = max(0, b.weights - saved)
    return est


def _step(optimizer, fake: bool, name: str) -> None:
    """``optimizer.step()``; where it cannot run on fake tensors (a library op that takes a tensor's value as a
    Python number: bitsandbytes' LAMB8bit), a message that names the optimizer instead of a traceback."""
    try:
        optimizer.step()
    except RuntimeError as exc:
        if not fake:
            raise
        raise ConfigError(f"training.optimizer.name = {name}: the VRAM estimate cannot run this optimizer's step (its "
                          f"library reads a value the estimate's tensors do not have: {str(exc).splitlines()[0]}). "
                          "Estimate with an optimizer that keeps as much state per weight (two moments: adamw, or "
                          "adamw8bit for an 8-bit one) instead.", key="training.optimizer.name", value=name) from None


def _state_made(optimizer, trained, fake: bool = True, name: str = "") -> bool:
    """The optimizer's state made by one step on zero gradients (no forward, no backward), so that the first
    measured step runs with it, as a run's second step does: what the first of two measured steps was for, without
    its forward and backward (about a fifth of a whole estimate's time). The zero gradients, the state and the step's
    own buffers are the first step's, and none of them outlives it but the state. False where the optimizer steps
    each weight inside backward (``training.fused_backward``): there the steps are measured as they run."""
    if getattr(optimizer, "fused_backward", False):
        return False
    for p in trained:
        p.grad = torch.zeros_like(p)
    _step(optimizer, fake, name)
    optimizer.zero_grad(set_to_none=True)
    return True


def _vae_latent(model, size: Tuple[int, int], frames: int = 1):
    """A latent in the VAE's own layout (before the family packs or normalises it) for ``size`` (and ``frames``
    frames of a video VAE)."""
    w, h = size
    # the image's channels: RGB, or the VAE's own input (Qwen-Image 2.1's reads RGBA) where it patchifies none
    config = model.vae.config
    channels = int(getattr(config, "in_channels", 3) or 3) if getattr(config, "patch_size", None) is None else 3
    pixels = torch.zeros(1, channels, h, w, dtype=model.vae.dtype)
    if getattr(model.vae.config, "temperal_downsample", None) is not None:  # a video VAE (Wan, Qwen-Image)
        pixels = pixels.unsqueeze(2).expand(-1, -1, frames, -1, -1)
    with torch.no_grad():
        out = model.vae.encode(pixels)
    return out.latent if hasattr(out, "latent") else out.latent_dist.mean  # DC-AE (Sana) encodes deterministically


def _sample_phase(model, method, optimizer, cfg, sp, autocast, extra, around,
                          offloaded: Sequence[str] = (), saving: int = 0) -> Tuple[Breakdown, str, int]:
    """The sample phase of a family through the family interface the training step uses: the prompt through
    the text encoders (twice with true CFG), one denoiser call on latents of the sample size, one VAE decode.
    With the text encoders offloaded (``offloaded`` slots) they are on the device only for the prompt: the two
    parts are measured apart (the encoders out of VRAM for the second) and the larger peak is the phase's."""
    guidance = model.sample_defaults().guidance_for(sp.cfg_scale)  # empty: the model's own
    n = 2 if guidance > 1 and model.true_cfg else 1  # embedded guidance: one pass
    size = (int(sp.width), int(sp.height))
    frames = sample_frames(model, cfg)
    batch = make_batch(model, method, cfg, size, text_cached=False, rows=n, caption=sp.prompt, frames=frames)
    vae_latent = _vae_latent(model, size, frames)
    dtype = model.denoiser.dtype
    for m in method.modules.values():
        m.eval()
    if offloaded:
        encode = _tracker(model, method, optimizer, extra, ("unet",))  # the denoiser out while they encode
        with encode, torch.no_grad(), autocast(), around("sample"):
            cond = model.batch_condition(batch, method.expand_text, set())
        held = [v for v in vars(cond).values() if isinstance(v, torch.Tensor)]  # the prompt's embeddings, kept
    # what the family's sampler adds to the device while it denoises (Ideogram 4's unconditional transformer)
    joining = list(getattr(model, "sampling_modules", lambda: ())())
    mt = _tracker(model, method, optimizer, list(extra) + (held if offloaded else []), offloaded, joining)
    with mt, torch.no_grad(), autocast(), around("sample"):
        if not offloaded:
            cond = model.batch_condition(batch, method.expand_text, set())
        latents = model.sample_latents(batch["latent_dist"])
        t = model.objective.sample_timesteps(n, cfg.loss, None, latents)
        compute = dtype if dtype.is_floating_point and dtype.itemsize > 1 else torch.bfloat16  # fp8 storage: bf16 inputs
        pred = model.predict(model.model_input(latents, batch).to(compute), t, cond)
        del pred, cond, latents
        model.vae.decode(vae_latent, return_dict=False)
    for m in method.modules.values():
        m.train()
    if offloaded and encode.breakdown().total > mt.breakdown().total - saving:  # saving: swapped blocks (below)
        out = encode.breakdown()
        out.without_denoiser = True  # the swapped blocks' saving is not taken off it
        return out, encode.peak_where, encode.start
    return mt.breakdown(), mt.peak_where, mt.start


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------

def run_command(args: argparse.Namespace) -> int:
    """``python -m trainer estimate-vram`` with its parsed options (:func:`estimate_report.add_arguments`): each
    estimate as a report (or a JSON line), then the table. 0 when all fit, 1 when one does not, 2 for a config
    error."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("atelier").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    try:
        jobs: List[Tuple[str, Any]] = []
        config = args.config or args.config_file
        if config:
            jobs.append((Path(config).stem, load_config(config, args.overrides)))
        else:
            for name in (memory_presets() if args.all_memory_presets else args.preset):
                jobs.append((name, load_config(None, args.overrides, preset=name)))
        results = []
        for name, cfg in jobs:
            est = run_estimate(cfg, name, fake=not args.real, steps=args.steps,
                               emulate_cuda_autocast=not args.no_cuda_autocast, phases=args.phases,
                               workspace=args.workspace, resolution=args.resolution, card_gib=args.card_gib,
                               context_gib=args.context_gib, fragmentation=args.fragmentation)
            results.append(est)
            print(json.dumps(est.to_dict()) if args.json else format_report(est), flush=True)
    except ConfigError as exc:
        print(f"Config error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print()
        print(format_table(results))
    return 0 if all(e.fits is not False for e in results) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command on its own (``bench/estimate_vram.py``): the options of ``python -m trainer estimate-vram``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_command(ap.parse_args(argv))


__all__ = ["Breakdown", "Estimate", "GiB", "PHASES", "card_gib_of", "estimate_state", "format_report", "format_table",
           "latent_shape", "main", "make_batch", "memory_presets", "ready_to_step", "run_command", "run_estimate",
           "step_trainer", "train_size"]
