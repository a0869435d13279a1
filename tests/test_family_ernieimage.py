"""ERNIE-Image beyond the family contract: the pipeline's own text features and transformer call (captions of
different lengths in one guided batch), latents as the pipeline decodes them, the single file back and forth with
diffusers' converter, detection, and the LoRA file as diffusers and ComfyUI compute it."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("ernie-ws")
    paths = build_tiny("tiny-ernie-image", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_predict_is_the_pipelines_transformer_call_and_dropout_its_negative(ernie):
    """Two captions of different lengths with guidance: the pipeline pads [uncond, uncond, cond, cond] to the
    longest and places each image after its own caption's length; predict on the cached-form features of the same
    captions (the empty ones as caption dropout gives them) returns the same output."""
    ws, paths, model = ernie
    pipe = model.pipeline(None)
    prompts = ["a red square", "a blue circle on a white background, drawn in thick ink"]
    h, w = 4, 6  # non-square: a swapped axis would show
    latents = torch.randn(2, 128, h, w, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe(prompts, height=h * 4, width=w * 4, latents=latents, num_inference_steps=2, guidance_scale=4.0,
                 output_type="latent")
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], (sigma * 1000).expand(4))
            cond = model.batch_condition({"captions": prompts * 2}, lambda c: c, set(), drop_te1=[True, True, False,
                                                                                                  False])
            cached = model.encode_captions(prompts)  # as long as the longest (the step cuts the rest off anyway)
            assert cached["prompt_embeds"].shape[1] == int(cached["prompt_mask"].sum(1).max()) < \
                model.max_sequence_length
            pred = model.predict(ref["kwargs"]["hidden_states"], sigma.expand(4), cond)
    finally:
        remove()
    lens = ref["kwargs"]["text_lens"]
    assert lens[2] < lens[3] and torch.equal(cond.prompt_mask.sum(1), lens)
    torch.testing.assert_close(pred, ref["out"])


def test_latents_are_normalised_as_the_pipeline_decodes_them(ernie):
    from diffusers import ErnieImagePipeline
    ws, paths, model = ernie
    pixels = torch.rand(1, 3, 32, 48) * 2 - 1
    dist = model.encode_pixels(pixels)
    assert dist["mean"].shape == (1, 128, 8, 12)  # the VAE halves (its 2 blocks), patchified 2×2
    z = model.sample_latents({"mean": dist["mean"], "std": torch.zeros_like(dist["std"])})  # the posterior's mean
    # the pipeline's decode: z·sqrt(var + 1e-5) + mean, unpatchified, through the VAE
    bn = model.vae.bn
    back = z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-5) + bn.running_mean.view(1, -1, 1, 1)
    raw = ErnieImagePipeline._unpatchify_latents(back)
    torch.testing.assert_close(raw, model.vae.encode(pixels).latent_dist.mean)
    assert not torch.allclose(z, dist["mean"], atol=0.05)  # the statistics do move it


def test_single_file_loads_and_fine_tunes_save_back_to_it(ernie, tmp_path):
    from diffusers.loaders.single_file_utils import convert_ernie_image_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file, save_file
    ws, paths, model = ernie
    comfy = tmp_path / "ernie-comfy.safetensors"  # ComfyUI's checkpoint layout: under model.diffusion_model.
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(paths["single_file"])).items()}, str(comfy))
    single = load_tiny(ws, comfy, f"model.config_path={paths['diffusers']}")
    assert single.transformer.config.rope_axes_dim == model.transformer.config.rope_axes_dim
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.layers[0].self_attention.to_k.weight.add_(0.5)
    out = tmp_path / "ernie-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    converted = convert_ernie_image_transformer_checkpoint_to_diffusers(dict(load_file(str(out))))
    assert set(converted) == set(single.transformer.state_dict())
    for k, v in single.transformer.state_dict().items():
        torch.testing.assert_close(converted[k], v, msg=k)


def test_detection_and_what_is_refused():
    from trainer.families import Evidence, claim
    from trainer.families.ernieimage.detect import MARKERS
    shapes = {m: (32, 32) for m in MARKERS}
    assert claim(Evidence("single_file", "x.safetensors", shapes=shapes)) == "ernie-image"
    assert claim(Evidence("single_file", "x.safetensors",
                          shapes={f"model.diffusion_model.{k}": v for k, v in shapes.items()})) == "ernie-image"
    for index in ({"_class_name": "ErnieImagePipeline"},):
        assert claim(Evidence("hub", "baidu/ERNIE-Image", read_json=lambda rel, i=index: i
                              if rel == "model_index.json" else None)) == "ernie-image"
    with pytest.raises(ValueError, match="ERNIE-Image text-to-image"):
        claim(Evidence("folder", "x", read_json=lambda rel: {"_class_name": "ErnieImageEditPipeline"}
                       if rel == "model_index.json" else None))


def test_the_lora_file_is_what_diffusers_and_comfyui_compute(ernie, tmp_path):
    """diffusers' ``load_lora_weights`` and ComfyUI's sum (B·A added to each ``diffusion_model.<module>`` weight) both
    give the weights peft merges."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = ernie
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=all", "lora.rank=4",
                             "lora.alpha=2", f"general.workspace={ws}"])
    method = LoraMethod(load_model(cfg, str(ws), "cpu"), cfg)
    model = method.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    state = method.adapter_state_dict()
    assert state and all(k.startswith("diffusion_model.") and ".lora_" in k for k in state)
    assert "diffusion_model.layers.1.mlp.linear_fc2.lora_A.weight" in state
    assert "diffusion_model.adaLN_modulation.1.lora_B.weight" in state
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))

    def weights(transformer):
        return {k.replace(".base_layer", ""): v.clone() for k, v in transformer.state_dict().items()
                if "lora_" not in k}
    base = weights(model.transformer)
    with torch.no_grad():  # peft's merged weights: what the trained adapters mean
        for module in model.transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    wanted = weights(model.transformer)
    comfy = dict(base)
    for key in state:
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."):-len(".lora_A.weight")]
            comfy[f"{module}.weight"] = comfy[f"{module}.weight"] + state[key.replace("lora_A", "lora_B")] @ state[key]
    for k, v in wanted.items():
        torch.testing.assert_close(comfy[k], v, msg=k)
    pipe = load_tiny(ws, paths["diffusers"]).pipeline(None)
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    got = weights(pipe.transformer)
    for k, v in wanted.items():
        torch.testing.assert_close(got[k], v, msg=k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("lora.type=loha", "lora.type")])
def test_validate_refuses_what_ernie_image_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-ernie-image", setting])
    assert err.value.key == key, str(err.value)


def test_at_the_released_sizes_the_file_tells_the_config_back():
    """On the meta device, at the released sizes: the transformer's own names are the file's, and its tensors tell
    the released config back."""
    from diffusers import ErnieImageTransformer2DModel
    from trainer.families.ernieimage.keys import CONFIG, config_from_state
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**{k: v for k, v in CONFIG.items() if k != "_class_name"})
    assert config_from_state(model.state_dict(), {}) == CONFIG
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(8.0, abs=0.3)
