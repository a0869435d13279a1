"""Z-Image beyond the family contract: Qwen3 features through the chat template as the pipeline makes them, the
transformer's reversed clock, the single file back and forth, Lumina-2 files not taken for Z-Image."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("zimage-ws")
    return ws, build_tiny("tiny-zimage", ws / "models")


def test_text_features_and_the_velocity_are_the_pipelines(zimage):
    ws, paths = zimage
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square on a white background"
    pipe = model.pipeline(None)
    features, _ = pipe.encode_prompt(caption, device="cpu", do_classifier_free_guidance=False,
                                     max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption, "x"]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds[0][cond.prompt_mask[0]], features[0])
    # the pipeline's velocity at σ: −transformer(latents, 1 − σ); the loop's target is ε − x at σ
    latents, sigma = torch.randn(1, 16, 8, 12), torch.tensor([0.7])  # non-square: a swapped axis would show
    out = model.transformer([latents[0].unsqueeze(1)], 1.0 - sigma, [features[0]], return_dict=False)[0]
    from trainer.families.common.transformer_kit import MaskedText
    first = MaskedText(cond.prompt_embeds[:1], cond.prompt_mask[:1])
    torch.testing.assert_close(model.predict(latents, sigma, first), -out[0].unsqueeze(0).squeeze(2))


def test_single_file_loads_and_fine_tunes_save_back_to_it(zimage, tmp_path):
    from safetensors.torch import load_file
    ws, paths = zimage
    folder = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        folder.transformer.layers[0].attention.to_k.weight.add_(0.5)
    out = tmp_path / "zimage-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    keys = set(load_file(str(out)))
    assert {"layers.0.attention.qkv.weight", "layers.0.attention.out.weight", "x_embedder.weight",
            "final_layer.linear.weight", "noise_refiner.0.attention.q_norm.weight"} <= keys
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_lumina2_files_are_not_taken_for_z_image():
    from trainer.families import Evidence
    from trainer.families.zimage.detect import claim
    shapes = {"layers.0.attention.qkv.weight": (96, 32), "noise_refiner.0.attention.qkv.weight": (96, 32)}
    assert claim(Evidence("single_file", "x", shapes={**shapes, "cap_embedder.1.weight": (32, 2560)})) == "z-image"
    assert claim(Evidence("single_file", "x", shapes={**shapes, "cap_embedder.1.weight": (32, 2304)})) is None


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("loss.debiased_estimation=true", "loss.debiased_estimation")])
def test_validate_refuses_what_z_image_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-zimage", setting])
    assert err.value.key == key, str(err.value)


def test_the_transformer_sees_the_timestep_in_fp32_as_the_pipeline_passes_it(zimage):
    """ZImagePipeline passes (1000 − t) / 1000 in fp32 and the transformer embeds it in fp32: with bf16 weights a bf16
    timestep would be 0.0625 for 0.0620."""
    ws, paths = zimage
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    seen = {}
    model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(t=a[1]), with_kwargs=True)
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    channels = model.transformer.config.in_channels
    model.predict(torch.zeros(1, channels, 8, 8, dtype=torch.bfloat16), torch.tensor([0.938]), cond)
    assert seen["t"].dtype == torch.float32 and seen["t"].item() == pytest.approx(1 - 0.938, abs=1e-6)


def test_cached_captions_are_cut_at_lengths_the_host_knows(zimage):
    """A cached batch carries each caption's length on the host (its real tokens come first), so the step cuts the
    features without reading the mask back from the device; with caption dropout the dropped rows take the empty
    caption's length. The prediction is the one the mask gives."""
    from trainer.data.text_rows import prefix_lengths, stack_padded
    ws, paths = zimage
    model = load_tiny(ws, paths["diffusers"])
    rows = [model.encode_captions([c]) for c in ("a red square on a white background", "x")]
    assert [r["prompt_mask"].shape[1] for r in rows] == [int(r["prompt_mask"].sum()) for r in rows]  # no padding kept
    batch = {k: stack_padded([r[k][0] for r in rows]) for k in rows[0]}
    batch["prompt_lengths"] = prefix_lengths(batch["prompt_mask"])
    assert batch["prompt_lengths"] == [int(n) for n in batch["prompt_mask"].sum(1)]
    assert prefix_lengths(torch.tensor([[0.0, 1.0, 1.0]])) is None  # real tokens not first: no lengths
    latents, sigma = torch.randn(2, 16, 8, 8), torch.tensor([0.4, 0.7])
    for drop in (None, [False, True]):
        cond = model.batch_condition(batch, lambda c: c, set(), drop_te1=drop)
        assert cond.lengths == [int(n) for n in cond.prompt_mask.sum(1)]
        from_mask = type(cond)(cond.prompt_embeds, cond.prompt_mask)  # no lengths: the mask cuts on the device
        with torch.no_grad():
            assert torch.equal(model.predict(latents, sigma, cond), model.predict(latents, sigma, from_mask))
