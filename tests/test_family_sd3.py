"""Stable Diffusion 3/3.5 beyond the family contract: the three encoders as the pipeline assembles them, T5 off,
per-encoder caption dropout, the single file diffusers reads back, and what validate refuses."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("sd3-ws")
    return ws, build_tiny("tiny-sd3", ws / "models")


def test_conditioning_is_the_pipelines_and_each_encoder_drops_alone(sd3):
    ws, paths = sd3
    model = load_tiny(ws, paths["diffusers"])
    assert model.family == "sd3.5-medium"
    caption = "a red square on a white background"
    pipe = model.pipeline(None)
    embeds, _, pooled, _ = pipe.encode_prompt(caption, caption, caption, device="cpu", num_images_per_prompt=1,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    torch.testing.assert_close(cond.pooled_prompt_embeds, pooled)
    # CLIP-G dropped alone: its columns become the empty caption's, CLIP-L's and T5's stay
    empty = model.batch_condition({"captions": [""]}, lambda c: c, set())
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te2=[True])
    wl = model.text_encoder.config.hidden_size
    wg = model.text_encoder_2.config.hidden_size
    clip_tokens = model.tokenizer.model_max_length
    torch.testing.assert_close(dropped.prompt_embeds[:, :clip_tokens, wl:wl + wg],
                               empty.prompt_embeds[:, :clip_tokens, wl:wl + wg])
    torch.testing.assert_close(dropped.prompt_embeds[:, :clip_tokens, :wl], cond.prompt_embeds[:, :clip_tokens, :wl])
    torch.testing.assert_close(dropped.prompt_embeds[:, clip_tokens:], cond.prompt_embeds[:, clip_tokens:])


def test_t5_off_is_not_loaded_and_trains_and_samples_with_zeros(sd3):
    ws, paths = sd3
    model = load_tiny(ws, paths["diffusers"], "parts.text_encoder_3.enabled=false")
    assert model.text_encoder_3 is None
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    assert not cond.prompt_embeds[:, model.tokenizer.model_max_length:].any()
    pipe = model.pipeline(None)
    assert pipe.text_encoder_3 is None
    embeds, _, _, _ = pipe.encode_prompt("a red square", "a red square", "a red square", device="cpu",
                                         num_images_per_prompt=1, do_classifier_free_guidance=False,
                                         max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond.prompt_embeds, embeds)


def test_fine_tune_single_file_is_stabilitys_layout_that_diffusers_reads(sd3, tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file
    ws, paths = sd3
    model = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        model.transformer.transformer_blocks[-1].norm1_context.linear.bias.add_(torch.arange(
            model.transformer.transformer_blocks[-1].norm1_context.linear.bias.numel()) * 0.01)  # shows a half swap
    out = tmp_path / "sd35.safetensors"
    model.save_single_file(out, "fp32", {})
    keys = set(load_file(str(out)))
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in keys
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in keys  # 3.5 medium's second attention
    again = SD3Transformer2DModel.from_single_file(str(out), config=str(paths["diffusers"]), subfolder="transformer")
    mine = model.transformer.state_dict()
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, mine[k], msg=k)


@pytest.mark.parametrize("setting, key", [("parts.text_encoder_3.train=true", "parts.text_encoder_3.train"),
                                          ("loss.min_snr_gamma=5", "loss.min_snr_gamma"),
                                          ("model.prediction_type=epsilon", "model.prediction_type")])
def test_validate_refuses_what_sd3_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-sd3", setting])
    assert err.value.key == key, str(err.value)


def test_single_files_tell_the_variant():
    from trainer.families import Evidence, claim
    base = {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(6, 2)}
    cases = {"sd3-medium": {}, "sd3.5-large": {"model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight":
                                               torch.zeros(2)},
             "sd3.5-medium": {"model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight": torch.zeros(2),
                              "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight": torch.zeros(6, 2)}}
    for variant, extra in cases.items():
        shapes = {k: tuple(v.shape) for k, v in {**base, **extra}.items()}
        assert claim(Evidence("single_file", "x", shapes=shapes)) == variant


def test_fp8_storage_takes_the_blocks_modulation_but_not_the_final_one(tmp_path):
    """SD 3.5's AdaLN modulation Linears (norm1.linear, norm1_context.linear: ~2.7B of large's 8.1B) are stored in fp8
    with the attention and MLP (as sd-scripts' fp8_base does); the final norm_out and the embedders stay; a step runs."""
    import torch

    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.memory.precision import enable_fp8_storage
    cfg = load_config(None, ["model.path=builtin:tiny-sd3", f"general.workspace={tmp_path}"])
    model = load_model(cfg, str(tmp_path))
    assert enable_fp8_storage(model.transformer, torch.float32, model.fp8_skip) > 0
    t, fp8 = model.transformer, torch.float8_e4m3fn
    assert t.transformer_blocks[0].norm1.linear.weight.dtype == fp8
    assert t.transformer_blocks[0].norm1_context.linear.weight.dtype == fp8
    assert t.norm_out.linear.weight.dtype != fp8 and t.context_embedder.weight.dtype != fp8
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = model.batch_condition({"captions": ["a photo of sks"]}, lambda captions: captions, set())
        out = model.predict(x, torch.tensor([0.5]), cond)
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_the_transformer_sees_the_timestep_in_fp32_as_the_pipeline_passes_it(sd3):
    """StableDiffusion3Pipeline passes the scheduler's fp32 t (σ·1000) and the transformer embeds it in fp32: with bf16
    weights a bf16 timestep would be 936 for 937.96."""
    ws, paths = sd3
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    seen = {}
    model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(t=kw["timestep"]), with_kwargs=True)
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    sigma = torch.tensor([0.93796])
    model.predict(torch.zeros(1, model.transformer.config.in_channels, 8, 8, dtype=torch.bfloat16), sigma, cond)
    assert seen["t"].dtype == torch.float32 and seen["t"].item() == pytest.approx(937.96, abs=1e-3)


@pytest.mark.parametrize("sigma", [0.3, 0.85])
def test_preconditioned_outputs_train_the_sigma_squared_velocity_loss(sd3, sigma):
    """loss.precondition_outputs in the training step (diffusers' SD3 trainer, kohya): the same draws give σ² times the
    plain velocity loss."""
    from omegaconf import OmegaConf

    from trainer.config.checks import load_config
    from trainer.memory import estimate as ev
    from trainer.memory.estimate_session import cpu_autocast
    from trainer.methods.make import make_method
    from trainer.train.step import forward_loss
    ws, paths = sd3
    cfg = load_config(None, [f"model.path={paths['diffusers']}", f"general.workspace={ws}", "training.batch_size=1"])
    model = load_tiny(ws, paths["diffusers"])
    state = ev.step_trainer(model, make_method(model, cfg), cfg, cpu_autocast("no"), str(ws))
    model.objective.sample_timesteps = lambda b, lc, gen, latents=None: torch.full((b,), sigma)
    batch = ev.make_batch(model, state.method, cfg, (64, 64), text_cached=False)
    losses = []
    for on in (False, True):
        OmegaConf.update(state.cfg, "loss.precondition_outputs", on)
        state.generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            losses.append(float(forward_loss(state, batch)))
    assert losses[1] == pytest.approx(sigma ** 2 * losses[0], rel=1e-4)


def test_predict_is_the_transformer_call_of_stable_diffusion_3_pipeline(sd3):
    """StableDiffusion3Pipeline's denoising step (no CFG at guidance 1): ``transformer(hidden_states=latents,
    timestep=t, encoder_hidden_states, pooled_projections)`` with t = σ·1000 of its shifted schedule, the latents
    unpacked (SD3 patches them itself). ``predict`` on the same noisy latents, the scheduler's σ and the caption's
    conditioning gives the same velocity; non-square latents (8×12), so a swapped axis would show."""
    ws, paths = sd3
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None)
    noise = torch.randn(1, model.transformer.config.in_channels, 8, 12, generator=torch.Generator().manual_seed(0))
    vsf = pipe.vae_scale_factor
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=8 * vsf, width=12 * vsf, latents=noise.clone(), num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], sigma * 1000)
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(ref["kwargs"]["hidden_states"], sigma, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
