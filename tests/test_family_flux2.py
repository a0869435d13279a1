"""Flux.2 beyond the family contract: Qwen3 layers and latents as the pipeline makes them, Flux.2 [dev]'s processor
folder read as its tokenizer and its embedded guidance, the transformer as one file, reference images (the
transformer's inputs as the pipeline builds them; a LoRA trained with references)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("flux2-ws")
    return ws, build_tiny("tiny-flux2-klein", ws / "models")


def test_text_and_latents_are_the_pipelines(klein):
    ws, paths = klein
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square on a white background"
    sampler = model.pipeline(None)
    embeds, _ = sampler.encode_prompt(caption, device="cpu", max_sequence_length=model.max_sequence_length,
                                      text_encoder_out_layers=model.text_layers)
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    # the training latent is what the pipeline's decode turns back: unpatchify(latent · bn_std + bn_mean)
    from diffusers import Flux2KleinPipeline
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    dist = model.encode_pixels(pixels)
    latent = model.sample_latents(dist, torch.Generator().manual_seed(0))
    bn, eps = model.vae.bn, model.vae.config.batch_norm_eps
    z = latent * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps) + bn.running_mean.view(1, -1, 1, 1)
    noise = torch.randn(dist["mean"].shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(z, dist["mean"] + dist["std"] * noise, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        direct = model.vae.encode(pixels).latent_dist.mean
    torch.testing.assert_close(Flux2KleinPipeline._unpatchify_latents(dist["mean"]), direct, atol=1e-5, rtol=1e-5)


def test_flux2_dev_reads_its_processor_folder_and_embeds_guidance(tmp_path):
    """[dev]'s tokenizer/ is a PixtralProcessor folder (model_index names it; the processor needs torchvision): read as
    a tokenizer, with the processor's chat template when the tokenizer has none, it gives the features the same
    tokenizer with the template built in gives; the transformer gets the guidance embedding (model.guidance_scale),
    which changes its output."""
    import shutil

    from trainer.families import build_tiny
    paths = build_tiny("tiny-flux2-dev", tmp_path / "models")
    model = load_tiny(tmp_path, paths["diffusers"])
    assert model.family == "flux2-dev" and model.dev and model.text_layers == (1, 2, 3)
    captions = ["a photo of sks", "a red square"]
    ours = model.encode_captions(captions)["prompt_embeds"]
    bare = tmp_path / "processor-only"
    shutil.copytree(paths["diffusers"], bare)
    config = json.loads((bare / "tokenizer" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)
    again = load_tiny(tmp_path, bare)
    assert again.tokenizer.chat_template  # from chat_template.json, the processor's
    torch.testing.assert_close(again.encode_captions(captions)["prompt_embeds"], ours)

    from trainer.families.flux2.family import Flux2Conditioning
    x = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.5])
    cond = Flux2Conditioning(ours[:1])
    with torch.no_grad():
        pred = model.predict(x, t, cond)
        model.guidance = 4.0
        other = model.predict(x, t, cond)
    assert pred.shape == x.shape and (pred - other).abs().max() > 1e-4


def test_the_transformer_alone_loads_and_fine_tunes_save_back_to_it(klein, tmp_path):
    ws, paths = klein
    folder = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "klein-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    assert again.family == "flux2-klein"
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_caption_encoding_skips_the_vocabulary_logits(tmp_path):
    """Only Qwen3's hidden states are used: its lm_head runs on one position, not on every token, and the features are
    the ones the pipeline's own encode gives."""
    import torch
    from diffusers import Flux2KleinPipeline

    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    cfg = load_config(None, ["model.path=builtin:tiny-flux2-klein", f"general.workspace={tmp_path}"])
    model = load_model(cfg, str(tmp_path), "cpu")
    seen = []
    handle = model.text_encoder.lm_head.register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    ours = model.encode_captions(["a photo of sks", "a red square"])["prompt_embeds"]
    assert seen and all(shape[1] == 1 for shape in seen), seen
    handle.remove()
    for h in list(model.text_encoder._forward_pre_hooks):  # the pipeline's own call, every logit computed
        model.text_encoder._forward_pre_hooks.pop(h)
    with torch.no_grad():
        ref = Flux2KleinPipeline._get_qwen3_prompt_embeds(model.text_encoder, model.tokenizer, ["a photo of sks", "a red square"],
                                                          max_sequence_length=model.max_sequence_length,
                                                          hidden_states_layers=model.text_layers)
    torch.testing.assert_close(ours, ref.float())


# --- reference images -------------------------------------------------------------------------------------------

def _picture(seed: int, width: int, height: int):
    import numpy as np
    from PIL import Image
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _pixels(image):
    """[1, 3, H, W] in [-1, 1], as the data core renders an image at its own size."""
    import numpy as np
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 127.5 - 1


def _transformer_inputs(model):
    """Record every transformer call's keyword arguments (hidden_states, img_ids, txt_ids …)."""
    seen = []
    hook = model.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append({k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)}),
        with_kwargs=True)
    return seen, hook


@pytest.mark.parametrize("sizes", [[(64, 64)], [(64, 64), (96, 64)]], ids=["one", "two"])
def test_reference_images_reach_the_transformer_as_the_pipeline_builds_them(klein, sizes):
    """The pipeline's first denoising call with ``image=`` (one reference; two of different sizes) and the training
    step's call on the same noise, timestep and images (their cached posteriors, as ``batch["control_latents"]``) give
    the transformer the same sequence: the target's tokens, then each reference's, normalised by the VAE's BatchNorm
    statistics and packed in row order, with the ids (10 + 10·k, h, w, 0) over each reference's own grid."""
    ws, paths = klein
    model = load_tiny(ws, paths["diffusers"])
    images = [_picture(k, w, h) for k, (w, h) in enumerate(sizes)]
    noise = torch.randn(1, 128, 16, 16, generator=torch.Generator().manual_seed(0))
    seen, hook = _transformer_inputs(model)
    model.pipeline(None)("a red square", image=images, latents=noise.clone(), num_inference_steps=1, width=64,
                         height=64, guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
    ref = seen[0]
    seen.clear()
    batch = {"captions": ["a red square"], "control_latents": [model.encode_pixels(_pixels(im)) for im in images]}
    cond = model.batch_condition(batch, lambda c: c, set())
    with torch.no_grad():
        model.predict(model.model_input(noise.clone(), batch), ref["timestep"], cond)
    hook.remove()
    ours = seen[0]
    grids = [(h // 4, w // 4) for w, h in sizes]  # the tiny VAE halves, the 2×2 patch halves again
    n = 16 * 16 + sum(h * w for h, w in grids)
    assert ref["hidden_states"].shape == ours["hidden_states"].shape == (1, n, 128)
    for key in ("img_ids", "txt_ids", "timestep"):
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(ours["hidden_states"], ref["hidden_states"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["encoder_hidden_states"], ref["encoder_hidden_states"])
    start = 16 * 16
    for k, (h, w) in enumerate(grids):  # each reference: its own time offset and grid, from 0
        ids = ours["img_ids"][0, start:start + h * w]
        assert set(ids[:, 0].tolist()) == {10 + 10 * k} and ids[:, 1].max() == h - 1 and ids[:, 2].max() == w - 1
        start += h * w
    # several processes: the step draws for the global micro-batch and each process keeps its rows of the input
    from trainer.parallel.distributed import expand_rows, take_rows
    rows = (1, 2, 2)
    mine = take_rows(model.model_input(expand_rows(noise, rows), dict(batch, global_rows=rows)), rows)
    alone = model.model_input(noise, batch)
    for a, b in zip((mine.latents, *mine.references), (alone.latents, *alone.references)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.mark.slow
def test_a_lora_trained_with_references_loads_in_the_pipeline_and_changes_what_it_draws(klein, tmp_path,
                                                                                          monkeypatch):
    """Two shapes, each with a reference of the same name in a control folder: the training step gives the
    transformer the references (and samples during the run pass the prompt's control_images); the LoRA file has the
    keys a LoRA without references has (the same modules: nothing new for ComfyUI to drop); loaded with
    Flux2KleinPipeline.load_lora_weights it changes what the pipeline draws from a reference."""
    import shutil

    from PIL import ImageOps

    from conftest import DEMO_DATA, train_quiet
    from trainer.families.flux2.family import Flux2
    from trainer.families.flux2.references import Flux2Input

    ws, paths = klein
    data, refs = tmp_path / "targets", tmp_path / "refs"
    data.mkdir()
    refs.mkdir()
    for name in ("00-red-square", "03-blue-circle"):
        shutil.copy(DEMO_DATA / f"{name}.png", data / f"{name}.png")
        shutil.copy(DEMO_DATA / f"{name}.txt", data / f"{name}.txt")
        ImageOps.invert(Image.open(DEMO_DATA / f"{name}.png").convert("RGB")).save(refs / f"{name}.jpg")
    sample_ref = refs / "00-red-square.jpg"

    calls = []
    original = Flux2.model_input

    def spy(self, noisy, batch, *args, **kwargs):
        out = original(self, noisy, batch, *args, **kwargs)
        calls.append(len(out.references) if isinstance(out, Flux2Input) else 0)
        return out

    monkeypatch.setattr(Flux2, "model_input", spy)
    run = train_quiet(ws, "refs", "demo-flux2-klein", f"data.concepts=[{{path: {data}, control_paths: [{refs}]}}]",
                      "training.max_steps=4", "training.batch_size=2", "training.learning_rate=0.01",
                      "lora.rank=4", "lora.alpha=4", "sampling.every_n_epochs=0", "sampling.every_n_steps=4",
                      f"sampling.prompts=[{{prompt: a red square, steps: 2, cfg_scale: 1.0, width: 64, height: 64, "
                      f"control_images: [{sample_ref}]}}]")
    monkeypatch.undo()
    assert calls and all(n == 1 for n in calls), calls
    assert len(list((run / "samples").glob("*.png"))) == 1
    lora = run / f"{run.name}.safetensors"
    trained = _tensors(lora)

    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    cfg = load_config(run / "config.yaml")
    plain = LoraMethod(load_tiny(ws, paths["diffusers"]), cfg).adapter_state_dict()
    assert set(trained) == set(plain) and all(k.startswith("diffusion_model.") for k in trained)

    pipe = load_tiny(ws, paths["diffusers"]).pipeline(None)

    def draw():
        return pipe("a red square", image=[Image.open(sample_ref).convert("RGB")], num_inference_steps=2, width=64,
                    height=64, guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np",
                    max_sequence_length=512, text_encoder_out_layers=(1, 2, 3)).images[0]

    before = draw()
    pipe.load_lora_weights(str(lora))
    assert abs(draw() - before).max() > 1e-3


def test_the_transformer_sees_sigma_in_fp32_as_diffusers_flux2_trainer_passes_it(klein):
    """train_dreambooth_lora_flux2*.py pass ``timesteps / 1000`` of the fp32 schedule (a bf16 σ would be 0.9375 for
    0.93796); the transformer casts it to its hidden states' dtype itself."""
    from trainer.families.flux2.family import Flux2Conditioning
    ws, paths = klein
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    embeds = model.encode_captions(["a red square"])["prompt_embeds"]
    seen = transformer_inputs(model, torch.zeros(1, 128, 4, 6, dtype=torch.bfloat16), torch.tensor([0.93796]),
                              Flux2Conditioning(embeds))
    assert seen["timestep"].dtype == torch.float32 and seen["timestep"].item() == pytest.approx(0.93796, abs=1e-7)


def test_flux2_dev_trains_at_model_guidance_scale_as_flux2_pipeline_feeds_it(tmp_path):
    """Flux2Pipeline's denoising call at ``guidance_scale`` g and ``predict`` on the same latents and σ with
    ``model.guidance_scale`` = g: the same guidance (fp32), tokens, ids and timestep, and the same prediction, on
    non-square latents. The default is 3.5, train_dreambooth_lora_flux2.py's ``--guidance_scale``."""
    from trainer.families import build_tiny
    from trainer.families.flux2.family import Flux2Conditioning
    paths = build_tiny("tiny-flux2-dev", tmp_path / "models")
    assert load_tiny(tmp_path, paths["diffusers"]).guidance == 3.5
    model = load_tiny(tmp_path, paths["diffusers"], "model.guidance_scale=2.5")
    noise = torch.randn(1, 128, 8, 12, generator=torch.Generator().manual_seed(0))
    seen, hook = _transformer_inputs(model)
    outs = []
    post = model.transformer.register_forward_hook(lambda m, a, out: outs.append(out[0].clone()))
    with torch.no_grad():
        model.pipeline(None)("a red square", latents=noise.clone(), num_inference_steps=1, width=48, height=32,
                             guidance_scale=2.5, output_type="latent", **model.sampling_kwargs())
        ref = seen[0]
        seen.clear()
        embeds = model.encode_captions(["a red square"])["prompt_embeds"]
        pred = model.predict(noise.clone(), ref["timestep"], Flux2Conditioning(embeds))
    hook.remove()
    post.remove()
    ours = seen[0]
    assert ref["guidance"].tolist() == [2.5] and ours["guidance"].dtype == torch.float32
    for key in ("guidance", "hidden_states", "img_ids", "txt_ids", "encoder_hidden_states", "timestep"):
        torch.testing.assert_close(ours[key], ref[key].to(ours[key].dtype), msg=key)
    torch.testing.assert_close(pred, outs[0].permute(0, 2, 1).reshape(1, 128, 8, 12))


def test_training_sigma_is_drawn_as_diffusers_flux2_trainer_draws_it(klein):
    """train_dreambooth_lora_flux2.py (``--weighting_scheme none``): u ~ U[0, 1), ``indices = (u · 1000).long()``,
    ``timesteps = scheduler.timesteps[indices]`` with the scheduler's unshifted timesteps (it skips its shift under
    ``use_dynamic_shifting``), σ = timesteps / 1000: median 0.50, quartiles 0.25 / 0.75, whatever the resolution.
    The pipeline's ``compute_empirical_mu`` at 50 steps put the median at 0.88 for a 1024² image."""
    ws, paths = klein
    model = load_tiny(ws, paths["diffusers"])
    assert model._sched_config["use_dynamic_shifting"]
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    schedule = torch.linspace(1, 1000, 1000).flip(0)  # FlowMatchEulerDiscreteScheduler's training timesteps, unshifted
    anchor = schedule[(u * 1000).long()] / 1000
    lc = _default_loss()
    for side in (64, 16):  # 1024² px and 256² px for the released VAE (patchified latents of 64² and 16² tokens)
        latents = torch.zeros(1, 128, side, side).expand(n, -1, -1, -1)
        ours = model.objective.sample_timesteps(n, lc, torch.Generator().manual_seed(1), latents)
        for q in (0.1, 0.25, 0.5, 0.75, 0.9):
            assert abs(float(ours.quantile(q)) - float(anchor.quantile(q))) < 0.015, (side, q)
        assert float((ours > 0.8).float().mean()) == pytest.approx(0.2, abs=0.015)


def _default_loss():
    """The default ``loss`` section, as the loop hands it to the objective."""
    from omegaconf import OmegaConf

    from trainer.config.schema import AtelierConfig
    return OmegaConf.structured(AtelierConfig).loss


def test_klein_predict_is_the_transformer_call_of_flux2_klein_pipeline(klein):
    """Flux2KleinPipeline's denoising step (no CFG at guidance 1, no guidance embedding): the patchified latents'
    tokens in row order with ids (0, row, column, 0), text ids (0, 0, 0, k), ``timestep = t / 1000`` (σ of its
    shifted schedule). ``predict`` on the same noisy latents, the scheduler's σ and the caption's features gives the
    same velocity; on 8×12 patchified latents, so ids with height and width swapped would show."""
    from trainer.families.flux2.family import Flux2Conditioning
    ws, paths = klein
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None)
    h, w = 8, 12
    noise = torch.randn(1, 128, h, w, generator=torch.Generator().manual_seed(0))
    inner = getattr(pipe, "pipe", pipe)  # the diffusers pipeline inside the prompt-first wrapper
    vsf = 2 * inner.vae_scale_factor  # pixels per patchified latent
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", latents=noise.clone(), num_inference_steps=2, width=w * vsf, height=h * vsf,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]["kwargs"]
            sigma = inner.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1 and ref["guidance"] is None
            torch.testing.assert_close(ref["timestep"], sigma)
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            ids = torch.stack([torch.zeros_like(rows), rows, cols, torch.zeros_like(rows)], -1).reshape(1, -1, 4)
            torch.testing.assert_close(ref["img_ids"], ids, rtol=0, atol=0)
            noisy = ref["hidden_states"].permute(0, 2, 1).reshape(1, 128, h, w)
            embeds = model.encode_captions(["a red square"])["prompt_embeds"]
            pred = model.predict(noisy, sigma, Flux2Conditioning(embeds))
    finally:
        remove()
    torch.testing.assert_close(pred, calls[1]["out"].permute(0, 2, 1).reshape(1, 128, h, w))


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_fine_tunes_are_bfls_single_file_that_comfyui_detects_and_diffusers_reads(klein, variant, tmp_path):
    """A fine-tune is saved in BFL's layout (the released files'): ComfyUI's ``detect_unet_config``
    (comfy/model_detection.py, upstream 2026-01-07) takes a file for Flux.2 on ``double_blocks.0.img_attn.norm.
    key_norm.scale`` (or ``.weight``), ``img_in.weight`` and ``double_stream_modulation_img.lin.weight``, reads
    in_channels and the width from ``img_in.weight``, the text width from ``txt_in.weight``, the depths by counting
    ``double_blocks.N.`` / ``single_blocks.N.``, and [dev]'s guidance from ``guidance_in.in_layer.weight``; under
    diffusers' names it found none of them. ``Flux2Transformer2DModel.from_single_file`` (diffusers' converter) and
    Atelier load the file back to the very weights."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from trainer.families import build_tiny
    if variant == "klein":
        ws, paths = klein
    else:
        ws, paths = tmp_path, build_tiny("tiny-flux2-dev", tmp_path / "models")
    model = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        model.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
        model.transformer.norm_out.linear.weight[:4].add_(1.0)  # (scale, shift) halves: BFL swaps them
    out = tmp_path / "ft.safetensors"
    model.save_single_file(out, "fp32", {})
    state = load_file(str(out))
    cfg = model.transformer.config
    assert {"double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight",
            "double_stream_modulation_img.lin.weight", "txt_in.weight"} <= set(state)
    assert tuple(state["img_in.weight"].shape) == (cfg.num_attention_heads * cfg.attention_head_dim, cfg.in_channels)
    assert state["txt_in.weight"].shape[1] == cfg.joint_attention_dim

    def count(prefix):
        return len({k.split(".")[1] for k in state if k.startswith(prefix)})
    assert (count("double_blocks."), count("single_blocks.")) == (cfg.num_layers, cfg.num_single_layers)
    assert ("guidance_in.in_layer.weight" in state) == (variant == "dev") == cfg.guidance_embeds
    assert not [k for k in state if k.startswith(("transformer_blocks.", "single_transformer_blocks.", "x_embedder"))]

    ours = model.transformer.state_dict()
    theirs = Flux2Transformer2DModel.from_single_file(str(out), config=str(paths["diffusers"]), subfolder="transformer",
                                                      local_files_only=True).state_dict()
    assert set(theirs) == set(ours)
    for k, v in ours.items():
        torch.testing.assert_close(theirs[k], v, rtol=0, atol=0, msg=k)
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    assert again.family == model.family
    for k, v in ours.items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, rtol=0, atol=0, msg=k)
