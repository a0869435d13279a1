"""Ideogram 4 beyond the family contract: the pipeline's text features and packed transformer call (reversed clock,
negated velocity, a shorter text padding that changes no image token), latents in the pipeline's token order, the
sampler's guidance schedule, the single file back and forth, detection (an fp8 release's keys included), and the LoRA
file read by diffusers' converter and restated as ComfyUI adds it to the fused ``qkv``."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ideogram(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("ideogram4-ws")
    paths = build_tiny("tiny-ideogram4", ws / "models")
    model = load_tiny(ws, paths["diffusers"])
    model.max_sequence_length = 48  # shorter than the pipeline's padding below (512 by default)
    return ws, paths, model


def test_predict_is_the_pipelines_transformer_call_with_less_padding(ideogram):
    """The pipeline pads the text to 64 tokens here, Atelier to 48: the same features, and the same image tokens out."""
    ws, paths, model = ideogram
    pipe = model.pipeline(None)
    h, w = 4, 6  # non-square: a swapped axis would show
    noise = torch.randn(1, h * w, 32, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 4, width=w * 4, latents=noise, num_inference_steps=2, guidance_scale=3.0,
                 max_sequence_length=64, output_type="latent")
            ref = calls[1]["kwargs"]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["timestep"], 1 - sigma)
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            n = int(cond.prompt_mask.sum())
            # the pipeline's left-padded features, the real tokens first here
            torch.testing.assert_close(cond.prompt_embeds[:, :n], ref["encoder_hidden_states"][:, 64 - n:64])
            assert bool(cond.prompt_mask[:, :n].all()) and not bool(cond.prompt_mask[:, n:].any())
            latents = ref["hidden_states"][:, 64:].transpose(1, 2).reshape(1, 32, h, w)
            pred = model.predict(latents, sigma, cond)
    finally:
        remove()
    want = -calls[1]["out"][:, 64:].transpose(1, 2).reshape(1, 32, h, w)
    torch.testing.assert_close(pred, want, atol=1e-5, rtol=1e-5)
    # the transformer sees the caption's tokens alone, before the image's; a cached entry is as long as its caption
    seen = transformer_inputs(model, latents, sigma, cond)
    assert seen["encoder_hidden_states"].shape[1] == n + h * w
    assert model.encode_captions(["a red square"])["prompt_mask"].shape[1] == n
    # caption dropout: the empty caption's features (chat template and all), as the other families drop
    dropped = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set(), drop_te1=[True])
    empty = model.batch_condition({"captions": [""]}, lambda c: c, set())
    torch.testing.assert_close(dropped.prompt_embeds, empty.prompt_embeds)
    assert torch.equal(dropped.prompt_mask, empty.prompt_mask) and int(empty.prompt_mask.sum()) < n


def test_latents_are_the_pipelines_tokens_normalised_by_the_vae_batchnorm(ideogram):
    """What the pipeline decodes (tokens × BatchNorm std + mean, unpatchified) gives back the posterior's mean."""
    ws, paths, model = ideogram
    pixels = torch.rand(1, 3, 16, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    dist = model.encode_pixels(pixels)
    latents = model.sample_latents({"mean": dist["mean"], "std": torch.zeros_like(dist["std"])})
    vae = model.vae
    tokens = latents.flatten(2).transpose(1, 2)
    bn_mean = vae.bn.running_mean.view(1, 1, -1)
    bn_std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
    z = (tokens * bn_std + bn_mean).view(1, 4, 6, 2, 2, 8).permute(0, 5, 1, 3, 2, 4).reshape(1, 8, 8, 12)
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    torch.testing.assert_close(z, mean, atol=1e-5, rtol=1e-5)


def test_samples_take_the_pipelines_guidance_schedule_at_its_defaults(ideogram, monkeypatch):
    import diffusers
    ws, paths, model = ideogram
    seen = []
    monkeypatch.setattr(diffusers.Ideogram4Pipeline, "__call__", lambda self, *a, **kw: seen.append(kw))
    pipe = model.pipeline(None)
    pipe("a", guidance_scale=7.0, num_inference_steps=48, negative_prompt="blurry")
    pipe("a", guidance_scale=2.5, num_inference_steps=10)
    assert seen[0]["guidance_scale"] is None and "guidance_schedule" not in seen[0]  # the pipeline's own schedule
    assert "negative_prompt" not in seen[0]
    assert seen[1]["guidance_scale"] == 2.5 and seen[1]["guidance_schedule"] is None
    pipe("a", num_inference_steps=10)  # no guidance given: the default's constant 7
    assert seen[2]["guidance_scale"] == 7.0 and seen[2]["guidance_schedule"] is None
    assert model.unconditional_transformer.device == torch.device("cpu")


def test_single_file_loads_and_fine_tunes_save_back_to_it(ideogram, tmp_path):
    from safetensors.torch import load_file, save_file
    ws, paths, model = ideogram
    single = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.layers[0].attention.to_k.weight.add_(0.5)
    out = tmp_path / "ideogram4-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert {"layers.0.attention.qkv.weight", "layers.0.attention.o.weight", "layers.0.feed_forward.w2.weight",
            "layers.1.adaln_modulation.bias", "llm_cond_proj.weight", "t_embedding.mlp_in.weight",
            "embed_image_indicator.weight", "final_layer.adaln_modulation.weight"} <= set(saved)
    assert not any(".to_" in k for k in saved)
    # the release's prefixed layout, with the VAE's tensors beside it
    prefixed = tmp_path / "ideogram4-prefixed.safetensors"
    save_file({**{f"model.diffusion_model.{k}": v for k, v in saved.items()},
               "first_stage_model.decoder.conv_in.weight": torch.zeros(1)}, str(prefixed))
    again = load_tiny(ws, prefixed, f"model.config_path={paths['diffusers']}")
    for k, v in single.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_detection_reads_key_names_and_shapes_of_every_layout_fp8_included():
    """The fp8 release (float8 weights with a ``.weight_scale`` each) is recognised by its names and shapes."""
    from trainer.families import Evidence, claim
    from trainer.families.ideogram4 import detect
    from trainer.families.ideogram4.full_size import TRANSFORMER
    with torch.device("meta"):
        from diffusers import Ideogram4Transformer2DModel
        from trainer.families.ideogram4.keys import diffusers_to_original
        real = diffusers_to_original(Ideogram4Transformer2DModel(**TRANSFORMER).state_dict())
    shapes = {k: tuple(v.shape) for k, v in real.items()}
    assert shapes["layers.0.attention.qkv.weight"] == (13824, 4608)  # the release's fused q/k/v
    fp8 = dict(shapes)
    fp8.update({k.replace(".weight", ".weight_scale"): (v[0],) for k, v in shapes.items()
                if k.endswith(".weight") and len(v) == 2})
    for keys in (shapes, fp8, {f"model.diffusion_model.{k}": v for k, v in fp8.items()},
                 {f"conditional_transformer.{k}": v for k, v in shapes.items()}):
        assert detect.claim(Evidence("single_file", "x", shapes=keys)) == "ideogram4"
    assert claim(Evidence("single_file", "x", shapes=shapes)) == "ideogram4"
    assert claim(Evidence("single_file", "x", shapes=fp8)) == "ideogram4"
    with pytest.raises(ValueError, match="unconditional"):
        detect.claim(Evidence("single_file", "x", shapes={f"unconditional_transformer.{k}": v
                                                          for k, v in shapes.items()}))
    lumina = {"layers.0.attention.qkv.weight": (96, 32), "layers.0.adaLN_modulation.1.weight": (128, 32),
              "cap_embedder.1.weight": (32, 2304), "context_refiner.0.attention.qkv.weight": (96, 32)}
    assert detect.claim(Evidence("single_file", "x", shapes=lumina)) is None
    index = {"model_index.json": {"_class_name": "Ideogram4Pipeline"}}
    assert claim(Evidence("folder", "x", read_json=lambda rel: index.get(rel))) == "ideogram4"


@pytest.mark.parametrize("targets", ["attn", "all"])
def test_the_lora_file_is_what_diffusers_and_comfyui_compute(ideogram, tmp_path, targets):
    """diffusers' ``load_lora_weights`` (its converter reads the file) and ComfyUI's sum (B·A added to each original
    weight, qkv fused) both give the weights peft merges."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.ideogram4.keys import diffusers_to_original
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = ideogram
    cfg = load_config(None, [f"model.path={paths['diffusers']}", f"lora.unet_targets={targets}", "lora.rank=4",
                             "lora.alpha=2", f"general.workspace={ws}"])
    method = LoraMethod(load_model(cfg, str(ws), "cpu"), cfg)
    model = method.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    state = method.adapter_state_dict()
    assert all(k.startswith("diffusion_model.layers.") for k in state)
    assert ("diffusion_model.layers.0.adaln_modulation.lora_A.weight" in state) == (targets == "all")
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))

    def original(transformer):
        return diffusers_to_original({k.replace(".base_layer", ""): v.clone()
                                      for k, v in transformer.state_dict().items() if "lora_" not in k})
    base = original(model.transformer)
    with torch.no_grad():  # peft's merged weights: what the trained adapters mean
        for module in model.transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    wanted = original(model.transformer)
    assert not torch.equal(wanted["layers.0.attention.qkv.weight"], base["layers.0.attention.qkv.weight"])
    # ComfyUI: every diffusion_model.<module> key adds B·A to that weight of the original model
    comfy = dict(base)
    for key in state:
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."):-len(".lora_A.weight")]
            comfy[f"{module}.weight"] = comfy[f"{module}.weight"] + state[key.replace("lora_A", "lora_B")] @ state[key]
    for k, v in wanted.items():
        torch.testing.assert_close(comfy[k], v, msg=k)
    # diffusers: the pipeline's transformer after load_lora_weights, its LoRA fused
    pipe = load_tiny(ws, paths["diffusers"]).pipeline(None)
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    got = original(pipe.transformer)
    for k, v in wanted.items():
        torch.testing.assert_close(got[k], v, msg=k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("lora.type=loha", "lora.type")])
def test_validate_refuses_what_ideogram4_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-ideogram4", setting])
    assert err.value.key == key, str(err.value)


def test_the_fp8_release_loads_as_the_frozen_base(ideogram, tmp_path):
    """Ideogram's fp8 layout (float8_e4m3fn Linear weights of the original file, a float32 scale per output row as
    ``<layer>.weight_scale``, ai-toolkit's reading of the release) loads through the family's single-file path as the
    weights it was made from, to fp8's precision."""
    from safetensors.torch import load_file, save_file
    ws, paths, model = ideogram
    fp8 = {}
    for key, tensor in load_file(str(paths["single_file"])).items():
        if key.startswith("layers.") and key.endswith(".weight") and tensor.ndim == 2:
            scale = tensor.abs().amax(dim=1).clamp(min=1e-12) / 448.0
            fp8[key] = (tensor / scale[:, None]).to(torch.float8_e4m3fn)
            fp8[key.replace(".weight", ".weight_scale")] = scale
        else:
            fp8[key] = tensor
    path = tmp_path / "ideogram4-fp8.safetensors"
    save_file(fp8, str(path))
    loaded = load_tiny(ws, path, f"model.config_path={paths['diffusers']}")
    for k, v in model.transformer.state_dict().items():
        got = loaded.transformer.state_dict()[k].float()
        torch.testing.assert_close(got, v.float(), atol=0.07 * float(v.abs().max()), rtol=0.07, msg=k)
    qkv = loaded.transformer.layers[0].attention.to_q.weight
    assert not torch.equal(qkv, model.transformer.layers[0].attention.to_q.weight)  # it went through fp8


@pytest.fixture(scope="module")
def ideogram_24gb(ideogram):
    """The tiny model loaded with the 24 GB preset's storage: the transformer in fp8, Qwen3-VL offloaded."""
    ws, paths, _ = ideogram
    return load_tiny(ws, paths["diffusers"], "parts.denoiser.fp8=true", "data.offload_text_encoders=true")


def test_an_offloaded_qwen3vl_reaches_the_device_for_captions_and_sample_prompts(ideogram_24gb, monkeypatch):
    """``data.offload_text_encoders`` moves Qwen3-VL in (and the transformer out) from forward hooks of the text encoder:
    the text cache and a sample's prompt call the encoder itself, not its layers one by one as the pipeline does (which
    left Qwen3-VL in CPU RAM, encoding there), and the transformer's first call sends it back out."""
    from trainer.memory.offload import TextEncoderOffload
    model = ideogram_24gb
    offload = TextEncoderOffload(model, "cpu")
    events = []
    monkeypatch.setattr(offload, "denoiser_out", lambda: events.append("encoder in"))
    monkeypatch.setattr(offload, "encoders_out", lambda: events.append("encoder out"))
    model.encode_captions(["a red square"])
    assert events == ["encoder in"]
    with torch.no_grad():
        model.pipeline(None)("a red square", height=16, width=16, num_inference_steps=1, guidance_scale=3.0,
                             max_sequence_length=32, output_type="latent")
    assert events == ["encoder in", "encoder in", "encoder out"]


@pytest.mark.parametrize("tier", ["24gb", "bf16"])
def test_the_unconditional_transformer_is_on_the_device_only_where_the_estimate_counts_it(ideogram, ideogram_24gb,
                                                                                          tier, monkeypatch):
    """At the 24 GB preset's storage (fp8 transformer) a sample keeps the unconditional transformer in CPU RAM however
    large the card (an H200 took it in bf16: 17.3 GiB over the estimate) and runs its branch on the conditional one;
    with the transformer unquantised it joins the device for the sample, and the estimate's sample phase counts it."""
    model = ideogram_24gb if tier == "24gb" else ideogram[2]
    own = model.unconditional_transformer
    pipe = model.pipeline(None)
    place = pipe.place_unconditional
    monkeypatch.setattr(pipe, "place_unconditional", lambda m, device: place(m, torch.device("cuda")))  # as a GPU's
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 ** 40, 2 ** 40))  # with room to spare
    moved = []
    monkeypatch.setattr(own, "to", lambda *a, **kw: moved.append(a[0] if a else kw) or own)
    conditional, remove_c = denoiser_calls(model.transformer)
    unconditional, remove_u = denoiser_calls(own)
    try:
        with torch.no_grad():
            pipe("a red square", height=16, width=16, num_inference_steps=1, guidance_scale=3.0,
                 max_sequence_length=32, output_type="latent")
    finally:
        remove_c()
        remove_u()
    joined = tier == "bf16"
    assert moved == ([torch.device("cuda")] if joined else [])
    assert (len(conditional), len(unconditional)) == ((1, 1) if joined else (2, 0))
    assert model.sampling_modules() == ([own] if joined else [])
    assert pipe.unconditional_transformer is own  # the pipeline's own again after the sample


def test_the_estimate_counts_the_unconditional_transformer_where_samples_take_it(ideogram):
    """The VRAM estimate's sample phase holds the unconditional transformer beside the rest where the sampler brings
    it to the device (an unquantised transformer), and nothing more."""
    from trainer.config.checks import load_config
    from trainer.memory.estimate import run_estimate
    from trainer.memory.estimate_tracker import module_tensors, storage_bytes
    ws, paths, model = ideogram
    cfg = load_config(None, [f"model.path={paths['diffusers']}"], preset="demo-ideogram4")
    est = run_estimate(cfg, "demo-ideogram4", phases=("sample",), workspace=str(ws))
    joined = est.phases["sample"].weights - est.phases["load"].weights
    assert joined == storage_bytes(module_tensors([model.unconditional_transformer])) > 0
