"""Samples take each model's own steps, guidance and sampler where a prompt leaves them empty.

A prompt without ``steps``/``cfg_scale`` used to sample every family at 20 steps and CFG 7 with DDIM: Flux.1 [dev]
at guidance 7, Z-Image Turbo and Qwen-Image at CFG 7, PixArt and the Würstchen lineage at 7 instead of 4-4.5 —
burnt samples that look like a broken LoRA. Each family declares its defaults per variant
(``FamilyInfo.sample_defaults``); these tests check that the diffusers pipeline the family's sampler calls receives
them (its ``__call__`` replaced by a recorder, so nothing is denoised), that a prompt's own values win, and that the
declared values are the pipeline's own ``__call__`` defaults wherever the family does not say why they differ.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import diffusers
import pytest
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import load_tiny
from trainer.config.checks import load_config
from trainer.config.schema import SamplePromptConfig
from trainer.families import infos
from trainer.families.common.samplers import SAMPLERS
from trainer.train.sampling import sample

pytestmark = pytest.mark.usefixtures("one_thread")

# one built-in tiny model per family class and per variant whose defaults differ
TINY = ["tiny-sd", "tiny-sdxl", "tiny-pixart", "tiny-flux", "tiny-flux-schnell", "tiny-flux-kontext", "tiny-cascade",
        "tiny-wuerstchen", "tiny-sd3", "tiny-chroma", "tiny-zimage", "tiny-qwen-image", "tiny-qwen-image-edit",
        "tiny-flux2-klein", "tiny-flux2-dev", "tiny-wan21", "tiny-wan22-5b", "tiny-wan22-a14b", "tiny-sana",
        "tiny-hidream",
        "tiny-krea2-turbo",  # Krea 2: Turbo, whose defaults differ from the pipeline's (Raw's are its own)
        "tiny-ernie-image",
        "tiny-qwen-image-21-turbo",  # Qwen-Image 2.1: Turbo, its 8 shipped sigmas (the base's are the pipeline's)
        "tiny-hunyuan-image"]  # its cfg_scale is its guider's, passed on as the pipeline's one guidance argument too


def _every_declared():
    return [(info.name, key, d) for info in infos().values() for key, d in info.sample_defaults.items()]


@pytest.mark.parametrize("family,key,defaults", _every_declared(), ids=lambda v: v if isinstance(v, str) else "")
def test_declared_defaults_are_the_pipelines_own_unless_a_reason_is_given(family, key, defaults):
    """Where the pipeline's ``__call__`` default is a real one the declared value equals it; where it is a placeholder
    (a model of another kind shares the pipeline) the declaration names the field and says where its value is from."""
    params = inspect.signature(getattr(diffusers, defaults.pipeline).__call__).parameters
    assert defaults.steps_arg in params and defaults.guidance_arg in params, defaults
    for name, declared, arg in (("steps", defaults.steps, defaults.steps_arg),
                                ("guidance", defaults.guidance, defaults.guidance_arg)):
        if name in defaults.differs:
            assert defaults.why, f"{family} {key}: {name} differs from {defaults.pipeline}'s default; say why"
        else:
            assert declared == params[arg].default, (family, key, name)
    if defaults.scheduler:
        assert defaults.scheduler in SAMPLERS
    if infos()[family].video is not None:  # a video model's sample length: its pipeline's num_frames
        assert defaults.frames == params["num_frames"].default, (family, key)
    else:
        assert defaults.frames == 1, (family, key)


def test_every_variant_declares_its_sample_defaults():
    for info in infos().values():
        assert set(info.variants) <= set(info.sample_defaults), info.name


def test_an_empty_field_means_the_default_and_a_value_is_kept():
    d = infos()["flux"].sample_defaults_for("flux-schnell")
    assert (d.steps_for(None), d.guidance_for(None), d.sampler_for("auto")) == (4, 0.0, None)
    assert (d.steps_for(12), d.guidance_for(0.0), d.sampler_for("euler")) == (12, 0.0, "euler")
    sd = infos()["sd"].sample_defaults_for("sd15")
    assert (sd.steps_for(None), sd.guidance_for(None), sd.sampler_for("auto")) == (20, 7.0, "ddim")


def test_a_config_without_them_leaves_them_empty_and_explicit_values_stay():
    cfg = load_config(None, ["model.path=builtin:tiny-sd", "sampling.prompts=[{prompt: a}]"])
    assert (cfg.sampling.prompts[0].steps, cfg.sampling.prompts[0].cfg_scale, cfg.sampling.scheduler) == \
        (None, None, "auto")
    cfg = load_config(None, ["model.path=builtin:tiny-sd", "sampling.scheduler=ddim",
                             "sampling.prompts=[{prompt: a, steps: 20, cfg_scale: 7.0}]"])
    assert (cfg.sampling.prompts[0].steps, cfg.sampling.prompts[0].cfg_scale, cfg.sampling.scheduler) == \
        (20, 7.0, "ddim")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ws")


def _state(model, run: Path, prompts, scheduler: str):
    """What :func:`trainer.train.sampling.sample` reads of a run, around a loaded model."""
    prompts = [OmegaConf.merge(OmegaConf.structured(SamplePromptConfig), p) for p in prompts]  # the schema's defaults
    cfg = SimpleNamespace(sampling=SimpleNamespace(scheduler=scheduler, prompts=prompts),
                          ema=SimpleNamespace(sample_with="raw"))
    events = SimpleNamespace(emit=lambda *a, **k: None)
    return SimpleNamespace(
        cfg=cfg, model=model, ema=None, optimizer=None, tb=None, is_main=True,
        par=SimpleNamespace(evaluates_here=True, weights_touched=lambda: None),
        method=SimpleNamespace(modules={}, expand_text=lambda text: text),
        accelerator=SimpleNamespace(autocast=nullcontext),
        pos=SimpleNamespace(step=0, epoch=0), run=SimpleNamespace(path=run, events=events))


@pytest.mark.parametrize("tiny", TINY)
def test_samples_use_the_models_defaults_where_the_prompt_leaves_them_empty(tiny, ws, tmp_path, monkeypatch):
    model = load_tiny(ws, f"builtin:{tiny}")
    defaults = model.sample_defaults()
    assert defaults == model.info.sample_defaults_for(model.family) or model.name == "flux2"
    calls = []

    def record(self, *args, **kwargs):
        calls.append((type(self.scheduler).__name__, kwargs))
        if "num_frames" in kwargs:  # a video pipeline: frames [videos, frames, H, W, 3]
            return SimpleNamespace(frames=[[Image.new("RGB", (8, 8))] * kwargs["num_frames"]])
        return SimpleNamespace(images=[Image.new("RGB", (8, 8))])

    monkeypatch.setattr(getattr(diffusers, defaults.pipeline), "__call__", record)
    (tmp_path / "samples").mkdir()
    control = tmp_path / "control.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(control)
    base = {"prompt": "a red square", "width": 64, "height": 64}
    if model.info.control_range(model.family)[0]:  # an edit model samples an edit of an image
        base["control_images"] = [str(control)]

    sample(_state(model, tmp_path, [dict(base)], "auto"))
    sample(_state(model, tmp_path, [dict(base, steps=3, cfg_scale=1.5)], "euler"))
    assert len(calls) == 2, f"{defaults.pipeline}.__call__ was not what sampled {tiny}"
    (own_sampler, empty), (chosen_sampler, given) = calls
    assert (empty[defaults.steps_arg], empty[defaults.guidance_arg]) == (defaults.steps, defaults.guidance)
    assert (given[defaults.steps_arg], given[defaults.guidance_arg]) == (3, 1.5)
    if model.info.video is not None:  # sampling.frames left at 0: the model's own length, written as an MP4
        assert empty["num_frames"] == defaults.frames and list((tmp_path / "samples").glob("*.mp4"))
    if defaults.scheduler:  # a DDPM family's default sampler
        assert own_sampler == SAMPLERS[defaults.scheduler]
    if model.objective.__class__.__name__ == "DDPMObjective":  # sampling.scheduler applies to the DDPM families
        assert chosen_sampler == SAMPLERS["euler"]
    else:  # the others always sample with their own
        assert chosen_sampler == own_sampler
    if tiny == "tiny-flux2-klein":  # the released [klein] models are step-distilled; the Base ones are not
        for distilled, key in ((True, "flux2-klein"), (False, "flux2-klein-base")):
            model._is_distilled = distilled
            assert model.sample_defaults() == model.info.sample_defaults_for(key)
