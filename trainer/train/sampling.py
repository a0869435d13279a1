"""Samples during a run: the family's pipeline over the config's prompts, raw and/or EMA weights,
written as ``samples/step<STEP>-p<INDEX>.png`` by the process that writes. A video family's sample (a pipeline
output with ``frames``) is also written as ``….mp4`` beside the PNG of its first frame (the gallery shows the PNG;
the event's ``videos`` names the MP4s)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from fractions import Fraction
from pathlib import Path
from typing import Any, List

import numpy as np
import torch
from PIL import Image

from trainer.optim.build import on_eval, on_train
from trainer.train.compile import eager_outside_training
from trainer.train.ema import sample_variants
from trainer.train.state import RunState
from trainer.train.training_adapter import adapter_off


def sample(state: RunState) -> List[str]:
    prompts = list(state.cfg.sampling.prompts)
    if not prompts or not state.par.evaluates_here:
        return []  # FSDP: every process runs the pipeline (the sharded UNet gathers per block); rank 0 writes
    state.par.weights_touched()
    rng_state = torch.get_rng_state()
    modes = {n: m.training for n, m in state.method.modules.items()}
    for m in state.method.modules.values():
        m.eval()
    on_eval(state.optimizer)  # schedule-free optimizers: sample the averaged weights
    defaults = state.model.sample_defaults()  # what a prompt leaves empty: the model's own steps, guidance, sampler
    pipe = state.model.pipeline(defaults.sampler_for(state.cfg.sampling.scheduler))
    paths, path_prompts, weights, videos = [], [], [], []
    video = state.model.info.video  # a video family: samples of sampling.frames frames (0: the model's default)
    frames_kw = {"num_frames": defaults.frames_for(getattr(state.cfg.sampling, "frames", 0))} if video else {}
    try:
        for suffix, use_ema in sample_variants(state.ema, state.cfg.ema):  # raw and/or EMA weights
            # without the training adapter: the LoRA on the distilled model, as it will be used
            # a whole compiled denoiser samples eagerly (eager_outside_training)
            with state.ema.applied() if use_ema else nullcontext(), adapter_off(state.model), \
                    eager_outside_training(state.cfg):
                for i, sp in enumerate(prompts):
                    gen = torch.Generator(device="cpu").manual_seed(int(sp.seed))
                    negative = state.method.expand_text(sp.negative_prompt)  # pipelines' own default if empty
                    with torch.no_grad(), state.accelerator.autocast():
                        out = pipe(state.method.expand_text(sp.prompt),  # embedding placeholders
                                   **({"negative_prompt": negative} if negative else {}),
                                   num_inference_steps=defaults.steps_for(sp.steps),
                                   guidance_scale=defaults.guidance_for(sp.cfg_scale),
                                   width=sp.width, height=sp.height, generator=gen, **frames_kw,
                                   **state.model.sampling_kwargs(),
                                   **state.model.prompt_kwargs(sp))  # inpainting: image, mask
                    clip = getattr(out, "frames", None)
                    image = out.images[0] if clip is None else frame_image(clip[0][0])
                    path = sample_path(state, i, suffix)
                    if not state.is_main:
                        continue
                    if clip is not None:
                        mp4 = path.with_suffix(".mp4")
                        # the loaded model's own frame rate (a variant's may differ from its family's)
                        write_video(mp4, clip[0], getattr(state.model, "fps", None) or (video.fps if video else 16.0))
                        videos.append(str(mp4))
                    tmp = path.with_name(path.stem + ".tmp.png")
                    image.save(tmp)
                    os.replace(tmp, path)
                    paths.append(str(path))
                    path_prompts.append(sp.prompt)
                    weights.append("ema" if use_ema else "raw")
                    if state.tb is not None:
                        state.tb.add_image(f"sample/{i}{suffix}", np.asarray(image), state.pos.step,
                                          dataformats="HWC")
    finally:
        on_train(state.optimizer)
        for n, m in state.method.modules.items():
            m.train(modes[n])
        torch.set_rng_state(rng_state)
    state.run.events.emit("sample", step=state.pos.step, epoch=state.pos.epoch, paths=paths,
                         prompts=path_prompts, weights=weights, **({"videos": videos} if videos else {}))
    return paths


def sample_path(state: RunState, index: int, suffix: str) -> Path:
    """``samples/step<STEP>-p<INDEX><suffix>.png``; a second sample of the same prompt at the same step (Sample
    now on a scheduled sample's step, or the reverse) gets ``-2``, ``-3`` … instead of replacing the first."""
    stem = f"step{state.pos.step:06d}-p{index}{suffix}"
    path, n = state.run.path / "samples" / f"{stem}.png", 1
    while path.exists():
        n += 1
        path = path.with_name(f"{stem}-{n}.png")
    return path


def frame_image(frame: Any) -> Image.Image:
    """One frame of a pipeline's video (H×W×3, floats in [0, 1] or uint8, or a PIL image) as a PIL image."""
    if isinstance(frame, Image.Image):
        return frame.convert("RGB")
    arr = np.asarray(frame)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
    return Image.fromarray(arr)


def write_video(path: Path, frames: Any, fps: float) -> None:
    """``frames`` (a sequence of H×W×3 frames, as :func:`frame_image` reads them) as an H.264 MP4 at ``fps`` (MPEG-4
    Part 2 where this PyAV has no libx264), written to a temporary name and then renamed."""
    images = [np.asarray(frame_image(f)) for f in frames]
    height, width = images[0].shape[:2]
    import av  # PyAV: only a video sample needs it (its import costs ~0.4 s of every run's start)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    tmp = path.with_name(path.stem + ".tmp.mp4")
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width - width % 2, height - height % 2, "yuv420p"
        for arr in images:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr[:stream.height, :stream.width]),
                                               format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    os.replace(tmp, path)
