"""PixArt-α/Σ specifics the contract test (tests/test_families.py) does not cover: the original single-file
key map, learned-σ output, the T5 attention mask, α/Σ detection, LoRA keys ComfyUI maps, refused options; the
α 1024 path (micro-conditions, α pipeline) on ``tiny-pixart-alpha``; single files as people have them (``.pth``,
diffusers layout, 512 px α without micro-conditions, KV-compressed Σ refused)."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny_fp32, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("pixart-ws")
    return ws, build_tiny("tiny-pixart", ws / "models")


@pytest.fixture(scope="module")
def pixart_alpha(pixart):
    from trainer.families import build_tiny
    ws, _ = pixart
    return ws, build_tiny("tiny-pixart-alpha", ws / "models")


def test_original_single_file_is_the_same_transformer_and_fine_tunes_save_back_to_it(pixart, tmp_path):
    from safetensors.torch import load_file

    from trainer.families.pixart.keys import diffusers_to_original, original_to_diffusers
    ws, paths = pixart
    folder = load_tiny_fp32(ws, paths["diffusers"])
    single = load_tiny_fp32(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    assert folder.family == single.family == "pixart-sigma" and folder.prediction_type == "epsilon"
    a, b = folder.transformer.state_dict(), single.transformer.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    orig = load_file(str(paths["single_file"]))
    assert {"blocks.0.attn.qkv.weight", "blocks.0.cross_attn.kv_linear.weight", "x_embedder.proj.weight",
            "final_layer.scale_shift_table"} <= set(orig)
    back = diffusers_to_original(original_to_diffusers(orig))
    assert set(back) == set(orig) and all(torch.equal(back[k], orig[k]) for k in orig)
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn2.to_k.weight.add_(0.25)
    out = tmp_path / "ft.safetensors"
    folder.save_single_file(out, dtype="fp32")
    again = load_tiny_fp32(ws, out, f"model.config_path={paths['diffusers']}")
    torch.testing.assert_close(again.transformer.transformer_blocks[0].attn2.to_k.weight,
                               folder.transformer.transformer_blocks[0].attn2.to_k.weight, rtol=0, atol=0)


def test_learned_sigma_is_cut_and_the_t5_mask_hides_padding(pixart):
    ws, paths = pixart
    m = load_tiny_fp32(ws, paths["diffusers"])
    assert m.transformer.config.out_channels == 8  # ε ‖ variance
    cond = m.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    assert cond.prompt_attention_mask.sum().item() == 4  # 3 words + </s>; the rest is padding
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = m.predict(x, torch.tensor([500]), cond)
        # what sits in the padded positions does not reach the prediction: the mask is applied
        noisy = type(cond)(cond.prompt_embeds.clone(), cond.prompt_attention_mask)
        noisy.prompt_embeds[:, 10:] = 7.0
        again = m.predict(x, torch.tensor([500]), noisy)
    assert pred.shape == x.shape
    torch.testing.assert_close(pred, again)
    dropped = m.batch_condition({"captions": ["a red square", "a blue circle"]}, lambda c: c, set(),
                                drop_te1=[True, False])
    empty = m.batch_condition({"captions": [""]}, lambda c: c, set())
    n = int(empty.prompt_attention_mask.sum())  # the empty caption's real token(s); its padding is masked
    torch.testing.assert_close(dropped.prompt_embeds[0, :n], empty.prompt_embeds[0, :n])
    assert int(dropped.prompt_attention_mask[0].sum()) == n and dropped.lengths is None  # uncached: no lengths
    assert not torch.equal(dropped.prompt_embeds[1, :n], empty.prompt_embeds[0, :n])
    # a cached entry keeps the caption's tokens alone; the step cuts a batch at its longest caption
    entry = m.encode_captions(["a red square"])
    assert entry["prompt_attention_mask"].shape[1] == 4
    seen = transformer_inputs(m, x, torch.tensor([500]), cond)
    assert seen["encoder_hidden_states"].shape[1] == 4 and seen["encoder_attention_mask"] is None


def test_lora_keys_are_the_ones_comfyui_maps_for_pixart(pixart):
    """comfy/lora.py model_lora_keys_unet (PixArt branch) maps ``transformer.{k}`` for every weight of the
    diffusers PixArt transformer (comfy/utils.py pixart_to_diffusers) and load_lora reads
    ``{x}.lora_A.weight``/``{x}.lora_B.weight``; model_lora_keys_clip maps T5 as ``lora_te1_<module>`` when no
    CLIP is present."""
    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    ws, paths = pixart
    model = load_tiny_fp32(ws, paths["diffusers"])
    weights = {k[:-len(".weight")] for k in model.transformer.state_dict() if k.endswith(".weight")}
    t5 = {k[:-len(".weight")].replace(".", "_") for k in model.text_encoder.state_dict() if k.endswith(".weight")}
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=all",
                             "training.train_text_encoder=true"])
    state = LoraMethod(model, cfg).adapter_state_dict()
    unet_keys = [k for k in state if k.startswith("transformer.")]
    te_keys = [k for k in state if k.startswith("lora_te1_")]
    assert unet_keys and te_keys and len(unet_keys) + len(te_keys) == len(state)
    for key in unet_keys:
        assert key.endswith((".lora_A.weight", ".lora_B.weight")) and key[len("transformer."):].rsplit(".lora_", 1)[0] \
            in weights, key
    for key in te_keys:
        assert key.split(".")[0][len("lora_te1_"):] in t5, key
    assert any(".attn2.to_k." in k for k in unet_keys) and any(".ff.net.2." in k for k in unet_keys)


def test_alpha_and_sigma_single_files_are_told_apart(tmp_path):
    from safetensors.torch import save_file

    from trainer.families import Evidence, claim
    from trainer.families.checks import read_safetensors_shapes
    base = {"blocks.0.attn.qkv.weight": torch.zeros(6, 2), "blocks.0.cross_attn.kv_linear.weight": torch.zeros(4, 2)}
    for tokens, variant in ((120, "pixart-alpha"), (300, "pixart-sigma")):
        path = tmp_path / f"{tokens}.safetensors"
        save_file({**base, "y_embedder.y_embedding": torch.zeros(tokens, 8)}, str(path))
        assert claim(Evidence("single_file", str(path), shapes=read_safetensors_shapes(path))) == variant


@pytest.mark.parametrize("setting, key", [("model.clip_skip=2", "model.clip_skip"),
                                          ("training.train_text_encoder_2=true", "parts.text_encoder_2.train"),
                                          ("loss.flow_shift=3", "loss.flow_shift"),
                                          ("lora.type=loha", "lora.type"), ("lora.type=dora", "lora.type")])
def test_validate_refuses_what_pixart_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-pixart", setting])
    assert err.value.key == key


def _claim(path):
    from trainer.families import Evidence, claim
    from trainer.families.common.sd_kit.sd_configs import read_key_shapes
    return claim(Evidence("single_file", str(path), shapes=read_key_shapes(path)))


def test_alpha_1024_is_told_its_size_and_aspect_ratio_in_training_and_in_its_pipeline(pixart_alpha):
    ws, paths = pixart_alpha
    folder = load_tiny_fp32(ws, paths["diffusers"])
    single = load_tiny_fp32(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    assert folder.family == single.family == "pixart-alpha" and _claim(paths["single_file"]) == "pixart-alpha"
    assert single.transformer.config.use_additional_conditions
    a, b = folder.transformer.state_dict(), single.transformer.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    cond = folder.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        square = folder.predict(x, torch.tensor([500]), cond)
        wide = folder.predict(torch.cat([x, x], dim=3), torch.tensor([500]), cond)[..., :8]
        # the embedders really see the batch's size: without them the same latents predict otherwise
        plain = folder.transformer(x, encoder_hidden_states=cond.prompt_embeds, timestep=torch.tensor([500]),
                                   encoder_attention_mask=cond.prompt_attention_mask, return_dict=False,
                                   added_cond_kwargs={"resolution": torch.tensor([[1024.0, 1024.0]]),
                                                      "aspect_ratio": torch.tensor([[1.0]])})[0][:, :4]
    assert square.shape == x.shape and not torch.allclose(square, plain)
    assert not torch.allclose(square, wide)  # (latents differ too; the size terms at least must not be ignored)
    pipe = folder.pipeline("dpmpp_2m")
    image = pipe("a red square", num_inference_steps=2, width=64, height=64, output_type="np",
                 generator=torch.Generator().manual_seed(0), **folder.sampling_kwargs()).images[0]
    assert image.shape == (64, 64, 3) and image.std() > 0


def test_alpha_lora_through_the_protocol_memorises_and_loads_into_the_pipeline(pixart_alpha, tmp_path):
    """objective.sample_timesteps → noisy_and_target → predict → MSE on a peft LoRA of the α transformer; the
    file the family writes loads through peft into a fresh α pipeline and changes its output."""
    from peft import LoraConfig, inject_adapter_in_model
    from safetensors.torch import save_file

    from trainer.config.checks import load_config
    from trainer.families.pixart.family import load_lora_into_pipeline
    ws, paths = pixart_alpha
    model = load_tiny_fp32(ws, paths["diffusers"])
    loss_cfg = load_config(None, [f"model.path={paths['diffusers']}"]).loss
    # PixArtTransformer2DModel has no add_adapter (no PeftAdapterMixin): peft injects the layers
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                       target_modules=model.lora_targets("unet", "attn_mlp")), model.transformer)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.transformer.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=3e-2)
    g = torch.Generator().manual_seed(0)
    # memorise one image under fixed draws (fresh noise each step makes a 30-step loss too noisy to judge)
    latents = torch.randn(4, 4, 8, 8, generator=g)
    timesteps = model.objective.sample_timesteps(4, loss_cfg, g, latents)
    noisy, target = model.objective.noisy_and_target(latents, torch.randn(latents.shape, generator=g), timesteps)
    cond = model.batch_condition({"captions": ["a red square"] * 4}, lambda c: c, set())
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model.predict(model.model_input(noisy, {}), timesteps, cond), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses

    state = model.lora_state_dict({"unet": model.transformer})
    assert state and all(k.startswith("transformer.") for k in state)
    path = tmp_path / "alpha-lora.safetensors"
    save_file(state, str(path))
    fresh = load_tiny_fp32(ws, paths["diffusers"])
    kwargs = dict(num_inference_steps=2, width=64, height=64, output_type="np", **fresh.sampling_kwargs())
    pipe = fresh.pipeline()
    before = pipe("a red square", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    load_lora_into_pipeline(pipe, path)
    after = pipe("a red square", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    trained = model.pipeline()("a red square", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert abs(after - before).max() > 1e-3
    assert abs(after - trained).max() < 1e-4


def test_single_files_as_people_have_them(pixart, pixart_alpha, tmp_path):
    """The original .pth ({"state_dict": ...}), a diffusers transformer file passed alone, and a 256/512 px α file
    (null caption of 120 tokens and a pos_embed table, no size embedders) although the α config says 1024."""
    from safetensors.torch import load_file, save_file
    ws, paths = pixart
    ref = load_tiny_fp32(ws, paths["diffusers"]).transformer.state_dict()
    orig = load_file(str(paths["single_file"]))
    pth = tmp_path / "PixArt-tiny.pth"
    torch.save({"state_dict": orig}, pth)
    diffusers_file = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.items()}, str(diffusers_file))
    for path in (pth, diffusers_file):
        assert _claim(path) == "pixart-sigma", path
        got = load_tiny_fp32(ws, path, f"model.config_path={paths['diffusers']}").transformer.state_dict()
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref), path

    ws, alpha = pixart_alpha
    small = {k: v for k, v in load_file(str(alpha["single_file"])).items()
             if not k.startswith(("csize_embedder.", "ar_embedder."))}
    small["y_embedder.y_embedding"] = torch.zeros(120, 32)
    small["pos_embed"] = torch.zeros(1, 16 * 16, 24)  # 32 latent px / patch 2 → a 256 px model
    path = tmp_path / "PixArt-tiny-256.safetensors"
    save_file(small, str(path))
    assert _claim(path) == "pixart-alpha"
    model = load_tiny_fp32(ws, path, f"model.config_path={alpha['diffusers']}")  # whose config has micro-conditions
    cfg = model.transformer.config
    assert model.family == "pixart-alpha" and not cfg.use_additional_conditions and cfg.sample_size == 32
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    with torch.no_grad():
        assert torch.isfinite(model.predict(torch.randn(1, 4, 8, 8), torch.tensor([10]), cond)).all()
    out = tmp_path / "ft.safetensors"
    model.save_single_file(out, dtype="fp32")
    saved = load_file(str(out))
    assert torch.equal(saved["y_embedder.y_embedding"], small["y_embedder.y_embedding"]) and "pos_embed" in saved
    assert _claim(out) == "pixart-alpha"  # still α after a fine-tune (without the null caption it would read Σ)


def test_kv_compressed_sigma_is_refused_naming_what_it_is(pixart, tmp_path):
    from safetensors.torch import load_file, save_file

    from trainer.errors import ModelLoadError
    ws, paths = pixart
    state = load_file(str(paths["single_file"]))
    state["blocks.1.attn.sr.weight"] = torch.zeros(16, 16, 2, 2)
    path = tmp_path / "kv.safetensors"
    save_file(state, str(path))
    with pytest.raises(ModelLoadError) as err:
        load_tiny_fp32(ws, path, f"model.config_path={paths['diffusers']}")
    assert "KV token compression" in str(err.value) and err.value.key == "model.path"


def test_captions_are_lower_cased_as_the_sampling_pipeline_does(pixart):
    ws, paths = pixart
    m = load_tiny_fp32(ws, paths["diffusers"])
    upper = m.batch_condition({"captions": ["  A Red SQUARE"]}, lambda c: c, set())
    lower = m.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    torch.testing.assert_close(upper.prompt_embeds, lower.prompt_embeds, rtol=0, atol=0)
    assert m.sampling_kwargs()["clean_caption"] is False
    pipe = m.pipeline()
    embeds, mask, _, _ = pipe.encode_prompt("A Red SQUARE", do_classifier_free_guidance=False,
                                            max_sequence_length=m.max_sequence_length, clean_caption=False)
    torch.testing.assert_close(embeds, lower.prompt_embeds)


def test_the_learned_variance_trains_with_the_variational_bound_as_onetrainer_does(tmp_path):
    """PixArt predicts ε and its variance; loss.vb_strength (1, OneTrainer's default for such models) adds the
    variational bound, so the variance half learns; 0 leaves it out (the step loss is then the ε loss alone)."""
    from tests.conftest import train_quiet
    from trainer.events import read_events
    ws = tmp_path / "ws"
    steps = {}
    for strength in (1, 0):
        run = train_quiet(ws, f"vb{strength}", "demo-pixart", f"loss.vb_strength={strength}", "training.max_steps=2",
                          "sampling.prompts=[]", "general.seed=1")
        steps[strength] = [e["loss"] for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert len(steps[1]) == len(steps[0]) == 2
    assert steps[1][0] > steps[0][0]  # same batch and noise at step 1: the bound is added on top


@pytest.mark.parametrize("variant", ["sigma", "alpha"])
def test_predict_is_the_transformer_call_of_the_pixart_pipelines(pixart, pixart_alpha, variant):
    """PixArtSigmaPipeline / PixArtAlphaPipeline's denoising step (no CFG at guidance 1, no resolution binning):
    ``transformer(latents, encoder_hidden_states, encoder_attention_mask, timestep=t, added_cond_kwargs)`` with α
    1024's ``resolution`` = [height, width] in pixels and ``aspect_ratio`` = height / width, then the ε half of the
    learned-σ output. ``predict`` on the same noisy latents, t and the caption's conditioning gives the same ε; on
    8×12 latents, so a swapped height and width would show."""
    ws, paths = pixart if variant == "sigma" else pixart_alpha
    model = load_tiny_fp32(ws, paths["diffusers"])
    assert bool(model.transformer.config.get("use_additional_conditions")) == (variant == "alpha")
    pipe = model.pipeline(None)
    vsf = model.vae_scale_factor
    c = model.transformer.config.in_channels
    noise = torch.randn(1, c, 8, 12, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=8 * vsf, width=12 * vsf, latents=noise.clone(), num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]
            added = ref["kwargs"]["added_cond_kwargs"]
            if variant == "alpha":
                assert added["resolution"].tolist() == [[8.0 * vsf, 12.0 * vsf]]
                torch.testing.assert_close(added["aspect_ratio"], torch.tensor([[8 / 12]]))
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(ref["args"][0], ref["kwargs"]["timestep"], cond)
    finally:
        remove()
    assert ref["out"].shape[1] == 2 * c  # learned σ: ε ‖ variance
    torch.testing.assert_close(pred, ref["out"][:, :c])
