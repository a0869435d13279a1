"""Lumina 2 beyond the family contract: Gemma features with the pipeline's system prompt, the transformer call the
pipeline makes (reversed clock, negated output), the single file back and forth, detection, and the LoRA file read by
diffusers' converter and restated as ComfyUI adds it to the fused ``qkv``."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lumina(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("lumina2-ws")
    paths = build_tiny("tiny-lumina2", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_are_the_pipelines_with_its_system_prompt(lumina):
    ws, paths, model = lumina
    caption = "a red square on a white background"
    pipe = model.pipeline(None)
    embeds, mask, neg, neg_mask = pipe.encode_prompt(caption, do_classifier_free_guidance=True, device="cpu",
                                                     max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    assert torch.equal(cond.prompt_mask, mask.bool())
    text = model.tokenizer.decode(model.tokenizer(pipe.system_prompt).input_ids[1:])
    assert text.replace("\u2581", " ").strip() == pipe.system_prompt.strip()
    # caption dropout gives the unconditional features the pipeline samples with: "" without the system prompt
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te1=[True])
    torch.testing.assert_close(dropped.prompt_embeds, neg)
    assert torch.equal(dropped.prompt_mask, neg_mask.bool())


def test_a_system_prompt_of_its_own_is_in_the_features_the_samples_and_the_cache_key(lumina):
    """model.system_prompt (Neta-Lumina's card and kohya name their own): the features are the pipeline's with that
    system prompt, samples pass it, and cached captions of the default prompt are not reused."""
    ws, paths, default = lumina
    own = "You are an assistant designed to generate anime images based on textual prompts."
    model = load_tiny(ws, paths["diffusers"], f"model.system_prompt={own}")
    caption = "a red square on a white background"
    embeds, mask, _, _ = model.pipeline(None).encode_prompt(caption, do_classifier_free_guidance=False, device="cpu",
                                                            system_prompt=own,
                                                            max_sequence_length=model.max_sequence_length)
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    assert torch.equal(cond.prompt_mask, mask.bool())
    assert not torch.equal(cond.prompt_mask, default.batch_condition({"captions": [caption]}, lambda c: c,
                                                                     set()).prompt_mask)
    assert model.sampling_kwargs()["system_prompt"] == own
    assert default.sampling_kwargs()["system_prompt"] == default.pipeline(None).system_prompt
    mcfg = type("ModelSection", (), {"path": "p", "dtype": "fp32"})()
    assert model.text_fingerprint(mcfg) != default.text_fingerprint(mcfg)


def test_predict_is_the_pipelines_transformer_call(lumina):
    ws, paths, model = lumina
    pipe = model.pipeline(None)
    h, w = 8, 12  # non-square: a swapped axis would show
    latents = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 8, width=w * 8, latents=latents, num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], 1 - sigma)
            assert ref["kwargs"]["timestep"].dtype == torch.float32
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(ref["kwargs"]["hidden_states"], sigma, cond)
            # a cached entry keeps the caption's tokens alone (the transformer cuts to the mask's length itself)
            from trainer.families.common.transformer_kit import MaskedText
            entry = model.encode_captions(["a red square"])
            assert entry["prompt_mask"].shape[1] == int(entry["prompt_mask"].sum()) < cond.prompt_mask.shape[1]
            cached = model.predict(ref["kwargs"]["hidden_states"], sigma,
                                   MaskedText(entry["prompt_embeds"], entry["prompt_mask"].bool()))
    finally:
        remove()
    torch.testing.assert_close(pred, -ref["out"])
    torch.testing.assert_close(cached, pred)


def test_a_cached_batch_gives_the_transformer_its_caption_lengths_without_a_device_read(lumina):
    """diffusers' Lumina 2 reads each caption's token count back from the mask at every forward (``.tolist()`` in
    its RoPE embedder, a device sync); a cached batch carries the counts on the host, caption dropout keeps them,
    and the embedder gets them there: the same prediction, bit for bit, and no read (``tests/test_step_syncs.py``
    counts the step). Lengths that are not the mask's would change it: the embedder uses them."""
    from trainer.data.text_rows import stack_texts
    ws, paths, model = lumina
    rows = [model.encode_captions([c]) for c in ("a red square on a white background", "a circle")]
    batch = stack_texts([{k: v[0] for k, v in r.items()} for r in rows])
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.8])
    for drops in (None, [False, True]):
        cond = model.batch_condition(batch, lambda c: c, set(), drop_te1=drops)
        assert cond.lengths == [int(n) for n in cond.prompt_mask.sum(1)] and len(set(cond.lengths)) == 2
        with torch.no_grad():
            counted = model.predict(x, t, cond)
            cond.lengths, host = None, cond.lengths
            read = model.predict(x, t, cond)
            cond.lengths = [n - 1 for n in host]
            wrong = model.predict(x, t, cond)
        assert torch.equal(counted, read) and not torch.allclose(wrong, read)


def test_single_file_loads_and_fine_tunes_save_back_to_it(lumina, tmp_path):
    from safetensors.torch import load_file, save_file
    ws, paths, model = lumina
    single = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    with torch.no_grad():
        single.transformer.layers[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "lumina2-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    keys = set(load_file(str(out)))
    assert {"layers.0.attention.qkv.weight", "layers.0.attention.out.weight", "x_embedder.weight",
            "final_layer.linear.weight", "context_refiner.0.attention_norm1.weight",
            "noise_refiner.0.adaLN_modulation.1.weight", "cap_embedder.1.weight", "t_embedder.mlp.2.bias"} <= keys
    # ComfyUI's all-in-one layout: the prefix, the VAE's and Gemma's tensors beside it
    comfy = tmp_path / "lumina2-comfy.safetensors"
    save_file({**{f"model.diffusion_model.{k}": v for k, v in load_file(str(out)).items()},
               "first_stage_model.decoder.conv_in.weight": torch.zeros(1)}, str(comfy))
    again = load_tiny(ws, comfy, f"model.config_path={paths['diffusers']}")
    for k, v in single.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_detection_tells_lumina2_from_z_image_and_refuses_newbie():
    from trainer.families import Evidence, claim
    shapes = {"layers.0.attention.qkv.weight": (64, 32), "context_refiner.0.attention.qkv.weight": (64, 32),
              "cap_embedder.1.weight": (32, 2304), "noise_refiner.0.attention.qkv.weight": (64, 32)}
    lumina = {**shapes, "layers.0.adaLN_modulation.1.weight": (128, 32)}
    assert claim(Evidence("single_file", "x", shapes={f"model.diffusion_model.{k}": v
                                                      for k, v in lumina.items()})) == "lumina2"
    z_image = {**shapes, "cap_embedder.1.weight": (32, 2560), "layers.0.adaLN_modulation.0.weight": (128, 32),
               "cap_pad_token": (1, 32)}
    assert claim(Evidence("single_file", "x", shapes=z_image)) == "z-image"
    with pytest.raises(ValueError, match="NewBie"):
        claim(Evidence("single_file", "x", shapes={**lumina, "clip_text_pooled_proj.0.weight": (32, 1024)}))
    index = {"model_index.json": {"_class_name": "Lumina2Pipeline"}}
    assert claim(Evidence("folder", "x", read_json=lambda rel: index.get(rel))) == "lumina2"


def _patched_split(monkeypatch, model):
    """diffusers' converter splits a fused qkv LoRA at the released model's rows (2304, 768, 768): the tiny model's
    rows in their place (the full-size config has those rows: checked below)."""
    from diffusers.loaders import lora_conversion_utils as conv
    t = model.transformer.layers[0].attn
    rows = [t.to_q.weight.shape[0], t.to_k.weight.shape[0], t.to_v.weight.shape[0]]

    class Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def split(tensor, sizes, dim=0):
            return torch.split(tensor, rows if list(sizes) == [2304, 768, 768] else sizes, dim=dim)
    monkeypatch.setattr(conv, "torch", Torch())


def load_lora_into_pipeline(pipe, path):
    """The contract row's loader: ``Lumina2Pipeline.load_lora_weights`` with diffusers' fused-qkv split at the tiny
    model's rows."""
    mp = pytest.MonkeyPatch()
    try:
        _patched_split(mp, pipe)
        pipe.load_lora_weights(str(path))
    finally:
        mp.undo()


@pytest.mark.parametrize("targets", ["attn", "all"])
def test_the_lora_file_is_what_diffusers_and_comfyui_compute(lumina, tmp_path, monkeypatch, targets):
    """diffusers' ``load_lora_weights`` (its converter reads the file) and ComfyUI's sum (B·A added to each original
    weight, qkv fused) both give the weights peft merges."""
    from safetensors.torch import save_file
    from trainer.config.checks import load_config
    from trainer.families.lumina2.full_size import FULL_SIZE
    from trainer.families.lumina2.keys import diffusers_to_original
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = lumina
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
    assert all(k.startswith("diffusion_model.") for k in state)
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))
    base = {k: v.clone() for k, v in diffusers_to_original(
        {k.replace(".base_layer", ""): v for k, v in model.transformer.state_dict().items() if "lora_" not in k}
    ).items()}
    from peft.tuners.tuners_utils import BaseTunerLayer
    with torch.no_grad():  # peft's merged weights: what the trained adapters mean
        for module in model.transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    wanted = diffusers_to_original({k.replace(".base_layer", ""): v for k, v in model.transformer.state_dict().items()
                                    if "lora_" not in k})
    assert not torch.equal(wanted["layers.0.attention.qkv.weight"], base["layers.0.attention.qkv.weight"])
    zero = [k for k in state if k.endswith("lora_B.weight") and not torch.count_nonzero(state[k])]
    assert bool(zero) == (targets == "attn"), zero[:3]  # padding only for modules diffusers expects and `attn` leaves
    # ComfyUI: every diffusion_model.<module> key adds B·A to that weight of the original model
    comfy = dict(base)
    for key in state:
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."):-len(".lora_A.weight")]
            comfy[f"{module}.weight"] = comfy[f"{module}.weight"] + state[key.replace("lora_A", "lora_B")] @ state[key]
    for k, v in wanted.items():
        torch.testing.assert_close(comfy[k], v, msg=k)
    # diffusers: the pipeline's transformer after load_lora_weights, its LoRA fused
    fresh = load_tiny(ws, paths["diffusers"])
    pipe = fresh.pipeline(None)
    _patched_split(monkeypatch, fresh)
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    got = diffusers_to_original({k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items()
                                 if "lora_" not in k})
    for k, v in wanted.items():
        torch.testing.assert_close(got[k], v, msg=k, atol=1e-5, rtol=1e-5)
    # the released sizes are the ones diffusers' converter splits at
    real = FULL_SIZE["lumina2"]["configs"]["transformer"]
    head = real["hidden_size"] // real["num_attention_heads"]
    assert [real["hidden_size"], real["num_kv_heads"] * head, real["num_kv_heads"] * head] == [2304, 768, 768]


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("lora.type=loha", "lora.type")])
def test_validate_refuses_what_lumina2_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-lumina2", setting])
    assert err.value.key == key, str(err.value)


def test_at_the_released_sizes_diffusers_converters_read_both_files():
    """On the meta device, at Lumina-Image-2.0's sizes (where diffusers' converters split qkv at 2304/768/768): the
    fine-tune file converts back to every weight of the model with diffusers' ``convert_lumina2_to_diffusers`` (as
    with keys.py), and a LoRA file (attention only: the rest is zero padding) converts to adapters of the model's
    Linears with their shapes."""
    from diffusers import Lumina2Transformer2DModel
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lumina2_lora_to_diffusers
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers
    from trainer.families.lumina2 import lora_keys
    from trainer.families.lumina2.keys import CONFIG, diffusers_to_original, original_to_diffusers
    with torch.device("meta"):
        model = Lumina2Transformer2DModel(**{k: v for k, v in CONFIG.items() if k != "_class_name"})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    original = diffusers_to_original(model.state_dict())
    assert {k: tuple(v.shape) for k, v in convert_lumina2_to_diffusers(dict(original)).items()} == shapes
    assert {k: tuple(v.shape) for k, v in original_to_diffusers(original).items()} == shapes
    linears = {p: tuple(m.weight.shape) for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    lora = {}
    for path, (rows, cols) in linears.items():
        if path.endswith(("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")):
            lora[f"transformer.{path}.lora_A.weight"] = torch.empty(4, cols, device="meta")
            lora[f"transformer.{path}.lora_B.weight"] = torch.empty(rows, 4, device="meta")
    converted = _convert_non_diffusers_lumina2_lora_to_diffusers(lora_keys.to_original(lora, linears))
    for key, tensor in converted.items():
        rows, cols = linears[key[len("transformer."):].rsplit(".lora_", 1)[0]]
        assert tensor.shape[1 if key.endswith("lora_A.weight") else 0] == (cols if "lora_A" in key else rows), key
    assert {k.rsplit(".lora_", 1)[0] for k in lora} <= {k.rsplit(".lora_", 1)[0] for k in converted}
