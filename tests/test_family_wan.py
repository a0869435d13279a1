"""Wan beyond the family contract: UMT5 features zero-padded as WanPipeline makes them, the transformer's inputs
equal to the pipeline's own call on non-square latents with several frames (σ·1000 in fp32; Wan 2.2 TI2V-5B's
timestep per token), images as one-frame clips and clips as they come, the single file back and forth, what detection
tells apart and refuses by name, and samples written as MP4."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("wan-ws")
    return ws, build_tiny("tiny-wan21", ws / "models")


def test_text_features_are_the_pipelines_zero_padded(wan):
    ws, paths = wan
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None)
    caption = "a red  square on a white background "  # the pipeline cleans whitespace
    features, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu",
                                     max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption, "x"]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds[:1], features)
    n = int(cond.prompt_mask[0].sum())
    assert 0 < n < features.shape[1] and features[0, n:].abs().max() == 0


@pytest.fixture(scope="module")
def wan22(wan):
    from trainer.families import build_tiny
    ws, _ = wan
    return ws, build_tiny("tiny-wan22-5b", ws / "models")


def first_transformer_call(model, run):
    """The keyword inputs and the output of the transformer's first call while ``run()`` runs a pipeline."""
    seen = {}

    def first_call(module, args, kwargs, output):
        if "kw" not in seen:
            seen.update(kw=kwargs, o=output[0])

    handle = model.transformer.register_forward_hook(first_call, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return seen["kw"], seen["o"]


@pytest.mark.parametrize("which", ["wan21", "wan22-5b"])
def test_predict_hands_the_transformer_what_the_pipeline_does(which, request):
    """One denoising call of WanPipeline at 96×128 px × 9 frames against predict on the same latents, σ and caption:
    the same keyword inputs, the timestep σ·1000 in fp32 (TI2V-5B: one per latent token, [1, F'·H'/2·W'/2]), the same
    output. Wan 2.1's latents are [1, 16, 3, 12, 16]; the 5B's VAE compresses 16× in space: [1, 48, 3, 6, 8]."""
    ws, paths = request.getfixturevalue("wan" if which == "wan21" else "wan22")
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None)
    theirs, out = first_transformer_call(model, lambda: pipe(
        "a red square", num_inference_steps=2, height=96, width=128, num_frames=9, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    x = theirs["hidden_states"]
    assert tuple(x.shape) == ((1, 16, 3, 12, 16) if which == "wan21" else (1, 48, 3, 6, 8))
    if which == "wan21":
        sigma = theirs["timestep"].float() / 1000.0
    else:  # a timestep per token, all equal in text-to-video
        assert tuple(theirs["timestep"].shape) == (1, 3 * 3 * 4) and theirs["timestep"].unique().numel() == 1
        sigma = theirs["timestep"][:, 0].float() / 1000.0
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    ours = transformer_inputs(model, x, sigma, cond)
    assert ours["timestep"].dtype == torch.float32
    torch.testing.assert_close(ours["timestep"], theirs["timestep"].float())
    torch.testing.assert_close(ours["hidden_states"], x)
    torch.testing.assert_close(ours["encoder_hidden_states"], theirs["encoder_hidden_states"])
    with torch.no_grad():
        torch.testing.assert_close(model.predict(x, sigma, cond), out)


def test_the_transformer_sees_the_timestep_in_fp32_with_bf16_weights(wan):
    ws, paths = wan
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    seen = transformer_inputs(model, torch.zeros(1, 16, 2, 4, 4, dtype=torch.bfloat16), torch.tensor([0.93796]), cond)
    assert seen["timestep"].dtype == torch.float32 and seen["timestep"].item() == pytest.approx(937.96, abs=1e-3)


def test_images_are_one_frame_clips_and_clips_pass_as_they_are(wan):
    ws, paths = wan
    model = load_tiny(ws, paths["diffusers"])
    image = model.encode_pixels(torch.rand(2, 3, 32, 48) * 2 - 1)
    assert tuple(image["mean"].shape) == (2, 16, 1, 4, 6) == (2,) + model.latent_shape(48, 32)
    clip = model.encode_pixels(torch.rand(1, 3, 9, 32, 48) * 2 - 1)
    assert tuple(clip["mean"].shape) == (1, 16, 3, 4, 6) == (1,) + model.latent_shape(48, 32, frames=9)
    latents = model.sample_latents(clip, torch.Generator().manual_seed(0))
    c = model.vae.config
    expected = (clip["mean"] - torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)) / \
        torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    assert (latents - expected).abs().max() < 10 * clip["std"].max()  # drawn around the normalised mean
    assert model.objective.shift == pytest.approx(3.0)  # the pipeline scheduler's flow_shift


def test_single_file_loads_and_fine_tunes_save_back_to_it(wan, tmp_path):
    from safetensors.torch import load_file
    ws, paths = wan
    folder = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        folder.transformer.blocks[0].attn1.to_k.weight.add_(0.5)
    out = tmp_path / "wan-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    keys = set(load_file(str(out)))
    assert {"blocks.0.self_attn.k.weight", "blocks.0.cross_attn.o.weight", "blocks.0.ffn.0.weight",
            "blocks.0.norm3.weight", "blocks.0.modulation", "head.head.weight", "head.modulation",
            "patch_embedding.weight", "text_embedding.0.weight", "time_projection.1.weight"} <= keys
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)
    # diffusers' own reader of the original layout takes the file too
    from diffusers import WanTransformer3DModel
    theirs = WanTransformer3DModel.from_single_file(str(out), config=str(paths["diffusers"]), subfolder="transformer",
                                                    local_files_only=True)
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(theirs.state_dict()[k], v, msg=k)


def test_detection_tells_the_wan_models_apart_and_refuses_those_not_trained_by_name():
    from trainer.families import Evidence
    from trainer.families.wan.detect import claim
    base = {"head.modulation": (1, 2, 32), "blocks.0.self_attn.q.weight": (32, 32)}

    def file(channels, **more):
        return claim(Evidence("single_file", "x", shapes={**base, "patch_embedding.weight": (32, channels, 1, 2, 2),
                                                          **more}))
    assert file(16) == "wan21-t2v" and file(48) == "wan22-ti2v-5b"
    # image-to-video: 36 channels (noise ‖ mask ‖ first frame); CLIP features: Wan 2.1 I2V, none: a 2.2 I2V expert
    assert file(36, **{"img_emb.proj.1.weight": (32, 1280)}) == "wan21-i2v"
    assert file(36) == "wan22-i2v-a14b"
    comfy = {"model.diffusion_model." + k: v for k, v in {**base, "patch_embedding.weight": (32, 36, 1, 2, 2),
                                                          "img_emb.proj.1.weight": (32, 1280)}.items()}
    assert claim(Evidence("single_file", "x", shapes=comfy)) == "wan21-i2v"  # ComfyUI's repackaged layout
    with pytest.raises(ValueError, match="first-last-frame"):
        file(36, **{"img_emb.proj.1.weight": (32, 1280), "img_emb.emb_pos": (1, 514, 1280)})
    with pytest.raises(ValueError, match="VACE"):
        file(16, **{"vace_blocks.0.before_proj.weight": (32, 32)})
    assert claim(Evidence("single_file", "x", shapes={"blocks.0.self_attn.q.weight": (32, 32)})) is None

    def folder(index, transformer=None):
        return claim(Evidence("hub", "x", read_json=lambda rel: {"model_index.json": index,
                                                                  "transformer/config.json": transformer}.get(rel)))
    i2v = {"_class_name": "WanImageToVideoPipeline"}
    # a hub repo whose configs cannot be read now: told by its index (the folder check runs at load)
    assert folder(dict(i2v, image_encoder=["transformers", "CLIPVisionModel"])) == "wan21-i2v"
    assert folder(dict(i2v, image_encoder=[None, None], boundary_ratio=0.9)) == "wan22-i2v-a14b"
    assert folder(dict(i2v, boundary_ratio=0.9), {"in_channels": 36, "image_dim": None}) == "wan22-i2v-a14b"
    assert folder(i2v, {"in_channels": 36, "image_dim": 1280}) == "wan21-i2v"
    with pytest.raises(ValueError, match="first-last-frame"):
        folder(i2v, {"in_channels": 36, "image_dim": 1280, "pos_embed_seq_len": 514})
    with pytest.raises(ValueError, match="WanVACEPipeline"):
        folder({"_class_name": "WanVACEPipeline"})


def test_validate_wants_a_start_image_for_each_sample_of_an_i2v_model():
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError, match="start image required") as err:
        load_config(None, ["model.path=builtin:tiny-wan21-i2v", "sampling.prompts=[{prompt: a clip}]"])
    assert err.value.key == "sampling.prompts.0.image" and "\n" not in str(err.value)
    load_config(None, ["model.path=builtin:tiny-wan22-i2v-a14b", "sampling.prompts=[{prompt: a clip, image: x.png}]"])
    load_config(None, ["model.path=builtin:tiny-wan21", "sampling.prompts=[{prompt: a clip}]"])


def test_a_run_samples_short_videos_as_mp4_with_a_png_of_the_first_frame(wan, tmp_path):
    import json

    import av

    from conftest import DEMO_DATA, train_quiet
    ws, _ = wan
    run = train_quiet(ws, "wan-samples", "demo-wan", "training.max_steps=1", "training.batch_size=1",
                      f"data.concepts=[{{path: {DEMO_DATA}}}]", "sampling.every_n_epochs=0", "sampling.at_end=true",
                      "sampling.frames=9", "sampling.prompts.0.steps=2")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    sample = [e for e in events if e["type"] == "sample"][-1]
    (png,), (mp4,) = sample["paths"], sample["videos"]
    assert png.endswith(".png") and mp4 == png[:-4] + ".mp4"
    with av.open(mp4) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        rate = container.streams.video[0].average_rate
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3) and float(rate) == 16.0
    from PIL import Image
    first = Image.open(png)
    assert first.size == (64, 64)


def test_validate_refuses_a_frame_count_the_vae_cannot_take():
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError, match="sampling.frames = 6: Wan 2.x's VAE takes 4k\\+1 frames") as err:
        load_config(None, ["model.path=builtin:tiny-wan21", "sampling.frames=6"])
    assert err.value.key == "sampling.frames"
    with pytest.raises(ConfigError, match="draws images") as err:
        load_config(None, ["model.path=builtin:tiny-sd", "sampling.frames=5"])
    assert err.value.key == "sampling.frames"
    load_config(None, ["model.path=builtin:tiny-wan21", "sampling.frames=9"])


def test_the_5b_model_is_told_apart_with_its_vae_shift_and_frame_rate(wan22):
    ws, paths = wan22
    for path in (paths["diffusers"], paths["single_file"]):
        extra = () if path == paths["diffusers"] else (f"model.config_path={paths['diffusers']}",)
        model = load_tiny(ws, path, *extra)
        assert model.family == "wan22-ti2v-5b" and model.expand_timesteps and model.fps == 24.0
        assert model.objective.shift == pytest.approx(5.0)
        assert model.latent_shape(64, 32, frames=5) == (48, 2, 2, 4)
        assert tuple(model.encode_pixels(torch.zeros(1, 3, 5, 32, 64))["mean"].shape) == (1, 48, 2, 2, 4)


@pytest.fixture(scope="module")
def a14b(wan):
    from trainer.families import build_tiny
    ws, _ = wan
    return ws, build_tiny("tiny-wan22-a14b", ws / "models")


@pytest.mark.parametrize("expert", ["high", "low"])
def test_an_a14b_expert_trains_on_its_own_noise_range_and_samples_use_both(a14b, expert):
    """musubi-tuner's --timestep_boundary: the high-noise expert sees σ ≥ the pipeline's boundary_ratio, the low-noise
    one σ below it; the other expert waits, frozen, and the sampling pipeline switches between the two as WanPipeline
    does (transformer = high, transformer_2 = low)."""
    from omegaconf import OmegaConf
    ws, paths = a14b
    model = load_tiny(ws, paths["diffusers"], f"model.wan_expert={expert}")
    assert model.family == "wan22-t2v-a14b" and model.boundary_ratio == pytest.approx(0.875)
    assert not any(p.requires_grad for p in model.other.parameters())
    lc = OmegaConf.create({"timestep_min": 0, "timestep_max": 1000, "timestep_distribution": "uniform",
                           "flow_shift": 0.0})
    sigmas = model.objective.sample_timesteps(4096, lc, torch.Generator().manual_seed(0))
    if expert == "high":
        assert sigmas.min() >= 0.875 - 1e-6 and sigmas.max() <= 1.0
    else:
        assert sigmas.max() < 0.875 and sigmas.min() >= 0.0
    pipe = model.pipeline(None)
    high, low = (pipe.transformer, pipe.transformer_2)
    assert (high is model.transformer) == (expert == "high") and (low is model.transformer) == (expert == "low")
    called = []
    for name, module in (("high", high), ("low", low)):
        module.register_forward_pre_hook(lambda m, a, kw, name=name: called.append(name), with_kwargs=True)
    with torch.no_grad():
        pipe("a red square", num_inference_steps=4, height=32, width=32, num_frames=1, guidance_scale=1.0,
             generator=torch.Generator().manual_seed(0), output_type="latent")
    assert "high" in called and "low" in called and called.index("low") > called.index("high")


def test_the_estimate_counts_the_other_a14b_expert_that_samples_bring_to_the_device(a14b):
    """A Wan 2.2 A14B sample brings the untrained expert onto the device for the pipeline's call: the VRAM estimate's
    sample phase holds it beside the trained one, and its bytes exactly."""
    from trainer.config.checks import load_config
    from trainer.memory.estimate import run_estimate
    from trainer.memory.estimate_tracker import module_tensors, storage_bytes
    ws, paths = a14b
    model = load_tiny(ws, paths["diffusers"], "model.wan_expert=low")
    assert model.sampling_modules() == [model.other]
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "model.wan_expert=low"], preset="demo-wan22-a14b")
    est = run_estimate(cfg, "demo-wan22-a14b", phases=("sample",), workspace=str(ws))
    joined = est.phases["sample"].weights - est.phases["load"].weights
    assert joined == storage_bytes(module_tensors([model.other])) > 0


def test_an_a14b_low_expert_file_loads_in_its_place(a14b, tmp_path):
    """One expert's original-layout file (ComfyUI's split files have Wan 2.1 14B's keys) with model.family telling
    what it is: with model.wan_expert = low it becomes the pipeline's transformer_2, the high expert from the folder."""
    from safetensors.torch import save_file
    from trainer.families.wan.keys import diffusers_to_original
    ws, paths = a14b
    folder = load_tiny(ws, paths["diffusers"], "model.wan_expert=low")
    low = folder.transformer
    file = tmp_path / "low.safetensors"
    save_file({k: v.contiguous() for k, v in diffusers_to_original(low.state_dict()).items()}, str(file))
    model = load_tiny(ws, file, "model.family=wan22-t2v-a14b", "model.wan_expert=low",
                      f"model.config_path={paths['diffusers']}")
    assert model.family == "wan22-t2v-a14b"
    for k, v in low.state_dict().items():
        torch.testing.assert_close(model.transformer.state_dict()[k], v, msg=k)
    for k, v in folder.other.state_dict().items():  # the high expert comes from the folder
        torch.testing.assert_close(model.other.state_dict()[k], v, msg=k)


def test_both_a14b_experts_each_sample_goes_to_the_expert_of_its_timestep(a14b):
    ws, paths = a14b
    model = load_tiny(ws, paths["diffusers"], "model.wan_expert=both")
    two = model.transformer
    assert model.other is None and model.objective.sigma_range is None
    cond = model.batch_condition({"captions": ["a red square", "a blue circle"]}, lambda c: c, set())
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.95, 0.3])  # the first sample is the high expert's, the second the low one's
    with torch.no_grad():
        both = model.predict(x, sigma, cond)
        embeds = cond.prompt_embeds
        for i, expert in ((0, two.high), (1, two.low)):
            own = expert(hidden_states=x[i:i + 1], timestep=sigma[i:i + 1] * 1000,
                         encoder_hidden_states=embeds[i:i + 1], return_dict=False)[0]
            torch.testing.assert_close(both[i:i + 1], own)
    pipe = model.pipeline(None)
    assert pipe.transformer is two.high and pipe.transformer_2 is two.low


@pytest.mark.slow
def test_both_a14b_experts_train_into_two_files_each_loading_into_its_expert(a14b, tmp_path):
    from safetensors import safe_open
    from conftest import DEMO_DATA, train_quiet
    ws, paths = a14b
    run = train_quiet(ws, "wan-both", "demo-wan22-a14b", "model.wan_expert=both", "training.max_steps=4",
                      "training.batch_size=2", "training.learning_rate=0.01", "sampling.prompts=[]",
                      f"data.concepts=[{{path: {DEMO_DATA}}}]", "lora.unet_targets=attn_mlp")
    high, low = run / f"{run.name}.safetensors", run / f"{run.name}_low_noise.safetensors"
    for path, expert in ((high, "high"), (low, "low")):
        with safe_open(str(path), framework="pt") as fh:
            assert fh.metadata()["wan.expert"] == expert
            keys = set(fh.keys())
        assert keys and all(k.startswith("diffusion_model.blocks.") for k in keys), sorted(keys)[:3]
    model = load_tiny(ws, paths["diffusers"], "model.wan_expert=both")
    pipe = model.pipeline(None)

    def video():
        return pipe("a red square", num_inference_steps=4, height=32, width=32, num_frames=1,
                    generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    before = video()
    pipe.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True)
    assert pipe.transformer_2.peft_config and not getattr(pipe.transformer, "peft_config", None)
    with_low = video()
    pipe.load_lora_weights(str(high), adapter_name="high")
    assert abs(with_low - before).max() > 1e-4 and abs(video() - with_low).max() > 1e-4


@pytest.mark.slow
def test_the_sample_tool_writes_a_video_model_sample_as_mp4_beside_its_first_frame(wan, tmp_path, capsys):
    import av

    from trainer.__main__ import main
    ws, _ = wan
    out = tmp_path / "out"
    assert main(["sample", "builtin:tiny-wan21", "--prompt", "a red square", "--steps", "2", "--width", "64",
                 "--height", "64", "--out", str(out), "--workspace", str(ws)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "000-42.mp4") in printed and str(out / "000-42.png") in printed
    with av.open(str(out / "000-42.mp4")) as container:
        assert sum(1 for _ in container.decode(video=0)) == 81  # WanPipeline's own length


@pytest.mark.slow
@pytest.mark.parametrize("preset, settings", [
    ("demo-wan", ("parts.denoiser.fp8=true", "data.offload_text_encoders=true")),
    ("demo-wan22-5b", ("parts.denoiser.nf4=true",)),
    ("demo-wan22-a14b", ("model.wan_expert=both", "parts.denoiser.blocks_to_swap=1",
                         "training.gradient_checkpointing=true")),
], ids=["fp8-offload", "5b-nf4", "a14b-both-swap"])
def test_the_memory_features_train_wan(preset, settings, wan, a14b, wan22):
    """Frozen weights in fp8/NF4, UMT5 offloaded, block swapping (over both A14B experts' blocks) with gradient
    checkpointing: a few steps run and the LoRA file is written (the GPU numbers are bench/'s)."""
    from conftest import DEMO_DATA, train_quiet
    ws, _ = wan
    run = train_quiet(ws, f"wan-mem-{preset}", preset, "training.max_steps=2", "sampling.prompts=[]",
                      f"data.concepts=[{{path: {DEMO_DATA}}}]", *settings)
    assert (run / f"{run.name}.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("told", [True, False], ids=["family-from-path", "family-told-by-loading"])
def test_a_folder_of_clips_trains_wan_on_5_frame_windows(told, wan, tmp_path, monkeypatch):
    """What a user does: a concept folder of clips with captions beside them. Each clip is cut into 5-frame windows at
    16 fps and the transformer trains on 5-D latents of 2 latent frames (1 + 4/4). Where the family is told only by
    loading the model (a hub id), the clips count once it has loaded."""
    from conftest import train_quiet
    from test_data_clips import make_clip

    import trainer.train.setup as setup
    from trainer.events import read_events
    from trainer.families.wan.family import Wan
    folder = tmp_path / "clips"
    for i, name in enumerate(("waves", "trees")):
        make_clip(folder / f"{name}.mp4", 24, fps=16, size=(64, 64), paint=lambda f, i=i: (40 * i + 8 * f, 90, 200))
        (folder / f"{name}.txt").write_text(f"a clip of {name}\n")
    if not told:
        monkeypatch.setattr(setup, "family_without_loading", lambda *a, **k: None)
    frames = []
    original = Wan.predict

    def spy(self, model_input, timesteps, conditioning):
        frames.append(tuple(model_input.shape))
        return original(self, model_input, timesteps, conditioning)

    monkeypatch.setattr(Wan, "predict", spy)
    ws, _ = wan
    run = train_quiet(ws, f"wan-clips-{told}", "demo-wan", "training.max_steps=3", "sampling.prompts=[]",
                      f"data.concepts=[{{path: {folder}, target_frames: '5', frame_extraction: chunk}}]")
    assert frames and all(len(s) == 5 and s[2] == 2 and s[3:] == (8, 8) for s in frames), frames
    losses = [e["loss"] for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert (run / f"{run.name}.safetensors").is_file()


# --- image-to-video ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def i2v(wan):
    from trainer.families import build_tiny
    ws, _ = wan
    return ws, {k: build_tiny(k, ws / "models") for k in ("tiny-wan21-i2v", "tiny-wan22-i2v-a14b")}


@pytest.mark.parametrize("which", ["tiny-wan21-i2v", "tiny-wan22-i2v-a14b"])
def test_i2v_predict_hands_the_transformer_what_the_pipeline_builds_from_a_start_image(which, i2v):
    """WanImageToVideoPipeline's first call at 64×96 px × 9 frames from a start image against model_input + predict
    on the same noisy latents, σ, caption and start frame (as a training window's first frame): the 36 channels
    noise ‖ mask ‖ first-frame latents, the CLIP features of Wan 2.1 (none for 2.2), the same output."""
    import numpy as np
    from PIL import Image
    ws, paths = i2v
    model = load_tiny(ws, paths[which]["diffusers"], *(("model.wan_expert=high",) if "a14b" in which else ()))
    assert model.family == ("wan21-i2v" if which == "tiny-wan21-i2v" else "wan22-i2v-a14b")
    pipe = model.pipeline(None)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    theirs, out = first_transformer_call(model, lambda: pipe(
        "a red square", image=image, num_inference_steps=2, height=64, width=96, num_frames=9, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="latent"))
    x = theirs["hidden_states"]
    assert tuple(x.shape) == (1, 36, 3, 8, 12)
    # the start frame as a training window's first frame: pixels in [-1, 1], the other frames anything
    frame = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1.0
    window = torch.rand(1, 3, 9, 64, 96) * 2 - 1
    window[:, :, 0] = frame
    batch = {"captions": ["a red square"], "first_frame": model.encode_first_frames(window)}
    ours_x = model.model_input(x[:, :16], batch)
    torch.testing.assert_close(ours_x, x)
    sigma = theirs["timestep"].float() / 1000.0
    cond = model.batch_condition(batch, lambda c: c, set())
    ours = transformer_inputs(model, ours_x, sigma, cond)
    if which == "tiny-wan21-i2v":
        torch.testing.assert_close(ours["encoder_hidden_states_image"], theirs["encoder_hidden_states_image"])
    else:
        assert theirs["encoder_hidden_states_image"] is None and "encoder_hidden_states_image" not in ours
    torch.testing.assert_close(ours["encoder_hidden_states"], theirs["encoder_hidden_states"])
    with torch.no_grad():
        torch.testing.assert_close(model.predict(ours_x, sigma, cond), out)


@pytest.mark.parametrize("cached", [True, False])
def test_each_window_brings_its_own_first_frame_cached_beside_its_latents(tmp_path, cached):
    """An image-to-video model's condition comes from each training window's first frame (rendered as the window is):
    batches carry ``first_frame_fn``'s output for it; with cached latents it sits in entries of its own, keyed like
    the latents (another settings key), filled once and reused."""
    from test_data_clips import WAN, FakeWanVae, _cfg, frame_number, make_clip

    from trainer.data.pipeline import DataPipeline
    folder = tmp_path / "c"
    for name in ("a", "b"):
        make_clip(folder / f"{name}.mp4", 27, fps=16)
    calls = []

    def first_frame_fn(pixels):
        calls.append(tuple(pixels.shape))
        return {"latents": pixels[:, :, 0, :8, :8].float().clone()}

    cfg = _cfg(tmp_path, {"path": str(folder), "target_frames": "9", "frame_extraction": "chunk"}, batch_size=2,
               cache_latents=cached)
    pipe = DataPipeline(cfg, warn=lambda m: None, video=WAN)
    summary = pipe.prepare(FakeWanVae(), fingerprint="wan-test", vae_dtype="fp32", first_frame_fn=first_frame_fn)
    seen = {}
    for plan in pipe.epoch_batches(0):
        batch = pipe.batch(plan, 0)
        for row, index in enumerate(plan.indices):
            item = pipe.items[index]
            seen[(item.path.name, item.window.start)] = frame_number(
                ((batch["first_frame"]["latents"][row, :, 4, 4] + 1) * 127.5).round().tolist())
    assert seen == {(n, s): s for n in ("a.mp4", "b.mp4") for s in (0, 9, 18)}
    assert all(shape[2] == 9 for shape in calls)  # the whole window: its frame count sets the condition's length
    if cached:
        assert summary["first_frames_encoded"] == 3  # the two clips have the same bytes: one entry per window
        item = pipe.items[0]
        entry = pipe._entry(item, (64, 64), pipe.variant_params(item, 0))
        assert pipe.cache.entry_path(item, *entry) != pipe.first_frame_cache.entry_path(item, *entry)
        assert pipe.first_frame_cache.entry_path(item, *entry).is_file()
        again = DataPipeline(cfg, warn=lambda m: None, video=WAN)
        assert again.prepare(FakeWanVae(), fingerprint="wan-test", vae_dtype="fp32",
                             first_frame_fn=first_frame_fn)["first_frames_encoded"] == 0


@pytest.mark.slow
def test_an_i2v_run_samples_videos_that_start_from_the_prompts_image(i2v, tmp_path, capsys):
    """A run of the I2V demo draws its sample from the prompt's start image (an MP4 beside the PNG of its first
    frame); the sample tool wants --image for such a model, in one line."""
    import json

    from conftest import DEMO_DATA, train_quiet
    from trainer.__main__ import main
    ws, _ = i2v
    run = train_quiet(ws, "wan-i2v-sample", "demo-wan21-i2v", "training.max_steps=1", "sampling.every_n_epochs=0",
                      "sampling.frames=5", f"data.concepts=[{{path: {DEMO_DATA}}}]",
                      f"sampling.prompts=[{{prompt: a red square, image: {DEMO_DATA / '00-red-square.png'}, "
                      "steps: 1, width: 64, height: 64}]")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    videos = [v for e in events if e["type"] == "sample" for v in e.get("videos", [])]
    assert videos and all(v.endswith(".mp4") and (run / "samples" / v.split("/")[-1]).is_file() for v in videos)
    # the image key/value of the cross-attention train too (k_img/v_img), and diffusers' loader maps them
    from safetensors import safe_open
    with safe_open(str(run / f"{run.name}.safetensors"), framework="pt") as fh:
        assert "diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight" in set(fh.keys())
    pipe = load_tiny(ws, "builtin:tiny-wan21-i2v").pipeline(None)
    pipe.load_lora_weights(str(run / f"{run.name}.safetensors"))
    assert hasattr(pipe.transformer.blocks[0].attn2.add_k_proj, "lora_A")
    capsys.readouterr()
    assert main(["sample", "builtin:tiny-wan21-i2v", "--prompt", "a red square", "--steps", "1", "--width", "32",
                 "--height", "32", "--out", str(tmp_path / "out"), "--workspace", str(ws)]) != 0
    err = capsys.readouterr().err
    assert "--image: start image required" in err and len(err.strip().splitlines()) == 1
