"""Set-up of a run: from a config to a state ready for its first step.

:func:`setup` is the whole of it, in order. The part from the loaded model to the built optimizer is three
functions that the VRAM estimator (``trainer.memory.estimate``) calls too, on fake tensors, so an estimate
sets up exactly what a run sets up: :func:`place_parts` (where the parts live: text-encoder offload and
fp8/NF4 storage, the block-swap plan), :func:`build_optimizer_for` (the denoiser's storage, gradient
checkpointing, train mode, FSDP sharding, the parameter groups and the optimizer, DDP's hooks) and
:func:`setup_loss_ema_precision` (noise schedule, EMA, stochastic rounding)."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from omegaconf import OmegaConf

from trainer.data.pipeline import DataPipeline
from trainer.errors import ConfigError, DataError
from trainer.families.checks import family_without_loading
from trainer.families.sources import ModelSettings, load_model
from trainer.host.devices import device_problems, resolve_device
from trainer.loss import prepare_noise_schedule
from trainer.memory import fp8_matmul
from trainer.memory.block_swap import plan_block_swap
from trainer.memory.checkpointing import enable_checkpointing
from trainer.memory.offload import TextEncoderOffload, plan_offload, text_frozen
from trainer.memory.precision import apply_precision, apply_storage, place_text_encoders
from trainer.methods.lora import autocasts
from trainer.methods.make import make_method
from trainer.optim.build import build_optimizer, param_groups
from trainer.optim.schedule import build_scheduler
from trainer.parallel.distributed import accelerator_kwargs
from trainer.parallel.fsdp import plan_fsdp
from trainer.parallel.strategy import make_strategy
from trainer.train.checkpoint import resolve_resume
from trainer.train.compile import (CUDAGRAPH_MODES, backend_problem, cache_counts, compile_blocks,
                                   cudagraph_shape_warning, describe, static_shape_warning, step_shapes)
from trainer.train.ema import make_ema
from trainer.train.norms import norms_in_compute_dtype
from trainer.train.state import RunState
from trainer.train.step import drops_captions
from trainer.train.training_adapter import attach_training_adapter

log = logging.getLogger("atelier")


def setup(state: RunState) -> None:
    """Device, precision, the data plan, the model and what trains, memory placement, the optimizer and
    schedule, the caches: everything before the first step (a resume then loads its backup)."""
    cfg = state.cfg
    g = cfg.general
    t = cfg.training
    mps_backend = getattr(torch.backends, "mps", None)
    try:
        device = resolve_device(g.device, torch.cuda.is_available(),
                                bool(mps_backend is not None and mps_backend.is_available()))
    except ValueError as exc:
        raise ConfigError(str(exc), key="general.device", value=g.device) from None
    for key, message, level in device_problems(cfg, device):
        if level == "error":
            raise ConfigError(message, key=key)
        state.warn(message)
    cpu = device == "cpu"
    AcceleratorState._reset_state()  # a second run in the same process (tests) may change precision
    fsdp_plugin = plan_fsdp(cfg, state.world, cpu, state.warn, log.info)  # None: gradients averaged as DDP does
    state.accelerator = Accelerator(mixed_precision=t.mixed_precision, cpu=cpu,
                                   fsdp_plugin=None if cpu else fsdp_plugin,  # accelerate: FSDP on GPUs only
                                   kwargs_handlers=accelerator_kwargs(cfg, cpu, state.world, state.warn,
                                                                      sharded=fsdp_plugin is not None))
    state.device = state.accelerator.device
    if t.get("compile", False):  # before a model loads: a machine that cannot compile is said in seconds
        problem = backend_problem(state.device.type)
        if problem:
            raise ConfigError(problem, key="training.compile", value=True)
    if cfg.parts.denoiser.get("fp8_matmul", False):  # the same: a GPU without fp8 products is said before loading
        fp8_matmul.check_device(state.device)
    if state.device.type == "cuda":
        # cuDNN's SDPA kernel (chosen first for bf16 on Hopper since torch 2.5) fails in Flux.1's 1024 px
        # backward (torch 2.11, cu130, H200: "mha_graph.execute(...).is_good()", an illegal memory access
        # without CUDA_LAUNCH_BLOCKING); flash/memory-efficient attention train it
        torch.backends.cuda.enable_cudnn_sdp(False)
    # one process, DDP or FSDP: the one object that answers what differs between them
    state.par = make_strategy(state.accelerator.process_index, state.accelerator.num_processes, fsdp_plugin)
    set_seed(g.seed)
    state.global_micro_batch = plan_global_batch(state)

    data_cfg = state.par.data_config(cfg, state.global_micro_batch)  # every process plans the global batches
    # the data is read before the model loads (a bad folder fails in seconds, not after a download); where the family
    # is told only by loading (a hub id), a video family's clips count once it is known
    told = family_without_loading(cfg.model, g.workspace)
    pending: list = []
    try:
        state.data = DataPipeline(data_cfg, warn=state.warn if told else pending.append)
        early_error = None
    except DataError as exc:
        if told:
            raise
        state.data, early_error = None, exc

    log.info("loading model %s", cfg.model.path)
    with state.accelerator.main_process_first():  # builds built-in models / fills the hub cache once
        state.model = load_model(cfg, g.workspace, state.device)
    if not told:
        video = state.model.info.video_for(state.model.family)
        if video is not None:
            state.data = DataPipeline(data_cfg, warn=state.warn, video=video)
        elif early_error is not None:
            raise early_error
        else:
            for message in pending:
                state.warn(message)
    state.report = state.data.report
    # a distilled model's de-distilling LoRA: on the base while training, hooked before the method wraps the layers
    state.model.training_adapter = attach_training_adapter(state.model, cfg.model.get("training_adapter", ""),
                                                           cfg.model)
    state.method = make_method(state.model, cfg)
    state.method.prepare_data(state.data, state.warn)  # embedding placeholder: captions, tag dropout, warnings
    check = getattr(state.model, "check_captions", None)  # e.g. Flux with T5 off: captions within CLIP's limit
    if check is not None:
        check([(it.path, c) for it in state.data.items + state.data.validation_items for c in it.captions])
    place_parts(state, state.data.captions_cacheable())
    build_optimizer_for(state, fsdp_plugin)
    state.micro_batches_per_epoch = len(state.data.epoch_batches(0))
    state.steps_per_epoch = max(1, state.micro_batches_per_epoch // t.gradient_accumulation_steps)
    if state.micro_batches_per_epoch < t.gradient_accumulation_steps:
        raise ConfigError(f"An epoch has {state.micro_batches_per_epoch} batches, fewer than "
                          f"training.gradient_accumulation_steps = {t.gradient_accumulation_steps}: "
                          "no optimizer step would happen. Lower accumulation or batch size.",
                          key="training.gradient_accumulation_steps")
    state.total_steps = t.max_steps if t.max_steps > 0 else t.epochs * state.steps_per_epoch
    state.scheduler = build_scheduler(state.optimizer, cfg, state.total_steps)
    state.generator = torch.Generator().manual_seed(g.seed)
    # the step's tensors are drawn on the device (no copies); on the CPU that is the one generator, as before
    state.device_generator = state.generator if state.device.type == "cpu" else \
        torch.Generator(state.device).manual_seed(g.seed)
    setup_loss_ema_precision(state)
    state.compiled = False  # training.compile: the first step pays for the compiles (its time is reported)
    if t.get("compile", False):
        mode = t.get("compile_mode", "default")
        if mode in CUDAGRAPH_MODES and state.device.type != "cuda":
            raise ConfigError(f"training.compile_mode = {mode} records CUDA graphs: it needs a CUDA GPU, and this "
                              f"run trains on {state.device.type}. Use default.", key="training.compile_mode",
                              value=mode)
        dynamic, scope = t.get("compile_dynamic", "auto"), t.get("compile_scope", "blocks")
        try:
            denoiser = state.model.denoiser
            if scope == "denoiser":
                state.model.before_compile(state.device)
            done = compile_blocks(denoiser, mode, dynamic, scope, state.par.training_entry(denoiser))
        except ValueError as exc:
            raise ConfigError(str(exc), key="training.compile", value=True) from None
        static = dynamic == "static"
        shapes = step_shapes(state.data.epoch_batches(0)) if mode in CUDAGRAPH_MODES or static else set()
        if mode in CUDAGRAPH_MODES:
            log.info("training.compile_mode %s: %d step shape(s), one CUDA graph each per %s", mode, len(shapes),
                     "forward and backward" if scope == "denoiser" else "block")
        for warning in (cudagraph_shape_warning(shapes) if mode in CUDAGRAPH_MODES else "",
                        static_shape_warning(shapes, scope) if static else ""):
            if warning:
                state.warn(warning)
        state.compiled = True
        state.compile_counts = cache_counts()
        log.info("training.compile: %s compiled at their first call (shapes: %s)", describe(done), dynamic)

    frozen_text = text_frozen(state.method)  # cached text outputs stay valid only while no text-side module trains
    with state.accelerator.main_process_first():  # rank 0 fills the caches; the others then read them
        state.cache_summary = state.data.prepare(
            state.model.encode_pixels, state.model.fingerprint(), cfg.model.vae_dtype,
            encode_text_fn=(lambda captions, *controls: state.model.encode_captions(  # controls: an edit model's
                state.method.expand_text(captions), *controls)) if frozen_text else None,
            text_fingerprint=state.model.text_fingerprint(ModelSettings(cfg)),
            text_controls=state.model.text_sees_controls,  # its text features depend on the control images
            # …and so does its empty caption: the step's own caption dropout takes each row's from the cache
            text_empty=state.model.text_sees_controls and drops_captions(cfg, state.model),
            # inpainting: batches carry the pixels, the cache keeps them (and data-masked latents)
            inpaint_fn=state.model.encode_masked_images if getattr(state.model, "inpainting", False) else None,
            # image-to-video: each window's first frame conditions the model (cached beside the latents)
            first_frame_fn=state.model.encode_first_frames if getattr(state.model, "image_to_video", False) else None)
    if state.text_offload is not None:
        state.text_offload.encoders_out()  # the denoiser back on the device for training
    state.tb = None
    if g.tensorboard and state.is_main:
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
            state.tb = SummaryWriter(str(state.run.path / "tensorboard"))
        except Exception as exc:  # tensorboard missing: not fatal
            state.warn(f"TensorBoard logging is off: {exc}")


def place_parts(state: RunState, captions_cacheable: bool) -> None:
    """Where the model's parts live once the method has added what trains: the text encoders in fp8/NF4 where
    asked, on the device or (``data.offload_text_encoders``, which needs every caption cacheable and the text
    side frozen) in CPU RAM but while they encode; the denoiser's swapped blocks planned
    (``parts.denoiser.blocks_to_swap``: :func:`build_optimizer_for` places them with the storage)."""
    cfg = state.cfg
    state.text_offload = None
    offloading = plan_offload(cfg, captions_cacheable, text_frozen(state.method), state.warn)
    place_text_encoders(state.model, cfg, offloading)  # fp8 text encoders; the device unless offloaded
    if offloading:
        state.text_offload = TextEncoderOffload(state.model, state.device)  # before the denoiser reaches the device
        log.info("text encoders in CPU RAM except while they encode: %s", ", ".join(state.text_offload.slots))
    plan_block_swap(state.model, cfg, state.device, state.warn)  # blocks_to_swap: placed by apply_storage


def build_optimizer_for(state: RunState, fsdp_plugin: Any = None) -> None:
    """The trained modules made ready and their optimizer built, in the order that matters: fp8/NF4 storage of the
    denoiser's frozen weights (quantised on the way to the device), gradient checkpointing, train mode, FSDP's
    sharding (``fsdp_plugin``; before the optimizer is built on the weights), the parameter groups and the
    optimizer, then what several processes attach to them (DDP)."""
    cfg = state.cfg
    apply_storage(state.model, state.method, cfg)
    frozen_in_compute_dtype(state)
    norms_in_autocast_dtype(state)
    if cfg.training.gradient_checkpointing:
        keep = bool(cfg.training.get("checkpoint_keep_attention", False))
        interval = int(cfg.training.get("gradient_checkpointing_interval", 1) or 1)
        for m in state.method.modules.values():  # one process: torch's reentrant checkpoint where it fits
            enable_checkpointing(m, keep_attention=keep, interval=interval, reentrant=state.world == 1)
    for m in state.method.modules.values():
        m.train()
    state.par.shard(state.method, fsdp_plugin, state.device)  # FSDP: before the optimizer is built on the weights
    state.groups = param_groups(state.method, cfg)
    state.optimizer = build_optimizer(state.groups, cfg)
    state.par.attach(state.method, state.optimizer, state.groups, state.device)  # several processes: DDP …


def frozen_in_compute_dtype(state: RunState) -> None:
    """A LoRA's frozen denoiser kept in fp32 under autocast: its Linear and Conv weights stored in the autocast
    dtype. Autocast casts a frozen fp32 weight again at every call (its cast cache keeps only trained leaves), so
    storing the cast gives the same matmuls without the casts, in half the memory. Norms, embeddings and the
    denoiser's input dtype stay as they were; fp8/NF4 storage and block swapping (which place the weights
    themselves) are left alone."""
    cfg = state.cfg
    denoiser = state.model.denoiser
    if cfg.training.method != "lora" or not autocasts(cfg, state.device) or denoiser is None \
            or int(cfg.parts.denoiser.get("blocks_to_swap", 0) or 0) > 0:
        return
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float16
    layers = [m for m in denoiser.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d,
                                                              torch.nn.Conv3d))]
    if any(getattr(m, "lora_variant", None) for m in denoiser.modules()):  # DoRA: its norms read the base weight
        return
    weights = [p for m in layers for p in m.parameters(recurse=False) if not p.requires_grad and p.dtype == torch.float32]
    if not weights:
        return
    if state.unet_dtype is None:  # the denoiser's input dtype, read before its first weight changes dtype
        state.unet_dtype = denoiser.dtype
    for p in weights:
        p.data = p.data.to(dtype)


def norms_in_autocast_dtype(state: RunState) -> None:
    """Under autocast, the denoiser's RMSNorms whose weights are stored in the compute dtype compute in one fused
    kernel and hand back that dtype (``training.norms_in_compute_dtype``; :mod:`trainer.train.norms`)."""
    cfg = state.cfg
    denoiser = state.model.denoiser
    if not cfg.training.get("norms_in_compute_dtype", True) or not autocasts(cfg, state.device) or denoiser is None:
        return
    count = norms_in_compute_dtype(denoiser)
    if count:
        log.info("training.norms_in_compute_dtype: %d RMSNorms of the denoiser computed by F.rms_norm outside "
                 "autocast where their weights have the input's dtype (one fused kernel each on a GPU)", count)


def plan_global_batch(state: RunState) -> int:
    """The global micro-batch: training.batch_size per process x processes. A backup fixes it (and
    the accumulation), so resuming on another number of processes adjusts the per-process batch."""
    t, g = state.cfg.training, state.cfg.general
    if state.world > 1:
        if int(g.get("num_processes", 1) or 1) != state.world:  # launched by hand: the launcher's count wins
            OmegaConf.update(state.cfg, "general.num_processes", state.world)
    if state.resume:
        path = resolve_resume(state.run, state.resume)
        backup = json.loads((path / "state.json").read_text())
        saved, acc = backup.get("global_micro_batch"), backup.get("gradient_accumulation_steps")
        if acc and int(acc) != int(t.gradient_accumulation_steps):
            raise ConfigError(f"Backup {path.name} was made with training.gradient_accumulation_steps = {acc}; this "
                              f"config has {t.gradient_accumulation_steps}. Resume with the same accumulation.",
                              key="training.gradient_accumulation_steps")
        if saved and int(saved) != int(t.batch_size) * state.world:
            was_world = int(backup.get("world_size", 1) or 1)
            was_batch = int(saved) // was_world
            if int(t.batch_size) != was_batch:  # the user asked for another batch: a resume cannot honour it
                raise ConfigError(
                    f"Backup {path.name} trained with training.batch_size = {was_batch} ({was_world} process(es), "
                    f"a global batch of {saved}); this resume asks for training.batch_size = {t.batch_size}. A "
                    f"resumed run keeps its batch (the data order and the schedule's steps depend on it): resume "
                    f"with training.batch_size = {was_batch}, or start a new run.", key="training.batch_size",
                    value=t.batch_size)
            if int(saved) % state.world:
                raise ConfigError(
                    f"Backup {path.name} trained with a global batch of {saved} per micro-batch "
                    f"({was_world} process(es) x batch {was_batch}); {state.world} processes cannot split it. "
                    f"Resume with a general.num_processes that divides {saved} (training.batch_size is adjusted).",
                    key="general.num_processes")
            per = int(saved) // state.world
            state.warn(f"Resuming a backup made on {was_world} process(es) (training.batch_size = {was_batch}) on "
                       f"{state.world}: training.batch_size becomes {per} per process, so the global batch stays "
                       f"{saved} and the run continues exactly.")
            OmegaConf.update(state.cfg, "training.batch_size", per)
    return int(t.batch_size) * state.world


def setup_loss_ema_precision(state: RunState) -> None:
    """Zero-terminal-SNR schedule, the EMA copy, fp8 storage (when not yet applied) and stochastic-rounding
    hooks."""
    cfg = state.cfg
    prepare_noise_schedule(state.model, cfg.loss, state.warn)
    state.ema = make_ema(state.method, cfg.ema, state.device)
    state.rounding = apply_precision(state.model, state.method, state.optimizer, cfg,
                                    lambda: cfg.general.seed * 1_000_003 + state.pos.step, state.warn)
