"""Chroma beyond the family contract: T5 with the mask the pipeline builds, the single file back and forth, what
validate refuses."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chroma(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("chroma-ws")
    return ws, build_tiny("tiny-chroma", ws / "models")


def test_text_and_mask_are_the_pipelines(chroma):
    ws, paths = chroma
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square on a white background"
    embeds, mask = model.pipeline(None)._get_t5_prompt_embeds(caption, max_sequence_length=model.max_sequence_length,
                                                              device="cpu")
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    torch.testing.assert_close(cond.text_mask, mask)
    real = int(model.tokenizer(caption, return_tensors="pt").attention_mask.sum())
    assert int(mask.sum()) == real + 1  # the real tokens and the first padding token


def test_single_file_loads_and_fine_tunes_save_back_to_it(chroma, tmp_path):
    from safetensors.torch import load_file
    ws, paths = chroma
    single = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    folder = load_tiny(ws, paths["diffusers"])
    assert single.family == folder.family == "chroma"
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        folder.transformer.distilled_guidance_layer.in_proj.weight.add_(0.5)
    out = tmp_path / "chroma-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    keys = set(load_file(str(out)))
    assert {"distilled_guidance_layer.layers.0.in_layer.weight", "distilled_guidance_layer.norms.0.scale",
            "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"} <= keys
    assert not any(".img_mod." in k or "final_layer.adaLN" in k for k in keys)  # Chroma has no modulation layers
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("loss.min_snr_gamma=5", "loss.min_snr_gamma"),
                                          ("training.method=embedding", "training.method")])
def test_validate_refuses_what_chroma_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-chroma", setting])
    assert err.value.key == key, str(err.value)


def test_samples_hide_the_padding_as_training_does(chroma):
    """ChromaPipeline builds its attention mask as floats, which torch's attention adds to the scores: samples would
    see the padding tokens training hides. The transformer's mask in a sample is the boolean one training passes."""
    ws, paths = chroma
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square"
    masks = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]),
                                                       with_kwargs=True)
    try:
        model.pipeline(None)(caption, num_inference_steps=1, guidance_scale=1.0, width=64, height=64,
                             max_sequence_length=model.max_sequence_length, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    tokens = masks[0].shape[1] - cond.text_mask.shape[1]
    training = torch.cat([cond.text_mask.bool(), torch.ones(1, tokens, dtype=torch.bool)], dim=1)
    assert masks[0].dtype == torch.bool
    assert torch.equal(masks[0], training)


def test_the_transformer_sees_sigma_in_fp32_as_the_flux_trainers_pass_it(chroma):
    """Like diffusers' Flux trainers, σ reaches the transformer in fp32 (a bf16 σ would be 0.9375 for 0.93796); the
    transformer casts it to its hidden states' dtype itself."""
    ws, paths = chroma
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    seen = transformer_inputs(model, torch.zeros(1, 16, 8, 12, dtype=torch.bfloat16), torch.tensor([0.93796]), cond)
    assert seen["timestep"].dtype == torch.float32 and seen["timestep"].item() == pytest.approx(0.93796, abs=1e-7)


def test_predict_is_the_transformer_call_of_chroma_pipeline(chroma):
    """ChromaPipeline's denoising step (no CFG at guidance 1): 2×2 patches packed in row order, image ids
    (0, row, column) of the packed grid, text ids zero, ``timestep = t / 1000`` (σ of its shifted schedule), the text
    mask followed by the image tokens' ones. ``predict`` on the same noisy latents (unpacked), the scheduler's σ and
    the caption's conditioning gives the same velocity; on 8×12 latents, so image ids with height and width swapped
    would show."""
    ws, paths = chroma
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None)
    vsf = model.vae_scale_factor
    h, w = 8, 12
    noise = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(0))
    packed = noise.view(1, 16, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, h * w // 4, 64)
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * vsf, width=w * vsf, latents=packed, num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], sigma)
            rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
            ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
            torch.testing.assert_close(ref["kwargs"]["img_ids"], ids)
            noisy = (ref["kwargs"]["hidden_states"].view(1, h // 2, w // 2, 16, 2, 2).permute(0, 3, 1, 4, 2, 5)
                     .reshape(1, 16, h, w))
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(noisy, sigma, cond)
    finally:
        remove()
    out = ref["out"].view(1, h // 2, w // 2, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, h, w)
    torch.testing.assert_close(pred, out)
    # the pipeline's 512 tokens, and the step's: the real ones and the first padding token (the rest takes no part)
    seen = transformer_inputs(model, noisy, sigma, cond)
    attended = int(cond.text_mask.sum())
    assert seen["encoder_hidden_states"].shape[1] == attended < ref["kwargs"]["encoder_hidden_states"].shape[1]
    torch.testing.assert_close(seen["encoder_hidden_states"], ref["kwargs"]["encoder_hidden_states"][:, :attended])


def test_cached_captions_are_cut_at_lengths_the_host_knows(chroma):
    """A cached batch of captions of different lengths (one dropped to the empty caption): cut at the longest
    attended run the data pipeline counted on the host, without reading the mask back; the prediction is the one of
    the whole 512 tokens."""
    from trainer.data.text_rows import prefix_lengths, stack_padded
    from trainer.families.chroma.family import ChromaConditioning
    ws, paths = chroma
    model = load_tiny(ws, paths["diffusers"])
    rows = [model.encode_captions([c]) for c in ("a red square on a white background", "x", "a blue ball")]
    # each entry as long as its attended run (the step cuts the rest off anyway)
    assert [r["prompt_attention_mask"].shape[1] for r in rows] == [int(r["prompt_attention_mask"].sum()) for r in rows]
    batch = {k: stack_padded([r[k][0] for r in rows]) for k in rows[0]}
    batch["prompt_lengths"] = prefix_lengths(batch["prompt_attention_mask"])
    cond = model.batch_condition(batch, lambda c: c, set(), drop_te1=[False, False, True])
    assert cond.lengths == [int(n) for n in cond.text_mask.sum(dim=1)]
    x, sigma = torch.randn(3, 16, 4, 6, generator=torch.Generator().manual_seed(2)), torch.tensor([0.2, 0.5, 0.9])
    blind = ChromaConditioning(cond.prompt_embeds, torch.zeros_like(cond.text_mask), cond.lengths)
    seen = transformer_inputs(model, x, sigma, blind)  # the lengths come from the host, not the (zeroed) mask
    assert seen["encoder_hidden_states"].shape[1] == max(cond.lengths) < model.max_sequence_length
    from diffusers import ChromaPipeline

    from trainer.families.common.packed_ids import latent_image_ids
    with torch.no_grad():
        cut = model.predict(x, sigma, cond)
        mask = torch.cat([cond.text_mask.bool(), torch.ones(3, 6, dtype=torch.bool)], dim=1)
        whole = model.transformer(hidden_states=ChromaPipeline._pack_latents(x, 3, 16, 4, 6),
                                  encoder_hidden_states=cond.prompt_embeds, timestep=sigma,
                                  img_ids=latent_image_ids(2, 3, "cpu", torch.float32),
                                  txt_ids=torch.zeros(cond.prompt_embeds.shape[1], 3), attention_mask=mask,
                                  return_dict=False)[0]
    f = model.vae_scale_factor
    torch.testing.assert_close(cut, ChromaPipeline._unpack_latents(whole, 4 * f, 6 * f, f), atol=1e-5, rtol=1e-5)
