"""The SDXL family (trainer/families/sdxl/family.py) on the tiny SDXL model: single-file round trip, family
mismatch messages, size/crop conditioning, and a LoRA trained through the family that diffusers loads.

The tiny model has SDXL's topology (3 levels, two text encoders, text_time conditioning), so key
names are the real ones while a build costs seconds."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainer.config.checks import load_config
from trainer.families.sources import load_model
from trainer.errors import ModelLoadError
from trainer.families.sdxl.family import SDXLConditioning, StableDiffusionXL

from conftest import denoiser_calls

TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                "conv1", "conv2", "conv_shortcut", "conv", "time_emb_proj"]
PROMPT = "a photo of a red square"


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    from trainer.families.common.sd_kit.tiny import ensure_tiny_model
    root = tmp_path_factory.mktemp("sdxl-ws")
    for kind in ("tiny-sdxl", "tiny-sd"):
        ensure_tiny_model(kind, root / "models")
    return root


@pytest.fixture(scope="module")
def model(ws) -> StableDiffusionXL:
    return StableDiffusionXL(mcfg(path="builtin:tiny-sdxl"), str(ws))


def mcfg(**kw):
    cfg = load_config(preset="demo").model
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _same_weights(a, b, name):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), f"{name}: {sorted(set(sa) ^ set(sb))[:5]}"
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, f"{name}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def _image(pipe, **kw):
    return torch.from_numpy(pipe(PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
                                 generator=torch.Generator().manual_seed(0), **kw).images)


# ------------------------------------------------------------------------------------------
# single file
# ------------------------------------------------------------------------------------------

def test_tiny_sdxl_single_file_round_trip(ws, model):
    from diffusers import StableDiffusionXLPipeline

    from trainer.families.common.sd_kit.sd_configs import detect_family

    folder, single = ws / "models" / "tiny-sdxl", ws / "models" / "tiny-sdxl.safetensors"
    assert detect_family(single) == detect_family(folder) == "sdxl"
    with safe_open(str(single), framework="pt") as f:
        keys = set(f.keys())
        g = "conditioner.embedders.1.model."
        hidden = model.text_encoder_2.config.hidden_size
        assert f.get_slice(g + "transformer.resblocks.0.attn.in_proj_weight").get_shape() == [3 * hidden, hidden]
        assert f.get_slice(g + "text_projection").get_shape() == [hidden, model.text_encoder_2.config.projection_dim]
    for key in ("model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.input_blocks.4.1.proj_in.weight",
                "model.diffusion_model.middle_block.1.transformer_blocks.1.attn2.to_k.weight",
                "model.diffusion_model.output_blocks.2.2.conv.weight", "first_stage_model.decoder.up.3.upsample.conv.weight",
                "conditioner.embedders.0.transformer.text_model.encoder.layers.1.mlp.fc2.bias",
                g + "token_embedding.weight", g + "positional_embedding", g + "ln_final.weight",
                g + "transformer.resblocks.1.mlp.c_proj.weight"):
        assert key in keys, key
    assert not any(k.startswith("cond_stage_model.") for k in keys)

    loaded = StableDiffusionXLPipeline.from_single_file(str(single), config=str(folder), local_files_only=True)
    single_model = StableDiffusionXL(mcfg(path=str(single), config_path=str(folder)), str(ws))
    assert single_model.source.kind == "single_file" and single_model.family == "sdxl"
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        _same_weights(getattr(model, name), getattr(loaded, name), name)
        _same_weights(getattr(model, name), getattr(single_model, name), name)


def test_shipped_sdxl_config_builds_real_sized_models_on_meta(tmp_path):
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from trainer.families.common.sd_kit.sd_configs import config_folder, default_config_for, detect_family

    assert default_config_for("sdxl", "epsilon") == default_config_for("sdxl", "v_prediction") == "sdxl"
    folder = config_folder("sdxl", tmp_path)
    assert detect_family(folder) == "sdxl"
    assert StableDiffusionXLPipeline.load_config(str(folder))["_class_name"] == "StableDiffusionXLPipeline"
    sched = EulerDiscreteScheduler.from_pretrained(str(folder), subfolder="scheduler", local_files_only=True)
    assert (sched.config.prediction_type, sched.config.timestep_spacing, sched.config.steps_offset) == ("epsilon", "leading", 1)
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        te1 = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder"))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(folder / "text_encoder_2"))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert next(unet.parameters()).device.type == "meta"
    assert (count(unet), count(te2), count(te1), count(vae)) == (2_567_463_684, 694_659_840, 123_060_480, 83_653_863)
    assert vae.config.scaling_factor == 0.13025 and unet.config.cross_attention_dim == 2048

    ids = [49406, 320, 1125, 539, 320, 2368, 49407]
    for sub, pad_id in (("tokenizer", 49407), ("tokenizer_2", 0)):  # CLIP-L pads with <|endoftext|>, G with "!"
        tok = CLIPTokenizer.from_pretrained(str(folder), subfolder=sub, local_files_only=True)
        assert len(tok) == 49408 and tok.model_max_length == 77
        padded = tok("a photo of a cat", padding="max_length", max_length=77).input_ids
        assert padded[:7] == ids and padded[7:] == [pad_id] * 70


# ------------------------------------------------------------------------------------------
# wrong family
# ------------------------------------------------------------------------------------------

def test_family_mismatch_messages_both_ways(ws, tmp_path):
    from trainer.families.sd.family import StableDiffusion

    models = ws / "models"
    for sd15 in (models / "tiny-sd.safetensors", models / "tiny-sd"):
        with pytest.raises(ModelLoadError, match=r"looks like SD 1\.x \(sd15\).*set up for SDXL.*model\.family to sd15"):
            StableDiffusionXL(mcfg(path=str(sd15)), str(ws))
    for sdxl in (models / "tiny-sdxl.safetensors", models / "tiny-sdxl"):  # the reverse, file and folder
        with pytest.raises(ModelLoadError, match=r"looks like SDXL \(sdxl\).*set up for SD 1\.x/2\.x.*model\.family to sdxl"):
            StableDiffusion(mcfg(path=str(sdxl)), str(ws))
    with pytest.raises(ModelLoadError, match="model.family is sd15"):
        StableDiffusionXL(mcfg(path="builtin:tiny-sdxl", family="sd15"), str(ws))

    # a 9-channel (inpainting) SDXL single file is loaded with the built-in SDXL inpainting config (the
    # SDXL config with a 9-channel UNet; tests/test_inpaint.py loads tiny ones); this tiny file does not
    # fit that real-sized config, and the message names the config and model.config_path
    state = load_file(str(models / "tiny-sdxl.safetensors"))
    conv_in = state["model.diffusion_model.input_blocks.0.0.weight"]
    state["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(conv_in.shape[0], 9, *conv_in.shape[2:])
    save_file(state, str(tmp_path / "inpaint.safetensors"))
    with pytest.raises(ModelLoadError,
                       match=r"single-file sdxl-inpaint checkpoint \(config .*sdxl-inpaint\).*model.config_path"):
        StableDiffusionXL(mcfg(path=str(tmp_path / "inpaint.safetensors")), str(ws))


def test_load_model_picks_the_family(ws, model):
    assert isinstance(load_model(mcfg(path="builtin:tiny-sdxl"), str(ws)), StableDiffusionXL)
    assert type(load_model(mcfg(path="builtin:tiny-sd"), str(ws))).__name__ == "StableDiffusion"


# ------------------------------------------------------------------------------------------
# conditioning
# ------------------------------------------------------------------------------------------

def test_condition_time_ids_match_each_crop(model):
    captions = ["a photo of a dog", "a red square", "sks cat"]
    originals = [(1200, 800), (64, 64), (333, 1000)]
    crops = [(17, 0), (0, 0), (0, 211)]
    cond = model.condition(captions, originals, crops, (64, 96))
    assert isinstance(cond, SDXLConditioning)
    expected = torch.tensor([[1200, 800, 17, 0, 64, 96], [64, 64, 0, 0, 64, 96], [333, 1000, 0, 211, 64, 96]],
                            dtype=torch.float32)
    torch.testing.assert_close(cond.time_ids, expected, rtol=0, atol=0)
    assert cond.added_cond_kwargs["time_ids"] is cond.time_ids
    per_image = model.add_time_ids(torch.tensor(originals), torch.tensor(crops), [(64, 96), (64, 64), (96, 64)])
    assert per_image[:, 4:].tolist() == [[64, 96], [64, 64], [96, 64]]
    with pytest.raises(ValueError, match="crop_top_lefts"):
        model.add_time_ids(originals, crops[:2], (64, 64))

    # the text half is exactly what StableDiffusionXLPipeline samples with
    pipe = model.pipeline()
    for skip in (0, 1):
        model.clip_skip = skip
        ours = model.condition(captions, originals, crops, (64, 96))
        embeds, _, pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                                  clip_skip=skip or None)
        torch.testing.assert_close(ours.prompt_embeds, embeds)
        torch.testing.assert_close(ours.pooled_prompt_embeds, pooled)
    model.clip_skip = 0
    ours = model.condition(captions, originals, crops, (64, 96))
    width_1 = model.text_encoder.config.hidden_size
    assert ours.prompt_embeds.shape == (3, 77, width_1 + model.text_encoder_2.config.hidden_size)

    # per-encoder caption dropout gives SDXL's unconditional zeros for that encoder only
    dropped = model.condition(captions, originals, crops, (64, 96), drop_te1=[True, False, False],
                              drop_te2=[False, True, False])
    assert not dropped.prompt_embeds[0, :, :width_1].any() and dropped.prompt_embeds[0, :, width_1:].any()
    assert not dropped.prompt_embeds[1, :, width_1:].any() and not dropped.pooled_prompt_embeds[1].any()
    torch.testing.assert_close(dropped.prompt_embeds[2], ours.prompt_embeds[2])

    # cached text (frozen encoders) gives the same conditioning
    cached = model.encode_captions(captions)
    again = model.condition_from_embeds(cached["prompt_embeds"], cached["pooled_prompt_embeds"], originals, crops,
                                        [(64, 96)] * 3, drop_te1=[True, False, False], drop_te2=[False, True, False])
    for field in ("prompt_embeds", "pooled_prompt_embeds", "time_ids"):
        torch.testing.assert_close(getattr(again, field), getattr(dropped, field))

    half = cond.to(torch.bfloat16)
    assert half.prompt_embeds.dtype == half.time_ids.dtype == torch.bfloat16


def test_predict_is_the_unet_call_of_stable_diffusion_xl_pipeline(model):
    """StableDiffusionXLPipeline's denoising step (no CFG at guidance 1): ``unet(latents, t, encoder_hidden_states,
    added_cond_kwargs={"text_embeds": pooled CLIP-G, "time_ids": original_size + crops_coords_top_left +
    target_size})``, each pair (height, width) / (top, left). ``predict`` on the same noisy latents and t, with the
    conditioning of the same sizes and crop, gives the same output; on 8×12 latents, with every size and offset
    different, so a swapped height and width or crop top and left would show."""
    pipe = model.pipeline("ddim")
    vsf = pipe.vae_scale_factor
    height, width = 8 * vsf, 12 * vsf
    original, crop = (1000, 1500), (37, 211)
    noise = torch.randn(1, model.unet.config.in_channels, 8, 12, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.unet)
    try:
        with torch.no_grad():
            pipe(PROMPT, height=height, width=width, latents=noise.clone(), num_inference_steps=2,
                 guidance_scale=1.0, original_size=original, crops_coords_top_left=crop, output_type="latent")
            ref = calls[1]
            x, t = ref["args"][:2]
            assert ref["kwargs"]["added_cond_kwargs"]["time_ids"].tolist() == [[1000, 1500, 37, 211, height, width]]
            cond = model.batch_condition({"captions": [PROMPT], "original_sizes": [original],
                                          "crop_top_lefts": [crop], "target_sizes": [(height, width)]},
                                         lambda c: c, set())
            pred = model.predict(x, t, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])


# ------------------------------------------------------------------------------------------
# LoRA trained through the family, loaded by diffusers
# ------------------------------------------------------------------------------------------

def test_lora_trained_with_predict_loads_in_diffusers(ws, tmp_path):
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    from trainer.families.common.sd_kit.lora import lora_metadata
    from trainer.families.common.sd_kit.lora import sd_kohya_lora_state_dict as kohya_lora_state_dict
    from trainer.formats.kohya import save_lora_kohya

    m = StableDiffusionXL(mcfg(path="builtin:tiny-sdxl"), str(ws))
    m.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=UNET_TARGETS))
    for te in (m.text_encoder, m.text_encoder_2):
        te.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=TE_TARGETS))
    params = [p for mod in m.trainable_modules().values() for p in mod.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-2)
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 64, 64, generator=gen) * 2 - 1
    dist = m.encode_pixels(pixels)
    for _ in range(3):
        latents = m.sample_latents(dist, gen)
        noise = torch.randn(latents.shape, generator=gen)
        timesteps = torch.randint(0, m.num_train_timesteps, (2,), generator=gen)
        noisy, target = m.noisy_and_target(latents, noise, timesteps)
        cond = m.condition([PROMPT, "a blue circle"], [(512, 384), (64, 64)], [(0, 40), (0, 0)], (64, 64),
                           train_text_encoders={"text_encoder", "text_encoder_2"})
        loss = torch.nn.functional.mse_loss(m.predict(noisy, timesteps, cond), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ours = _image(m.pipeline("euler"))

    sd = kohya_lora_state_dict(m.unet, m.text_encoder, m.text_encoder_2, family="sdxl")
    assert any(k.startswith("lora_te1_text_model_encoder_layers_") for k in sd)
    assert any(k.startswith("lora_te2_text_model_encoder_layers_") for k in sd)
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k.lora_up.weight" in sd
    assert not any("down_blocks" in k or "up_blocks" in k for k in sd)
    path = tmp_path / "tiny-sdxl-lora.safetensors"
    save_lora_kohya(path, sd, lora_metadata("sdxl", title="tiny"), "fp32")

    fresh = StableDiffusionXLPipeline.from_pretrained(ws / "models" / "tiny-sdxl", local_files_only=True)
    fresh.set_progress_bar_config(disable=True)
    before = _image(fresh)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inconsistency was discovered.*")
        fresh.load_lora_weights(str(path))
    for name in ("unet", "text_encoder", "text_encoder_2"):
        count = [sum(isinstance(x, LoraLayer) for x in getattr(p, name).modules()) for p in (m, fresh)]
        assert count[0] == count[1] > 0, name
    after = _image(fresh)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, ours, atol=1e-4, rtol=0)
