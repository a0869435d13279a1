"""Qwen-Image 2.1 beyond the family contract: the pipeline's own text features, the transformer call the pipeline
makes, Turbo told from the base model (its shipped sigmas and sample defaults), the single file back and forth with
diffusers' converter, detection, and the LoRA file as diffusers' loader reads it and as ComfyUI adds it."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen21(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("qwen21-ws")
    paths = build_tiny("tiny-qwen-image-21", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_and_dropout_are_the_pipelines(qwen21):
    ws, paths, model = qwen21
    pipe = model.pipeline(None).pipe
    embeds, mask, pads = pipe.encode_prompt(["a red square", "a much longer caption of a red square"], device="cpu")
    cond = model.batch_condition({"captions": ["a red square", "a much longer caption of a red square"]},
                                 lambda c: c, set())
    length = embeds.shape[1]
    torch.testing.assert_close(cond.prompt_embeds[:, :length], embeds)
    assert not bool(cond.prompt_embeds[:, length:].abs().sum()) and not bool(cond.prompt_mask[:, length:].any())
    assert torch.equal(cond.prompt_mask[:, :length], mask.bool()) and not bool(pads.any())
    empty, _, _ = pipe.encode_prompt("", device="cpu")  # the pipeline reads "" as " "
    dropped = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set(), drop_te1=[True])
    torch.testing.assert_close(dropped.prompt_embeds[:, :empty.shape[1]], empty)
    assert int(dropped.prompt_mask.sum()) == empty.shape[1]


def test_qwen3_vl_keeping_its_last_layer_only_gives_the_same_features(qwen21):
    """LastLayerOnly (no other hidden layer kept, the last token's logits only) changes no feature."""
    from trainer.families.qwenimage21.family import LastLayerOnly
    ws, paths, model = qwen21
    captions = ["a red square", "a much longer caption of a red square"]
    with torch.no_grad():
        embeds, mask = model._encode(captions)
        for handle in model.last_layer_only.handles:
            handle.remove()
        try:
            seen = []
            hook = model.text_encoder.register_forward_hook(lambda m, a, out: seen.append(len(out.hidden_states)))
            whole, whole_mask = model._encode(captions)
            hook.remove()
        finally:
            model.last_layer_only = LastLayerOnly(model.text_encoder)
    assert seen == [model.text_encoder.config.text_config.num_hidden_layers + 1]  # every layer, without the hooks
    torch.testing.assert_close(embeds, whole)
    assert torch.equal(mask, whole_mask)


def test_predict_is_the_pipelines_transformer_call(qwen21):
    ws, paths, model = qwen21
    pipe = model.pipeline(None)
    h, w = 2, 4  # non-square: a swapped axis would show (32 × 64 px)
    latents = torch.randn(1, h * w, 16, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 16, width=w * 16, latents=latents, num_inference_steps=2,
                 output_type="latent", use_kv_cache=False)
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], sigma)
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            x = ref["kwargs"]["hidden_states"].transpose(1, 2).reshape(1, 16, h, w)
            pred = model.predict(x, sigma, cond)
    finally:
        remove()
    torch.testing.assert_close(pred.reshape(1, 16, h * w).transpose(1, 2), ref["out"][:, -h * w:])


def test_latents_are_normalised_as_the_pipeline_decodes_them(qwen21):
    ws, paths, model = qwen21
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    dist = model.encode_pixels(pixels)
    assert dist["mean"].shape == (1, 16, 2, 2)  # 16×, one token a latent
    z = model.sample_latents({"mean": dist["mean"], "std": dist["std"] * 0})
    c = model.vae.config
    back = z * torch.tensor(c.latents_std).view(1, -1, 1, 1) + torch.tensor(c.latents_mean).view(1, -1, 1, 1)
    torch.testing.assert_close(back, dist["mean"])


def test_turbo_is_its_own_variant_with_its_sigmas_and_defaults(qwen21, tmp_path):
    from trainer.families import build_tiny
    ws, _, base = qwen21
    assert base.family == "qwen-image-21" and base.objective.dynamic_shift is not None
    assert (base.sample_defaults().steps, base.sample_defaults().guidance) == (40, 1.0)
    paths = build_tiny("tiny-qwen-image-21-turbo", tmp_path / "models")
    turbo = load_tiny(tmp_path, paths["diffusers"])
    assert turbo.family == "qwen-image-21-turbo" and turbo.pipeline(None).config.sample_sigmas
    assert (turbo.sample_defaults().steps, turbo.sample_defaults().guidance) == (8, 1.0)
    plain = tmp_path / "qwen21.safetensors"
    plain.write_bytes(paths["single_file"].read_bytes())
    single = load_tiny(tmp_path, plain, f"model.config_path={paths['diffusers']}", "model.family=qwen-image-21-turbo")
    assert single.family == "qwen-image-21-turbo" and single.turbo


def test_single_file_loads_and_fine_tunes_save_back_to_it(qwen21, tmp_path):
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file, save_file
    ws, paths, model = qwen21
    # ComfyUI's layout: the original single file under model.diffusion_model.
    comfy = tmp_path / "qwen21-comfy.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(paths["single_file"])).items()}, str(comfy))
    single = load_tiny(ws, comfy, f"model.config_path={paths['diffusers']}")
    assert single.family == "qwen-image-21"
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.transformer_blocks[0].img_mlp.proj.weight.add_(0.5)
    out = tmp_path / "qwen21-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert "transformer_blocks.0.img_mlp.gate_up.weight" in saved and "modulation.1.weight" in saved
    converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(saved))
    assert set(converted) == set(single.transformer.state_dict())
    for k, v in single.transformer.state_dict().items():
        torch.testing.assert_close(converted[k], v, msg=k)


def test_detection_and_what_is_refused():
    from trainer.families import Evidence, claim
    shapes = {"modulation.1.weight": (128, 32), "txt_in.in_layer.weight": (32, 32),
              "transformer_blocks.0.img_mlp.gate_up.weight": (128, 32)}
    assert claim(Evidence("single_file", "x.safetensors", shapes={f"model.diffusion_model.{k}": v
                                                                  for k, v in shapes.items()})) == "qwen-image-21"
    assert claim(Evidence("single_file", "/m/qwen_image_21_turbo.safetensors", shapes=shapes)) == "qwen-image-21-turbo"
    for kind, index, want in (("folder", {"_class_name": "QwenImage21Pipeline", "sample_sigmas": None},
                               "qwen-image-21"),
                              ("hub", {"_class_name": "QwenImage21Pipeline", "sample_sigmas": [1.0, 0.5]},
                               "qwen-image-21-turbo"),
                              ("hub", {"_class_name": "QwenImagePipeline"}, "qwen-image")):
        assert claim(Evidence(kind, "Qwen/x", read_json=lambda rel, i=index: i if rel == "model_index.json"
                              else None)) == want
    with pytest.raises(ValueError, match="Qwen-Image 2.1 text-to-image"):
        claim(Evidence("folder", "x", read_json=lambda rel: {"_class_name": "QwenImage21ModularPipeline"}
                       if rel == "model_index.json" else None))


def test_the_lora_file_is_what_diffusers_and_comfyui_compute(qwen21, tmp_path):
    """diffusers' ``load_lora_weights`` (the Qwen-Image converter reads the file) and ComfyUI's sum (B·A added to each
    ``diffusion_model.<module>`` weight) both give the weights peft merges."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.qwenimage21.keys import diffusers_to_original
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = qwen21
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
    assert "diffusion_model.modulation.1.lora_A.weight" in state
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))

    def original(transformer):
        return diffusers_to_original({k.replace(".base_layer", ""): v.clone()
                                      for k, v in transformer.state_dict().items() if "lora_" not in k})
    base = original(model.transformer)
    with torch.no_grad():
        for module in model.transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    wanted = original(model.transformer)
    q = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(wanted[q], base[q])
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
    got = original(pipe.transformer)
    for k, v in wanted.items():
        torch.testing.assert_close(got[k], v, msg=k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("lora.type=loha", "lora.type")])
def test_validate_refuses_what_qwen21_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-qwen-image-21", setting])
    assert err.value.key == key, str(err.value)


def test_at_the_released_sizes_the_original_layout_is_what_diffusers_converts():
    """On the meta device, at the released sizes: the fine-tune file converts back to every weight with diffusers'
    converter, and its tensors tell the released config back."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    from trainer.families.qwenimage21.keys import CONFIG, config_from_original, diffusers_to_original
    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**{k: v for k, v in CONFIG.items() if k != "_class_name"})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    original = diffusers_to_original(model.state_dict())
    converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(original))
    assert {k: tuple(v.shape) for k, v in converted.items()} == shapes
    assert config_from_original(original, {}) == CONFIG


def test_on_the_vram_estimates_fake_tensors_every_caption_token_is_kept(qwen21):
    """The VRAM estimate's path (fake_tensors.py): its forward, with the layout from shapes, is the transformer's own
    for predict's call (real tensors, every token kept); on fake tensors the captions' features come out whole rows at
    the padded length and predict runs at that length."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import is_fake

    from trainer.families.qwenimage21.fake_tensors import layout_from_shapes
    from trainer.memory.estimate_session import session
    ws, paths, model = qwen21
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 16, 2, 4, generator=g), torch.tensor([0.3, 0.8])
    cond = SimpleNamespace(prompt_embeds=torch.randn(2, 5, 32, generator=g), prompt_mask=torch.ones(2, 5))
    with torch.no_grad():
        ref = model.predict(x, t, cond)
        with layout_from_shapes(model.transformer, True):
            got = model.predict(x, t, cond)
    torch.testing.assert_close(got, ref)
    assert "forward" not in vars(model.transformer)  # the model's own forward is back
    seen = []
    hook = model.text_encoder.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(k["input_ids"].shape)),
                                                        with_kwargs=True)
    try:
        with session(fake=True), torch.no_grad():
            embeds, mask = model._encode(["a red square", "a much longer caption of a red square"])
            pred = model.predict(torch.zeros(2, 16, 2, 4), t, SimpleNamespace(prompt_embeds=embeds, prompt_mask=mask))
            assert is_fake(embeds) and is_fake(pred)
    finally:
        hook.remove()
    assert seen == [(2, model._view._drop_idx + model.max_sequence_length)]  # Qwen3-VL read the longest captions
    assert tuple(embeds.shape) == (2, model.max_sequence_length, 32) and tuple(mask.shape) == (2, 512)
    assert tuple(pred.shape) == (2, 16, 2, 4)


def test_cached_captions_pad_to_the_longest_length_the_host_knows(qwen21):
    """A cached batch's caption lengths, on the host, give the padding and the all-real case without reading the mask
    back; the prediction is the one the mask gives (captions of different lengths, and of one)."""
    from trainer.data.text_rows import prefix_lengths, stack_padded
    ws, paths, model = qwen21
    for captions in (("a red square on a white background", "x"), ("a red square", "a red square")):
        rows = [model.encode_captions([c]) for c in captions]
        assert [r["prompt_mask"].shape[1] for r in rows] == [int(r["prompt_mask"].sum()) for r in rows]  # no padding
        batch = {k: stack_padded([r[k][0] for r in rows]) for k in rows[0]}
        batch["prompt_lengths"] = prefix_lengths(batch["prompt_mask"])
        cond = model.batch_condition(batch, lambda c: c, set())
        assert cond.lengths is not None
        latents, sigma = torch.randn(2, model.vae.config.z_dim, 8, 8), torch.tensor([0.4, 0.7])
        with torch.no_grad():
            assert torch.equal(model.predict(latents, sigma, cond),
                               model.predict(latents, sigma, type(cond)(cond.prompt_embeds, cond.prompt_mask)))
