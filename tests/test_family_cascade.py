"""Stable Cascade and Würstchen 2 beyond the family contract: the objective and the conditioning are the ones their
pipelines sample with, the latents are the encoder's, fine-tunes save to the file layout diffusers reads back, and
each bad input gets one message naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import DEMO_DATA, denoiser_calls, load_tiny_fp32

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("cascade-ws")
    return ws, build_tiny("tiny-cascade", ws / "models"), build_tiny("tiny-wuerstchen", ws / "models")


def _load_error(ws, path, *settings):
    from trainer.errors import ModelLoadError
    with pytest.raises(ModelLoadError) as err:
        load_tiny_fp32(ws, path, *settings)
    return err.value


def test_objective_is_the_wuerstchen_schedule_with_p2_weights():
    from diffusers import DDPMWuerstchenScheduler

    from trainer.config.schema_training import LossConfig
    from trainer.objectives import CosineObjective
    obj = CosineObjective()
    gen = torch.Generator().manual_seed(0)
    t = obj.sample_timesteps(4096, LossConfig(), gen)
    assert t.dtype == torch.float32 and 0 <= float(t.min()) and float(t.max()) < 1 and abs(float(t.mean()) - 0.5) < 0.02
    x, noise = torch.randn(3, 16, 2, 2), torch.randn(3, 16, 2, 2)
    t = torch.tensor([0.05, 0.5, 0.95])
    noisy, target = obj.noisy_and_target(x, noise, t)
    a = DDPMWuerstchenScheduler()._alpha_cumprod(t, "cpu").view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, a.sqrt() * x + (1 - a).sqrt() * noise)
    assert target is noise
    snr = a.view(-1) / (1 - a.view(-1))
    torch.testing.assert_close(obj.timestep_weights(LossConfig(), t), 1 / (1 + snr))  # P2, k = γ = 1
    assert float(obj.timestep_weights(LossConfig(), t)[0]) < float(obj.timestep_weights(LossConfig(), t)[2])


def test_latents_are_the_encoders_and_conditioning_is_the_pipelines(tiny):
    from trainer.families.common.effnet import effnet_preprocess
    ws, cascade_paths, w_paths = tiny
    pixels = torch.rand(2, 3, 128, 256) * 2 - 1
    for paths, scale in ((cascade_paths, (1.0, 0.0)), (w_paths, (42.0, 1.0))):
        model = load_tiny_fp32(ws, paths["diffusers"])
        dist = model.encode_pixels(pixels)
        assert dist["mean"].shape == (2, 16, 3, 6) and not dist["std"].any()  # 128 px → 96 px → 3 latents
        torch.testing.assert_close(dist["mean"], model.effnet(effnet_preprocess(pixels)))
        torch.testing.assert_close(model.sample_latents(dist), (dist["mean"] + scale[1]) / scale[0])
        # the prior's conditioning equals what its own pipeline feeds it
        prior_pipe = model.pipeline(None).prior_pipe
        cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
        extra = {"batch_size": 1} if model.name == "cascade" else {}
        got = prior_pipe.encode_prompt(device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False,
                                       prompt=["a red square"], **extra)
        if model.name == "cascade":
            torch.testing.assert_close(cond["prompt_embeds"], got[0])
            torch.testing.assert_close(cond["prompt_embeds_pooled"], got[1])
        else:
            torch.testing.assert_close(cond["prompt_embeds"], got[0])
        # caption dropout gives the empty caption's encoding
        dropped = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set(), drop_te1=[True])
        empty = model.encode_captions([""])
        for k in dropped:
            torch.testing.assert_close(dropped[k], empty[k])


def test_cascade_fine_tune_is_comfyuis_stage_c_checkpoint(tiny, tmp_path):
    """The saved fine-tune: ComfyUI's checkpoint layout (prior in the original layout under model.diffusion_model.,
    CLIP-G under text_encoder.), whose prior diffusers' own converter reads back, and which loads as model.path."""
    from diffusers.loaders.single_file_utils import convert_stable_cascade_unet_single_file_to_diffusers
    from safetensors.torch import load_file

    from trainer.families.common.cascade_keys import split_comfy_checkpoint
    ws, paths, _ = tiny
    model = load_tiny_fp32(ws, paths["diffusers"])
    with torch.no_grad():
        next(model.prior.parameters()).add_(0.5)  # "fine-tuned"
        model.text_encoder.text_projection.weight.add_(0.25)
    out = tmp_path / "stage_c.safetensors"
    model.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert all(k.startswith(("model.diffusion_model.", "text_encoder.clip_g.")) for k in saved)
    assert "model.diffusion_model.clip_txt_mapper.weight" in saved and "text_encoder.clip_g.text_projection" in saved
    prior, text = split_comfy_checkpoint(saved)
    mine = model.prior.state_dict()
    for k, v in convert_stable_cascade_unet_single_file_to_diffusers(prior).items():
        torch.testing.assert_close(v, mine[k], msg=k)
    loaded = load_tiny_fp32(ws, out, f"model.config_path={paths['diffusers']}")
    assert loaded.family in ("stable-cascade", "stable-cascade-lite")
    for k, v in loaded.prior.state_dict().items():
        torch.testing.assert_close(v, mine[k], msg=k)
    torch.testing.assert_close(loaded.text_encoder.text_projection.weight, model.text_encoder.text_projection.weight)


def _comfy_detects_stage_c(state: dict) -> bool:
    """ComfyUI's checkpoint and UNET loaders on a state dict (comfy/model_detection.py at Comfy-Org/ComfyUI a125cd84,
    restated): ``unet_prefix_from_state_dict`` takes the prefix more than five keys start with ("model.diffusion_model."
    first), and ``detect_unet_config`` calls a model with ``clf.1.weight`` and ``clip_txt_mapper.weight`` under it
    Stable Cascade stage C (``Stable_Cascade_C``)."""
    counts = {c: sum(k.startswith(c) for k in state) for c in ("model.diffusion_model.", "model.model.", "net.")}
    top = max(counts, key=counts.get)
    prefix = top if counts[top] > 5 else "model."
    return f"{prefix}clf.1.weight" in state and f"{prefix}clip_txt_mapper.weight" in state


def test_cascade_fine_tune_in_the_layout_each_tool_reads(tiny, tmp_path):
    """diffusers' single-file converter cannot read ComfyUI's stage C checkpoint whole, so a fine-tune offers both:
    output.format = diffusers writes a prior pipeline folder that StableCascadePriorPipeline and StableCascadeUNet
    load with the trained weights; the single file is the checkpoint ComfyUI's loaders detect as stage C."""
    from diffusers import StableCascadePriorPipeline, StableCascadeUNet
    from safetensors.torch import load_file

    from trainer.config.checks import load_config
    from trainer.methods.finetune import FinetuneMethod
    ws, paths, _ = tiny
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "training.method=finetune", "output.format=diffusers"])
    model = load_tiny_fp32(ws, paths["diffusers"])
    method = FinetuneMethod(model, cfg)
    with torch.no_grad():
        next(model.prior.parameters()).add_(0.5)  # "fine-tuned"
    folder = tmp_path / "result"
    method.save(folder, "fp32", {})
    assert method.result_suffix(cfg.output.format) == ""  # a folder, not a file
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "StableCascadePriorPipeline"
    mine = model.prior.state_dict()
    pipe = StableCascadePriorPipeline.from_pretrained(folder)
    unet = StableCascadeUNet.from_pretrained(folder / "prior")
    for k, v in mine.items():
        torch.testing.assert_close(pipe.prior.state_dict()[k], v, msg=k)
        torch.testing.assert_close(unet.state_dict()[k], v, msg=k)
    torch.testing.assert_close(pipe.text_encoder.text_projection.weight, model.text_encoder.text_projection.weight)
    single = tmp_path / "stage_c.safetensors"
    method.save(single, "fp32", {})
    assert _comfy_detects_stage_c(load_file(str(single)))


def test_decoders_given_as_the_model_are_refused_naming_the_fix(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    from trainer.families.common.cascade_keys import diffusers_to_original
    ws, paths, w_paths = tiny
    stage_b = tmp_path / "stage_b.safetensors"
    decoder = load_file(str(paths["diffusers"] / "decoder" / "diffusion_pytorch_model.safetensors"))
    save_file(diffusers_to_original(decoder), str(stage_b))
    err = _load_error(ws, stage_b)
    assert err.key == "model.path" and "stage B" in str(err) and "model.decoder_path" in str(err)
    for folder, cls in ((tmp_path / "sc-decoder", "StableCascadeDecoderPipeline"),
                        (tmp_path / "w-decoder", "WuerstchenDecoderPipeline")):
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        err = _load_error(ws, folder)
        assert err.key == "model.path" and "decoder" in str(err) and "model.decoder_path" in str(err)


def test_missing_or_wrong_encoder_is_named(tiny, tmp_path):
    ws, paths, w_paths = tiny
    for source, name in ((paths, "cascade"), (w_paths, "wuerstchen")):
        bare = tmp_path / f"{name}-no-effnet"
        shutil.copytree(source["diffusers"], bare)
        (bare / "effnet_encoder.safetensors").unlink()
        err = _load_error(ws, bare, "model.hub_offline=true", f"model.cache_dir={tmp_path / 'hub'}")
        assert err.key == "model.effnet_path" and "huggingface.co" in str(err), str(err)
    # an SD VAE where the encoder should be
    vae = tmp_path / "vae.safetensors"
    from safetensors.torch import save_file
    save_file({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3), "decoder.conv_out.weight": torch.zeros(3, 8, 3, 3)},
              str(vae))
    err = _load_error(ws, paths["diffusers"], f"model.effnet_path={vae}")
    assert err.key == "model.effnet_path" and "vae.safetensors" in str(err)
    err = _load_error(ws, paths["diffusers"], f"model.effnet_path={tmp_path / 'nope.safetensors'}")
    assert err.key == "model.effnet_path" and "does not exist" in str(err)


@pytest.mark.parametrize("setting, key", [("data.resolution=96", "data.resolution"),
                                          ("data.bucket_step=64", "data.bucket_step"),
                                          ("loss.min_snr_gamma=5", "loss.min_snr_gamma"),
                                          ("loss.flow_weighting=cosmap", "loss.flow_weighting"),
                                          ("model.prediction_type=v_prediction", "model.prediction_type")])
def test_validate_refuses_what_the_cascade_families_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    for model in ("builtin:tiny-cascade", "builtin:tiny-wuerstchen"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.path={model}", "data.resolution=128", "data.bucket_step=128",
                               f"data.concepts=[{{path: {DEMO_DATA}}}]", setting])
        assert err.value.key == key, (model, str(err.value))


@pytest.mark.parametrize("preset, tiny_name", [("demo-cascade", "tiny-cascade"), ("demo-wuerstchen", "tiny-wuerstchen")])
def test_textual_inversion_trains_the_placeholder_vectors_of_the_priors_clip(preset, tiny_name, tmp_path, sks_data):
    """An embedding of the prior's CLIP-G: only the placeholder's vectors move, saved in the A1111 form (one
    ``emb_params`` tensor as wide as CLIP-G) that ComfyUI reads for these models' CLIP."""
    from safetensors.torch import load_file

    from tests.conftest import train_quiet
    ws = tmp_path / "ws"
    run = train_quiet(ws, "emb", preset, "training.method=embedding", f"data.concepts.0.path={sks_data}",
                      "embedding.placeholder=<sks>", "embedding.num_vectors=2", "embedding.initial_text=red square",
                      "training.embedding_learning_rate=0.05", "training.max_steps=4", "sampling.prompts=[]")
    vectors = load_file(str(run / f"{run.name}.safetensors"))["emb_params"]
    assert vectors.shape == (2, 32) and torch.isfinite(vectors).all()
    model = load_tiny_fp32(ws, f"builtin:{tiny_name}")
    ids = model.tokenizer("red square", add_special_tokens=False).input_ids
    initial = model.text_encoder.get_input_embeddings().weight[ids].detach()
    assert (vectors - initial).abs().max() > 1e-4  # trained away from the initial words


def test_a_cascade_lora_file_has_only_keys_comfyui_maps(tiny, tmp_path):
    """Every ``lora_prior_unet_``/``lora_prior_te_`` module of a saved Cascade LoRA (prior and CLIP-G, LoRA and
    LoHa) is one ComfyUI's key map has for a Stable Cascade stage C model and its CLIP (comfy/lora.py
    ``model_lora_keys_unet`` over the modules ``Stable_Cascade_C.process_unet_state_dict`` leaves,
    ``model_lora_keys_clip`` for CLIP-G; re-implemented in tests/test_cascade_keys.py)."""
    from test_cascade_keys import _comfy_split, _comfy_unet_key_map

    from trainer.config.checks import load_config
    from trainer.families.common.cascade_keys import diffusers_to_original
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = tiny
    model = load_tiny_fp32(ws, paths["diffusers"])
    comfy_unet = _comfy_unet_key_map(_comfy_split(diffusers_to_original(model.prior.state_dict())))
    te_layers = {n for n, m in model.text_encoder.named_modules() if ".self_attn." in n or ".mlp." in n}
    comfy_te = {"lora_prior_te_" + n.replace(".", "_") for n in te_layers}
    for kind in ("lora", "loha"):
        cfg = load_config(None, [f"model.path={paths['diffusers']}", "training.method=lora", f"lora.type={kind}",
                                 "lora.unet_targets=all", "training.train_text_encoder=true"])
        method = LoraMethod(load_tiny_fp32(ws, paths["diffusers"]), cfg)
        modules = {k.split(".", 1)[0] for k in method.adapter_state_dict()}
        unet = {m for m in modules if m.startswith("lora_prior_unet_")}
        te = {m for m in modules if m.startswith("lora_prior_te_")}
        assert unet and te and unet | te == modules, modules - unet - te
        assert unet <= set(comfy_unet), sorted(unet - set(comfy_unet))[:5]
        assert te <= comfy_te, sorted(te - comfy_te)[:5]


def test_comfyuis_stage_c_checkpoint_loads_with_the_text_encoder_it_carries(tiny, tmp_path):
    from safetensors.torch import save_file

    from trainer.families.common.cascade_keys import comfy_checkpoint, diffusers_to_original
    ws, paths, _ = tiny
    model = load_tiny_fp32(ws, paths["diffusers"])
    text = {k: v.clone() for k, v in model.text_encoder.state_dict().items()}
    text["text_projection.weight"] += 0.25  # a fine-tuned CLIP-G inside the checkpoint
    ckpt = tmp_path / "stable_cascade_stage_c.safetensors"
    save_file({k: v.contiguous() for k, v in comfy_checkpoint(diffusers_to_original(model.prior.state_dict()),
                                                               text).items()}, str(ckpt))
    loaded = load_tiny_fp32(ws, ckpt, f"model.config_path={paths['diffusers']}")
    assert loaded.name == "cascade"
    torch.testing.assert_close(loaded.text_encoder.state_dict()["text_projection.weight"], text["text_projection.weight"])
    for k, v in model.prior.state_dict().items():
        torch.testing.assert_close(loaded.prior.state_dict()[k], v, msg=k)


@pytest.mark.parametrize("name", ["cascade", "wuerstchen"])
def test_predict_is_the_prior_call_of_the_prior_pipelines(tiny, name):
    """StableCascadePriorPipeline / WuerstchenPriorPipeline's denoising step (no CFG at guidance 1): latents of
    ceil(size / 42.67) per side, the DDPMWuerstchenScheduler's t as the ratio (``timestep_ratio`` / ``r``), the
    caption's CLIP features, and for Cascade the pooled text and zero image embeddings. ``predict`` on the same
    noisy latents, ratio and the caption's conditioning gives the same output; on 3×6 latents (128×256 px)."""
    ws, cascade_paths, w_paths = tiny
    model = load_tiny_fp32(ws, (cascade_paths if name == "cascade" else w_paths)["diffusers"])
    prior_pipe = model.pipeline(None).prior_pipe
    channels = model.prior.config.get("in_channels") or model.prior.config.get("c_in")  # Cascade / Würstchen 2
    noise = torch.randn(1, channels, 3, 6, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.prior)
    try:
        with torch.no_grad():
            prior_pipe(prompt="a red square", height=128, width=256, latents=noise.clone(), num_inference_steps=2,
                       guidance_scale=1.0, output_type="pt")
            ref = calls[1]  # the second step: a ratio below 1
            if name == "cascade":
                x, ratio = ref["kwargs"]["sample"], ref["kwargs"]["timestep_ratio"]
                assert not ref["kwargs"]["clip_img"].any()
            else:
                x, ratio = ref["args"][0], ref["kwargs"]["r"]
            assert 0 < float(ratio) < 1
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(x, ratio, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
