"""Model loading from all three sources, SD 2.x v-prediction, dtypes, and text-encoder LoRA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainer.config.checks import load_config
from trainer.events import read_events
from trainer.errors import ModelLoadError
from trainer.families.sd.family import StableDiffusion

from conftest import denoiser_calls
from test_train import cli, image, overrides, tiny_pipe

pytestmark = pytest.mark.slow


def model_cfg(**kw):
    """The model settings a family loads from (model.* plus the parts' dtypes; old names such as unet_dtype work)."""
    from trainer.config.load import renamed_key
    from trainer.families.sources import ModelSettings
    cfg = load_config(preset="demo")
    for k, v in kw.items():
        for key in renamed_key(f"model.{k}"):
            OmegaConf.update(cfg, key, v)
    return ModelSettings(cfg)


def unet_state(m):
    return {k: v.clone() for k, v in m.unet.state_dict().items()}


def test_single_file_and_folder_load_the_same_weights(tiny_workspace):
    ws = tiny_workspace
    folder = StableDiffusion(model_cfg(path=str(ws / "models" / "tiny-sd")), str(ws))
    single = StableDiffusion(model_cfg(path=str(ws / "models" / "tiny-sd.safetensors"),
                                       config_path=str(ws / "models" / "tiny-sd")), str(ws))
    assert single.source.kind == "single_file" and folder.source.kind == "folder"
    a, b = unet_state(folder), unet_state(single)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert single.family == folder.family == "sd15" and single.prediction_type == "epsilon"


def test_hub_id_loads_offline_from_the_cache(tiny_workspace, tmp_path):
    ws = tiny_workspace
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--atelier--tiny-sd"
    shutil.copytree(ws / "models" / "tiny-sd", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    m = StableDiffusion(model_cfg(path="atelier/tiny-sd", hub_offline=True, cache_dir=str(tmp_path / "hub")),
                        str(ws))
    assert m.source.kind == "hub" and m.family == "sd15"
    with pytest.raises(ModelLoadError, match="not in the hub cache"):
        StableDiffusion(model_cfg(path="atelier/other-model", hub_offline=True,
                                  cache_dir=str(tmp_path / "hub")), str(ws))


def test_sd2_reads_v_prediction_and_override_wins(tiny_workspace):
    ws = tiny_workspace
    sd2 = StableDiffusion(model_cfg(path="builtin:tiny-sd2"), str(ws))
    assert sd2.family == "sd2" and sd2.prediction_type == "v_prediction"
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    _, target = sd2.noisy_and_target(latents, noise, t)
    torch.testing.assert_close(target, sd2.noise_scheduler.get_velocity(latents, noise, t))
    eps = StableDiffusion(model_cfg(path="builtin:tiny-sd2", prediction_type="epsilon"), str(ws))
    assert eps.prediction_type == "epsilon"
    _, target = eps.noisy_and_target(latents, noise, t)
    torch.testing.assert_close(target, noise)


def test_weight_dtypes_per_component(tiny_workspace):
    m = StableDiffusion(model_cfg(path="builtin:tiny-sd", unet_dtype="bf16", text_encoder_dtype="fp16",
                                  vae_dtype="fp32"), str(tiny_workspace))
    assert m.unet.dtype == torch.bfloat16 and m.text_encoder.dtype == torch.float16
    assert m.vae.dtype == torch.float32


def test_wrong_family_and_not_a_model(tiny_workspace, tmp_path):
    junk = tmp_path / "junk.safetensors"
    from safetensors.torch import save_file
    save_file({"hello": torch.zeros(2)}, str(junk))
    with pytest.raises(ModelLoadError, match="junk.safetensors"):
        StableDiffusion(model_cfg(path=str(junk)), str(tiny_workspace))
    with pytest.raises(ModelLoadError, match="model.family is sd2"):
        StableDiffusion(model_cfg(path=str(tiny_workspace / "models" / "tiny-sd.safetensors"),
                                  config_path=str(tiny_workspace / "models" / "tiny-sd"), family="sd2"),
                        str(tiny_workspace))


def test_sd2_single_file_lora_run_in_bf16_with_checkpointing(tiny_workspace, peft_strict):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo", *overrides(
        ws, "sd2", f"model.path={ws / 'models' / 'tiny-sd2.safetensors'}",
        f"model.config_path={ws / 'models' / 'tiny-sd2'}", "model.unet_dtype=bf16",
        "training.mixed_precision=bf16", "training.gradient_checkpointing=true", "training.epochs=1",
        "sampling.prompts=[]")])
    assert rc == 0
    run = ws / "runs" / "sd2"
    losses = [e["loss"] for e in read_events(run / "events.jsonl") if e["type"] == "step"]
    assert losses and all(l == l and l < 100 for l in losses)
    from safetensors import safe_open
    with safe_open(str(run / "sd2.safetensors"), "pt") as fh:
        assert fh.metadata()["ss_base_model_version"] == "sd_v2_v"
    pipe = tiny_pipe(ws, "tiny-sd2")
    before = image(pipe)
    pipe.load_lora_weights(str(run / "sd2.safetensors"))
    assert abs(image(pipe) - before).max() > 1e-4


def test_text_encoder_only_lora_changes_output_through_the_prompt(tiny_workspace, peft_strict):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo", *overrides(
        ws, "te", "training.train_unet=false", "training.train_text_encoder=true", "training.epochs=1",
        "training.learning_rate=0.01", "sampling.prompts=[]")])
    assert rc == 0
    lora = ws / "runs" / "te" / "te.safetensors"
    from safetensors import safe_open
    with safe_open(str(lora), "pt") as fh:
        keys = set(fh.keys())
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_1_mlp_fc2.alpha" in keys
    assert not any(k.startswith("lora_unet") for k in keys)
    pipe = tiny_pipe(ws)
    before = image(pipe)
    pipe.load_lora_weights(str(lora))
    assert abs(image(pipe) - before).max() > 1e-4


def test_sdxl_lora_run_with_both_text_encoders_loads_in_diffusers(tiny_workspace, peft_strict):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo-sdxl", *overrides(ws, "xl", "training.epochs=1", "sampling.prompts=[]")])
    assert rc == 0
    lora = ws / "runs" / "xl" / "xl.safetensors"
    from safetensors import safe_open
    with safe_open(str(lora), "pt") as fh:
        keys = set(fh.keys())
        assert fh.metadata()["ss_base_model_version"] == "sdxl_base_v1-0"
    assert any(k.startswith("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q") for k in keys)
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj") for k in keys)
    assert any(k.startswith("lora_te2_text_model_encoder_layers_0_mlp_fc1") for k in keys)
    from diffusers import StableDiffusionXLPipeline
    pipe = StableDiffusionXLPipeline.from_pretrained(ws / "models" / "tiny-sdxl", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    before = image(pipe)
    pipe.load_lora_weights(str(lora))
    assert abs(image(pipe) - before).max() > 1e-4


def test_sdxl_finetune_single_file_loads_back(tiny_workspace):
    ws = tiny_workspace
    rc = cli(["train", "--preset", "demo-sdxl", *overrides(
        ws, "xlft", "training.method=finetune", "training.train_text_encoder=false",
        "training.train_text_encoder_2=false", "training.max_steps=2", "sampling.prompts=[]",
        "output.format=safetensors", "output.dtype=fp32", "backup.every_n_epochs=0")])
    assert rc == 0
    from diffusers import StableDiffusionXLPipeline
    loaded = StableDiffusionXLPipeline.from_single_file(str(ws / "runs" / "xlft" / "xlft.safetensors"),
                                                        config=str(ws / "models" / "tiny-sdxl"),
                                                        local_files_only=True)
    original = StableDiffusionXLPipeline.from_pretrained(ws / "models" / "tiny-sdxl", local_files_only=True)
    got, orig = loaded.unet.state_dict(), original.unet.state_dict()
    assert got.keys() == orig.keys()
    assert any(not torch.equal(got[k], orig[k]) for k in got)  # trained
    te_a, te_b = loaded.text_encoder_2.state_dict(), original.text_encoder_2.state_dict()
    assert all(torch.equal(te_a[k], te_b[k]) for k in te_b)  # frozen encoder written back unchanged


def test_xformers_when_not_installed_is_a_clear_error(tiny_workspace):
    try:
        import xformers  # noqa: F401
        pytest.skip("xformers is installed here")
    except ImportError:
        pass
    with pytest.raises(ModelLoadError, match="model.attention = xformers.*Use sdpa"):
        StableDiffusion(model_cfg(path="builtin:tiny-sd", attention="xformers"), str(tiny_workspace))


def test_predict_is_the_unet_call_of_stable_diffusion_pipeline(tiny_workspace):
    """StableDiffusionPipeline's denoising step (no CFG at guidance 1, DDIM leaves the input unscaled):
    ``unet(latents, t, encoder_hidden_states=prompt_embeds)``. ``predict`` on the same noisy latents, t and the
    caption's conditioning gives the same output; on 8×12 latents."""
    ws = tiny_workspace
    model = StableDiffusion(model_cfg(path=str(ws / "models" / "tiny-sd")), str(ws))
    pipe = model.pipeline("ddim")
    vsf = pipe.vae_scale_factor
    noise = torch.randn(1, model.unet.config.in_channels, 8, 12, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.unet)
    try:
        with torch.no_grad():
            pipe("a red square", height=8 * vsf, width=12 * vsf, latents=noise.clone(), num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent")
            ref = calls[1]
            x, t = ref["args"][:2]
            assert 0 < int(t) < 999
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            pred = model.predict(x, t, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
