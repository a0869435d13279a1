"""Samples during a run: the family's pipeline over the config's prompts, raw and/or EMA weights,
written as ``samples/step<STEP>-p<INDEX>.png`` by the process that writes."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import List

import numpy as np
import torch

from trainer.optim.build import on_eval, on_train
from trainer.train.ema import sample_variants
from trainer.train.state import RunState


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
    paths, path_prompts, weights = [], [], []
    try:
        for suffix, use_ema in sample_variants(state.ema, state.cfg.ema):  # raw and/or EMA weights
            with state.ema.applied() if use_ema else nullcontext():
                for i, sp in enumerate(prompts):
                    gen = torch.Generator(device="cpu").manual_seed(int(sp.seed))
                    negative = state.method.expand_text(sp.negative_prompt)  # pipelines' own default if empty
                    with torch.no_grad(), state.accelerator.autocast():
                        image = pipe(state.method.expand_text(sp.prompt),  # embedding placeholders
                                     **({"negative_prompt": negative} if negative else {}),
                                     num_inference_steps=defaults.steps_for(sp.steps),
                                     guidance_scale=defaults.guidance_for(sp.cfg_scale),
                                     width=sp.width, height=sp.height, generator=gen,
                                     **state.model.sampling_kwargs(),
                                     **state.model.prompt_kwargs(sp)).images[0]  # inpainting: image, mask
                    path = sample_path(state, i, suffix)
                    if not state.is_main:
                        continue
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
                         prompts=path_prompts, weights=weights)
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
