"""Krea 2 beyond the family contract: the pipeline's own text features, the transformer call the pipeline makes,
Turbo told from Raw (its schedule and sample defaults), the single file back and forth with diffusers' converter,
detection, and the LoRA file read by diffusers' converter and added as ComfyUI adds it."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def krea(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("krea2-ws")
    paths = build_tiny("tiny-krea2", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_and_dropout_are_the_pipelines(krea):
    ws, paths, model = krea
    caption = "a red square on a white background"
    pipe = model.pipeline(None)
    embeds, mask = pipe.encode_prompt(caption, device="cpu", max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    assert not bool(mask.all()) and bool(mask[0, -1])  # padded in the template's middle, the suffix after it
    _same_real_tokens(model, cond, embeds, mask)
    # caption dropout gives the negative prompt the pipeline samples with ("")
    neg, neg_mask = pipe.encode_prompt("", device="cpu", max_sequence_length=model.max_sequence_length)
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te1=[True])
    _same_real_tokens(model, dropped, neg, neg_mask)
    # cached: cut to the longest caption encoded with it (here its own)
    entry = model.encode_captions([caption])
    assert entry["prompt_mask"].shape[1] == int(mask.sum()) and bool(entry["prompt_mask"].all())


def _same_real_tokens(model, cond, embeds, mask):
    """The pipeline's real tokens, in their order, first; zeros after them (the pipeline's mask is not a prefix)."""
    ours = cond.prompt_embeds.unflatten(-1, (len(model.select_layers), -1))
    n = int(mask.sum())
    assert bool(cond.prompt_mask[0, :n].all()) and not bool(cond.prompt_mask[0, n:].any())
    torch.testing.assert_close(ours[0, :n], embeds[0][mask[0].bool()])
    assert not bool(ours[0, n:].any())


def test_predict_is_the_pipelines_transformer_call(krea):
    ws, paths, model = krea
    pipe = model.pipeline(None)
    h, w = 8, 12  # non-square: a swapped axis would show
    latents = torch.randn(1, h // 2 * w // 2, 64, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 2, width=w * 2, latents=latents, num_inference_steps=2,
                 guidance_scale=0.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], sigma)
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            from trainer.families.krea2.family import pack, unpack
            x = unpack(ref["kwargs"]["hidden_states"], h, w)
            pred = model.predict(x, sigma, cond)
    finally:
        remove()
    torch.testing.assert_close(pack(pred), ref["out"])
    # from the caption's real tokens alone, without a mask (the pipeline's call has the padding, masked)
    seen = transformer_inputs(model, x, sigma, cond)
    n = int(ref["kwargs"]["encoder_attention_mask"].sum())
    assert seen["encoder_hidden_states"].shape[1] == n < ref["kwargs"]["encoder_hidden_states"].shape[1]
    assert seen["encoder_attention_mask"] is None


def test_a_cached_batch_is_cut_at_its_longest_caption(krea):
    """Captions of different lengths cached one by one (each as long as itself), stacked as the data pipeline
    stacks them: the lengths the host counted cut the batch, and the prediction is the uncut, masked one's."""
    from trainer.data.text_rows import prefix_lengths, stack_padded
    from trainer.families.common.transformer_kit import MaskedText
    ws, paths, model = krea
    rows = [model.encode_captions([c]) for c in ("a red square on a white background", "x")]
    batch = {k: stack_padded([r[k][0] for r in rows]) for k in rows[0]}
    batch["prompt_lengths"] = prefix_lengths(batch["prompt_mask"])
    cond = model.batch_condition(batch, lambda c: c, set())
    assert cond.lengths is not None and len(set(cond.lengths)) == 2
    x, sigma = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(5)), torch.tensor([0.3, 0.6])
    padded = MaskedText(torch.cat([cond.prompt_embeds, torch.zeros_like(cond.prompt_embeds)], dim=1),
                        torch.cat([cond.prompt_mask, torch.zeros_like(cond.prompt_mask)], dim=1))
    with torch.no_grad():
        torch.testing.assert_close(model.predict(x, sigma, cond), model.predict(x, sigma, padded),
                                   atol=1e-5, rtol=1e-5)


def test_turbo_is_its_own_variant_with_the_distilled_schedule_and_defaults(krea, tmp_path):
    from trainer.families import build_tiny
    from trainer.objectives import FlowMatchingObjective
    ws, _, raw = krea
    assert raw.family == "krea2" and raw.objective.dynamic_shift is not None
    assert (raw.sample_defaults().steps, raw.sample_defaults().guidance) == (28, 4.5)
    paths = build_tiny("tiny-krea2-turbo", tmp_path / "models")
    turbo = load_tiny(tmp_path, paths["diffusers"])
    assert turbo.family == "krea2-turbo" and turbo.pipeline(None).config.is_distilled
    assert isinstance(turbo.objective, FlowMatchingObjective) and turbo.objective.dynamic_shift is None
    assert turbo.objective.shift == pytest.approx(math.exp(1.15))  # the pipeline's fixed μ at every size
    assert (turbo.sample_defaults().steps, turbo.sample_defaults().guidance) == (8, 0.0)
    # the single file holds Raw's tensors: model.family tells it (a file named for Turbo is read as Turbo anyway)
    plain = tmp_path / "krea2.safetensors"
    plain.write_bytes(paths["single_file"].read_bytes())
    single = load_tiny(tmp_path, plain, f"model.config_path={paths['diffusers']}", "model.family=krea2-turbo")
    assert single.family == "krea2-turbo" and single.turbo


def test_single_file_loads_and_fine_tunes_save_back_to_it(krea, tmp_path):
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file, save_file
    ws, paths, model = krea
    # ComfyUI's layout: the original single file under model.diffusion_model.
    comfy = tmp_path / "krea2-comfy.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(paths["single_file"])).items()}, str(comfy))
    single = load_tiny(ws, comfy, f"model.config_path={paths['diffusers']}")
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "krea2-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert {"blocks.0.attn.wk.weight", "blocks.0.mod.lin", "txtfusion.projector.weight", "first.weight",
            "last.modulation.lin", "txtmlp.0.scale", "tproj.1.weight"} <= set(saved)
    # diffusers' own converter (what from_single_file runs) reads it back to the same weights
    converted = convert_krea2_transformer_checkpoint_to_diffusers(dict(saved))
    assert set(converted) == set(single.transformer.state_dict())
    for k, v in single.transformer.state_dict().items():
        torch.testing.assert_close(converted[k], v, msg=k)


def test_detection_and_what_is_refused():
    from trainer.families import Evidence, claim
    shapes = {"blocks.0.attn.wq.weight": (32, 32), "blocks.0.mod.lin": (192,), "txtfusion.projector.weight": (1, 2)}
    assert claim(Evidence("single_file", "x.safetensors", shapes={f"model.diffusion_model.{k}": v
                                                                  for k, v in shapes.items()})) == "krea2"
    assert claim(Evidence("single_file", "/m/krea2_turbo.safetensors", shapes=shapes)) == "krea2-turbo"
    with pytest.raises(ValueError, match="diffusers' names"):
        claim(Evidence("single_file", "x", shapes={"text_fusion.projector.weight": (1, 2),
                                                   "transformer_blocks.0.scale_shift_table": (6, 32)}))
    for kind, index, want in (("folder", {"_class_name": "Krea2Pipeline"}, "krea2"),
                              ("hub", {"_class_name": "Krea2Pipeline", "is_distilled": False}, "krea2"),
                              ("hub", {"_class_name": "Krea2Pipeline", "is_distilled": True}, "krea2-turbo")):
        assert claim(Evidence(kind, "krea/Krea-2", read_json=lambda rel, i=index: i if rel == "model_index.json"
                              else None)) == want
    with pytest.raises(ValueError, match="Krea 2 text-to-image"):
        claim(Evidence("folder", "x", read_json=lambda rel: {"_class_name": "Krea2Img2ImgPipeline"}
                       if rel == "model_index.json" else None))


def test_the_lora_file_is_what_diffusers_and_comfyui_compute(krea, tmp_path, targets="all"):
    """diffusers' ``load_lora_weights`` (its converter reads the file) and ComfyUI's sum (B·A added to each weight of
    the original model) both give the weights peft merges."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.krea2.keys import diffusers_to_original
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = krea
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
    assert state and all(k.startswith("diffusion_model.") and ".lora_" in k for k in state)
    assert any(k.startswith("diffusion_model.txtfusion.refiner_blocks.0.attn.wq.") for k in state)
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
    assert not torch.equal(wanted["blocks.0.attn.wq.weight"], base["blocks.0.attn.wq.weight"])
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
def test_validate_refuses_what_krea2_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-krea2", setting])
    assert err.value.key == key, str(err.value)


def test_at_the_released_sizes_the_original_layout_is_what_diffusers_converts():
    """On the meta device, at Krea-2-Raw's sizes: the fine-tune file converts back to every weight with diffusers'
    ``convert_krea2_transformer_checkpoint_to_diffusers``, and its tensors tell the released config back."""
    from diffusers import Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from trainer.families.krea2.keys import CONFIG, config_from_original, diffusers_to_original
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**{k: v for k, v in CONFIG.items() if k != "_class_name"})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    original = diffusers_to_original(model.state_dict())
    assert len(original) == 430  # the tensors of the released single file
    assert {k: tuple(v.shape) for k, v in convert_krea2_transformer_checkpoint_to_diffusers(dict(original)).items()} \
        == shapes
    assert config_from_original(original, {}) == CONFIG


def test_a_folder_read_component_by_component_keeps_the_pipelines_list_settings(krea):
    """The VRAM estimate and the random-weight bench build the pipeline from a folder's configs component by
    component: Krea 2's text_encoder_select_layers (a list in model_index.json) must reach it, or the features tap
    layers the text encoder does not have."""
    from trainer.families.sources import load_components
    from diffusers import Krea2Pipeline
    ws, paths, model = krea
    pipe = load_components(Krea2Pipeline, paths["diffusers"], torch.float32)
    assert tuple(pipe.text_encoder_select_layers) == model.select_layers
    assert max(model.select_layers) <= model.text_encoder.config.text_config.num_hidden_layers  # +1: the embeddings
