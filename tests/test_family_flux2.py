"""Flux.2 beyond the family contract: Qwen3 layers and latents as the pipeline makes them, Flux.2 [dev]'s processor
folder read as its tokenizer and its embedded guidance, the transformer as one file."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_tiny

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
    tokenizer with the template built in gives; the transformer gets the guidance embedding (1.0, as Flux.1 dev
    trains), which changes its output."""
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
