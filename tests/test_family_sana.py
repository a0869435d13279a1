"""Sana beyond the family contract: Gemma features with the pipeline's instruction preamble and token selection, the
transformer call the pipeline makes (the 0-1000 clock, the flow target), DC-AE latents as the pipeline decodes them,
the single file back and forth (Sana 1.5's q/k norms included), detection and refusals, and the LoRA file
``SanaPipeline.load_lora_weights`` reads giving peft's merged weights."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sana(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("sana-ws")
    paths = build_tiny("tiny-sana", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_are_the_pipelines_with_its_instruction_preamble(sana):
    ws, paths, model = sana
    caption = "A Red square on a white background"  # upper case: the pipeline lower-cases it
    pipe = model.pipeline(None)
    embeds, mask, neg, neg_mask = pipe.encode_prompt(caption, do_classifier_free_guidance=True, device="cpu",
                                                     max_sequence_length=model.max_sequence_length,
                                                     complex_human_instruction=pipe_default_instruction())
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    assert cond.prompt_embeds.shape[1] == model.max_sequence_length == 300
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    assert torch.equal(cond.prompt_mask, mask.bool())
    # caption dropout gives the unconditional features the pipeline samples with: "" without the preamble
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te1=[True])
    torch.testing.assert_close(dropped.prompt_embeds, neg)
    assert torch.equal(dropped.prompt_mask, neg_mask.bool())
    # the preamble changes the features (the test above would pass without it if the pipeline dropped it too)
    plain, _, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu",
                                        complex_human_instruction=None)
    assert not torch.allclose(plain, embeds)


def pipe_default_instruction():
    import inspect
    from diffusers import SanaPipeline
    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


def test_predict_is_the_pipelines_transformer_call(sana):
    ws, paths, model = sana
    pipe = model.pipeline(None)
    h, w = 8, 16  # non-square: a swapped axis would show (the pipeline takes sides in multiples of 32 px)
    latents = torch.randn(1, 32, h, w, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 4, width=w * 4, latents=latents, num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            t = ref["kwargs"]["timestep"]
            assert 0 < float(t) < 1000
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            hidden = ref["args"][0] if ref["args"] else ref["kwargs"]["hidden_states"]
            pred = model.predict(hidden, t.float() / 1000, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
    # from the caption's real tokens alone (the pipeline's call has the padding, masked out of the cross-attention)
    seen = transformer_inputs(model, hidden, t.float() / 1000, cond)
    n = int(ref["kwargs"]["encoder_attention_mask"].sum())
    assert seen["encoder_hidden_states"].shape[1] == n < ref["kwargs"]["encoder_hidden_states"].shape[1]
    assert seen["encoder_attention_mask"] is None
    assert model.encode_captions(["a red square"])["prompt_mask"].shape[1] == n  # the cache keeps no more
    # the flow target the loop trains against is what the pipeline's scheduler steps with (flow_prediction)
    assert pipe.scheduler.config.prediction_type == "flow_prediction"
    assert model.objective.shift == pipe.scheduler.config.flow_shift == 3.0


def test_latents_are_what_the_pipeline_decodes(sana):
    """DC-AE's encoding × scaling_factor: the pipeline decodes ``latents / scaling_factor``."""
    ws, paths, model = sana
    pixels = torch.rand(1, 3, 32, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = model.sample_latents(model.encode_pixels(pixels))
    with torch.no_grad():
        direct = model.vae.encode(pixels).latent * model.vae.config.scaling_factor
    torch.testing.assert_close(latents, direct)
    assert latents.shape == (1, 32, 8, 16)


def test_single_file_loads_and_fine_tunes_save_back_to_it(sana, tmp_path):
    """The original layout (Sana 1.5's q/k norms and the fused qkv/kv_linear) both ways; ComfyUI's prefix read; the
    null caption and position table of the file written back."""
    from safetensors.torch import load_file, save_file
    ws, paths, model = sana
    original = load_file(str(paths["single_file"]))
    original["y_embedder.y_embedding"] = torch.randn(300, 32)
    comfy = tmp_path / "sana-comfy.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in original.items()}, str(comfy))
    single = load_tiny(ws, comfy, f"model.config_path={paths['diffusers']}")
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.transformer_blocks[0].attn2.to_v.weight.add_(0.5)
    out = tmp_path / "sana-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert set(saved) == set(original)
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.q_norm.weight", "blocks.0.cross_attn.kv_linear.weight",
            "blocks.0.cross_attn.k_norm.weight", "blocks.0.mlp.depth_conv.conv.weight", "t_block.1.weight",
            "final_layer.scale_shift_table", "attention_y_norm.weight"} <= set(saved)
    kv, before = saved["blocks.0.cross_attn.kv_linear.weight"], original["blocks.0.cross_attn.kv_linear.weight"]
    half = kv.shape[0] // 2  # k, then v: the v rows moved by 0.5
    torch.testing.assert_close(kv[half:], before[half:] + 0.5)
    torch.testing.assert_close(kv[:half], before[:half])
    torch.testing.assert_close(saved["y_embedder.y_embedding"], original["y_embedder.y_embedding"])


def test_detection_claims_sana_before_pixart_and_refuses_its_other_variants():
    from trainer.families import Evidence, claim
    sana = {"blocks.0.attn.qkv.weight": (96, 32), "blocks.0.cross_attn.kv_linear.weight": (64, 32),
            "blocks.0.mlp.inverted_conv.conv.weight": (160, 32, 1, 1)}
    assert claim(Evidence("single_file", "x", shapes={f"model.diffusion_model.{k}": v
                                                      for k, v in sana.items()})) == "sana"
    pixart = {"blocks.0.attn.qkv.weight": (96, 32), "blocks.0.cross_attn.kv_linear.weight": (64, 32),
              "blocks.0.mlp.fc1.weight": (128, 32), "y_embedder.y_embedding": (300, 4096)}
    assert claim(Evidence("single_file", "x", shapes=pixart)) == "pixart-sigma"
    with pytest.raises(ValueError, match="Sana-Sprint"):
        claim(Evidence("single_file", "x", shapes={**sana, "cfg_embedder.mlp.0.weight": (32, 256)}))
    index = {"model_index.json": {"_class_name": "SanaPipeline"}}
    assert claim(Evidence("hub", "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers",
                          read_json=lambda rel: index.get(rel))) == "sana"
    for cls, name in (("SanaSprintPipeline", "Sana-Sprint"), ("SanaControlNetPipeline", "ControlNet"),
                      ("SanaPAGPipeline", "PAG"), ("SanaVideoPipeline", "Sana-Video"), ("SanaWMPipeline", "Sana-WM")):
        other = {"model_index.json": {"_class_name": cls}}
        with pytest.raises(ValueError, match=name):
            claim(Evidence("hub", "x", read_json=lambda rel: other.get(rel)))


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("lora.type=loha", "lora.type")])
def test_validate_refuses_what_sana_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-sana", setting])
    assert err.value.key == key, str(err.value)


def test_the_lora_file_loaded_by_the_pipeline_is_peft_merged_weights(sana, tmp_path):
    """``SanaPipeline.load_lora_weights`` on the saved file, fused, gives the weights peft merges (attention and the
    Mix-FFN's 1×1 convolutions)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = sana
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=attn_mlp", "lora.rank=4",
                             "lora.alpha=2", f"general.workspace={ws}"])
    method = LoraMethod(load_model(cfg, str(ws), "cpu"), cfg)
    model = method.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    state = method.adapter_state_dict()
    assert all(k.startswith("transformer.transformer_blocks.") for k in state)
    assert any(".ff.conv_inverted." in k for k in state) and any(".attn2.to_k." in k for k in state)
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))
    with torch.no_grad():
        for module in model.transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    wanted = {k.replace(".base_layer", ""): v for k, v in model.transformer.state_dict().items() if "lora_" not in k}
    fresh = load_tiny(ws, paths["diffusers"])
    base = {k: v.clone() for k, v in fresh.transformer.state_dict().items()}
    pipe = fresh.pipeline(None)
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    got = {k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    for key in ("transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.1.ff.conv_point.weight"):
        assert not torch.equal(wanted[key], base[key]), key  # the LoRA changes them
    for k, v in wanted.items():
        torch.testing.assert_close(got[k], v, msg=k, atol=1e-5, rtol=1e-5)


def test_at_the_released_sizes_the_original_file_is_what_diffusers_converts():
    """On the meta device, at Sana 1.6B's sizes: the fine-tune file converts back to every weight of the model with
    diffusers' ``convert_sana_transformer_to_diffusers`` (Sana 1.0: no q/k norms), as with keys.py; and the weights
    alone give back the released config."""
    from diffusers import SanaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_sana_transformer_to_diffusers
    from trainer.families.sana.keys import CONFIG, config_from_original, diffusers_to_original, original_to_diffusers
    with torch.device("meta"):
        model = SanaTransformer2DModel(**{k: v for k, v in CONFIG.items() if k != "_class_name"})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    original = diffusers_to_original(model.state_dict())
    with_extras = {**original, "pos_embed": torch.empty(1, 1, 2240, device="meta"),
                   "y_embedder.y_embedding": torch.empty(300, 2304, device="meta")}
    assert {k: tuple(v.shape) for k, v in convert_sana_transformer_to_diffusers(dict(with_extras)).items()} == shapes
    assert {k: tuple(v.shape) for k, v in original_to_diffusers(with_extras).items()} == shapes
    assert config_from_original(original, {}) == dict(CONFIG, qk_norm=None)
