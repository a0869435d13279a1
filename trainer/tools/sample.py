"""``sample``: images from a model (and LoRAs) outside training, with the pipeline training samples use.

LoRAs are merged into the loaded weights in memory (the ``merge`` arithmetic), so what this draws is
what a merged model draws. ``--config`` takes a run config's model and its ``sampling.prompts`` (each
with its own seed, steps, size …); its LoRA training settings play no part. Images are written as
``<index>-<seed>.png`` atomically, and their paths printed, one a line; a video model's samples also as
``<index>-<seed>.mp4`` (the PNG is their first frame)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List

import torch

from trainer.io import atomic_path
from trainer.tools import ToolError, check_out, split_weight
from trainer.tools.common import apply_loras, load_family, read_lora, tool_config
from trainer.train.sampling import frame_image, write_video


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


def _jobs(args: Any, cfg: Any, default_size: int) -> List[Any]:
    """One namespace per image: prompt, negative, seed, steps, cfg, width, height (+ inpainting image/mask)."""
    def size(value: Any) -> int:
        return int(value) if value else default_size

    if args.prompt is not None:
        if args.count < 1:
            raise ToolError(f"--count {args.count}: give at least 1.")
        return [SimpleNamespace(prompt=args.prompt, negative_prompt=args.negative or "", seed=args.seed + i,
                                steps=args.steps, cfg_scale=args.cfg, width=size(args.width),
                                height=size(args.height), image=getattr(args, "image", "") or "", mask="")
                for i in range(args.count)]
    prompts = list(cfg.sampling.prompts)
    if not prompts:
        raise ToolError(f"--config {args.config} has no sampling.prompts; add some there or give --prompt TEXT.")
    return [SimpleNamespace(prompt=p.prompt, negative_prompt=p.negative_prompt, seed=int(p.seed), steps=p.steps,
                            cfg_scale=p.cfg_scale, width=int(p.width), height=int(p.height),
                            image=p.image, mask=p.mask) for p in prompts]


def run(args: Any) -> int:
    if args.prompt is None and not args.config:
        raise ToolError("give --prompt TEXT, or --config CONFIG.yaml to draw its sampling.prompts.")
    if args.model and args.config:
        raise ToolError("give MODEL or --config (which names its model.path), not both.")
    if not args.model and not args.config:
        raise ToolError("give MODEL (a diffusers folder, a .safetensors/.ckpt file, a hub id or builtin:tiny-sd) "
                        "or --config CONFIG.yaml.")
    for name, value in (("--steps", args.steps), ("--width", args.width), ("--height", args.height)):
        if value is not None and value < 1:
            raise ToolError(f"{name} {value}: give a positive number.")
    for name, value in (("--width", args.width), ("--height", args.height)):
        if value and value % 8:
            raise ToolError(f"{name} {value} must be a multiple of 8.")
    loras = [(read_lora(path, "--lora"), weight) for path, weight in (split_weight(s) for s in args.lora)]
    cfg = tool_config(args.model or "", args.workspace, args.config) if args.config else None
    folder = Path(args.out).expanduser() if args.out else \
        Path(args.workspace or "workspace") / "samples" / time.strftime("%Y%m%d-%H%M%S")
    if folder.exists() and not folder.is_dir():
        raise ToolError(f"--out {folder} is a file; give a folder for the images.")
    device = pick_device(args.device)
    model = load_family(args.model or "", args.workspace, config=args.config, config_path=args.config_path,
                        device=device)
    if loras:
        apply_loras(model, loras)
    vae = getattr(model, "vae", None)  # the Würstchen-lineage priors have an image encoder and a decoder instead
    default_size = int(model.denoiser.config.sample_size) * 2 ** (len(vae.config.block_out_channels) - 1) \
        if vae is not None and hasattr(model.denoiser.config, "sample_size") else 1024 if vae is None else 512
    jobs = _jobs(args, cfg or SimpleNamespace(sampling=SimpleNamespace(prompts=[])), default_size)
    paths = [folder / f"{i:03d}-{job.seed}.png" for i, job in enumerate(jobs)]
    for p in paths:  # all refused before the first image is drawn
        check_out(p, args.overwrite, folder=False)
    if model.family in model.info.start_image and not all(job.image for job in jobs):
        raise ToolError(f"--image: start image required: {model.family} is an image-to-video model; give --image "
                        "START.png (with --config: an image in each of its sampling.prompts).")
    defaults = model.sample_defaults()  # what neither the options nor the config's prompt set: the model's own
    pipe = model.pipeline(defaults.sampler_for(args.sampler or (cfg.sampling.scheduler if cfg is not None else None)))
    autocast = torch.autocast("cuda", dtype=torch.float16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    folder.mkdir(parents=True, exist_ok=True)
    video = model.info.video  # a video model: a clip of the config's sampling.frames (0: its own), MP4 beside the PNG
    frames = {"num_frames": defaults.frames_for(getattr(cfg.sampling, "frames", 0) if cfg is not None else 0)} \
        if video else {}
    for job, path in zip(jobs, paths):
        gen = torch.Generator(device="cpu").manual_seed(int(job.seed))
        with torch.no_grad(), autocast:
            out = pipe(job.prompt, **({"negative_prompt": job.negative_prompt} if job.negative_prompt else {}),
                       num_inference_steps=defaults.steps_for(job.steps),
                       guidance_scale=defaults.guidance_for(job.cfg_scale),
                       width=int(job.width), height=int(job.height), generator=gen, **frames,
                       **model.sampling_kwargs(), **model.prompt_kwargs(job))
        clip = getattr(out, "frames", None)
        image = out.images[0] if clip is None else frame_image(clip[0][0])
        if clip is not None:
            write_video(path.with_suffix(".mp4"), clip[0], getattr(model, "fps", None) or video.fps)
            print(path.with_suffix(".mp4"), flush=True)
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        print(path, flush=True)
    return 0
