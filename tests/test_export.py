"""Export formats, tested by loading our files back with the real loaders (diffusers, peft).

Tiny models with the real SD topologies stand in for SD1.5/SD2 (see trainer/families/common/sd_kit/tiny.py), so
key names are the ones real files use, while a build costs about a second.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.families.common.sd_kit.keys import save_single_file_sd, single_file_state_dict, unet_key_to_original
from trainer.families.common.sd_kit.lora import lora_metadata
from trainer.families.common.sd_kit.lora import sd_kohya_lora_state_dict as kohya_lora_state_dict
from trainer.families.common.sd_kit.lora import sd_load_lora_kohya_into_peft as load_lora_kohya_into_peft
from trainer.formats.checkpoint import save_diffusers_folder
from trainer.formats.kohya import save_lora_kohya
from trainer.io import atomic_dir, atomic_path, atomic_write_bytes, save_safetensors_atomic
from trainer.families.common.sd_kit.tiny import build_tiny_pipeline

FAMILY = {"tiny-sd": "sd15", "tiny-sd2": "sd2"}
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LOCON_TARGETS = UNET_TARGETS + ["conv1", "conv2", "conv_shortcut", "proj_in", "proj_out",
                                "ff.net.0.proj", "ff.net.2", "time_emb_proj", "conv", "conv_in", "conv_out"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
PROMPT = "a photo of a red square"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def _pipe(kind: str = "tiny-sd"):
    pipe = build_tiny_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe):
    generator = torch.Generator().manual_seed(0)
    return torch.from_numpy(pipe(PROMPT, num_inference_steps=2, generator=generator, output_type="np",
                                 height=64, width=64).images)


def _add_lora(pipe, unet_targets, seed=1, use_dora=False, te=True):
    """peft LoRA with alpha != rank and random (non-zero) lora_B, as after some training."""
    from peft import LoraConfig

    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=unet_targets,
                                     init_lora_weights="gaussian", use_dora=use_dora))
    if te:
        pipe.text_encoder.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=TE_TARGETS,
                                                 init_lora_weights="gaussian", use_dora=use_dora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model in (pipe.unet, pipe.text_encoder):
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _assert_same_state(a, b, name):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), f"{name}: key sets differ: {sorted(set(sa) ^ set(sb))[:5]}"
    bad = [k for k in sa if not torch.equal(sa[k], sb[k].to(sa[k].dtype))]
    assert not bad, f"{name}: {len(bad)} tensors differ, e.g. {bad[:5]}"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _load_lora_strictly(pipe, path):
    """load_lora_weights, failing on peft's partial-load warning and on any library warning log."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # conftest quiets these (DIFFUSERS_VERBOSITY=error); here we must hear them
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*inconsistency was discovered.*")
            pipe.load_lora_weights(str(path))
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert not handler.messages, handler.messages


def _count_lora_layers(model) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in model.modules())


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per kind: the pipeline and its diffusers folder (the config from_single_file needs)."""
    built = {}
    for kind in FAMILY:
        pipe = _pipe(kind)
        folder = tmp_path_factory.mktemp(kind) / "diffusers"
        pipe.save_pretrained(folder)
        built[kind] = (pipe, folder)
    return built


# ------------------------------------------------------------------------------------------
# single-file checkpoints
# ------------------------------------------------------------------------------------------

def _from_single_file(path, folder, **kwargs):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_single_file(str(path), config=str(folder), local_files_only=True, **kwargs)


@pytest.mark.parametrize("kind", list(FAMILY))
def test_single_file_round_trip_is_exact(tiny, tmp_path, kind):
    pipe, folder = tiny[kind]
    path = tmp_path / "model.safetensors"
    save_single_file_sd(path, pipe.unet, pipe.vae, pipe.text_encoder, family=FAMILY[kind], dtype="fp32",
                        metadata={"modelspec.title": "tiny"})
    loaded = _from_single_file(path, folder)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_state(getattr(pipe, name), getattr(loaded, name), name)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["modelspec.title"] == "tiny"


def test_single_file_uses_original_names(tiny):
    """Names real SD1.5/SD2 files have (the tiny models share their topology)."""
    pipe, _ = tiny["tiny-sd"]
    sd1 = single_file_state_dict(pipe.unet, pipe.vae, pipe.text_encoder, "sd15")
    for key in ("model.diffusion_model.input_blocks.3.0.op.weight",
                "model.diffusion_model.output_blocks.2.1.conv.weight",
                "model.diffusion_model.output_blocks.5.2.conv.weight",
                "model.diffusion_model.output_blocks.11.0.skip_connection.weight",
                "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight",
                "model.diffusion_model.time_embed.2.bias", "model.diffusion_model.out.2.weight",
                "first_stage_model.decoder.up.3.upsample.conv.weight",
                "first_stage_model.encoder.down.1.block.0.nin_shortcut.weight",
                "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
                "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc2.bias"):
        assert key in sd1, key
    c = pipe.vae.config.block_out_channels[-1]
    assert sd1["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (c, c, 1, 1)
    assert sd1["first_stage_model.decoder.mid.attn_1.proj_out.weight"].shape == (c, c, 1, 1)

    pipe2, _ = tiny["tiny-sd2"]
    sd2 = single_file_state_dict(pipe2.unet, pipe2.vae, pipe2.text_encoder, "sd2")
    hidden = pipe2.text_encoder.config.hidden_size
    assert sd2["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"].shape == (3 * hidden, hidden)
    for key in ("cond_stage_model.model.token_embedding.weight", "cond_stage_model.model.positional_embedding",
                "cond_stage_model.model.ln_final.weight", "cond_stage_model.model.transformer.resblocks.1.ln_2.bias",
                "cond_stage_model.model.transformer.resblocks.1.mlp.c_proj.weight"):
        assert key in sd2, key
    assert not any(k.startswith("cond_stage_model.transformer.") for k in sd2)


def test_single_file_ckpt_and_fp16(tiny, tmp_path):
    pipe, folder = tiny["tiny-sd"]
    ckpt = tmp_path / "model.ckpt"
    save_single_file_sd(ckpt, pipe.unet, pipe.vae, pipe.text_encoder, family="sd15", dtype="fp32")
    assert set(torch.load(ckpt, weights_only=True)) == {"state_dict"}
    loaded = _from_single_file(ckpt, folder)
    _assert_same_state(pipe.unet, loaded.unet, "unet")

    half = tmp_path / "half.safetensors"
    save_single_file_sd(half, pipe.unet, pipe.vae, pipe.text_encoder, family="sd15", dtype="fp16")
    assert {t.dtype for t in load_file(half).values()} == {torch.float16}
    loaded = _from_single_file(half, folder, torch_dtype=torch.float32)
    for name in ("unet", "vae", "text_encoder"):
        ours = getattr(pipe, name).state_dict()
        theirs = getattr(loaded, name).state_dict()
        assert all(torch.equal(ours[k].half().float(), theirs[k].float()) for k in ours), name
    assert pipe.unet.dtype == torch.float32  # exporting never casts the caller's models


def test_single_file_refuses_unmerged_lora(tmp_path):
    pipe = _pipe()
    _add_lora(pipe, UNET_TARGETS, te=False)
    with pytest.raises(ValueError, match="Merge them first"):
        save_single_file_sd(tmp_path / "x.safetensors", pipe.unet, pipe.vae, pipe.text_encoder, "sd15", "fp32")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------
# kohya LoRA
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_pipe():
    """tiny-sd with a non-zero attention LoRA (r=4, alpha=2) on UNet and text encoder."""
    pipe = _pipe()
    base = _image(pipe)
    _add_lora(pipe, UNET_TARGETS)
    return pipe, base, _image(pipe)


def test_kohya_layout_and_metadata(lora_pipe, tmp_path):
    pipe, _, _ = lora_pipe
    sd = kohya_lora_state_dict(pipe.unet, pipe.text_encoder)
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    assert sd[f"{name}.lora_down.weight"].shape == (4, pipe.unet.config.block_out_channels[0])
    assert sd[f"{name}.lora_up.weight"].shape == (pipe.unet.config.block_out_channels[0], 4)
    assert sd[f"{name}.alpha"].ndim == 0 and sd[f"{name}.alpha"].item() == 2.0
    for key in ("lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_out_0.lora_up.weight",
                "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_k.alpha",
                "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha",
                "lora_te_text_model_encoder_layers_1_self_attn_out_proj.lora_down.weight",
                "lora_te_text_model_encoder_layers_1_mlp_fc2.lora_up.weight"):
        assert key in sd, key
    assert all(k.startswith(("lora_unet_", "lora_te_text_model_")) for k in sd)

    path = tmp_path / "lora.safetensors"
    save_lora_kohya(path, sd, lora_metadata("sd15", title="tiny", resolution=64), "fp16")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert f.get_tensor(f"{name}.lora_down.weight").dtype == torch.float16
        assert f.get_tensor(f"{name}.alpha").dtype == torch.float32
    assert meta["ss_network_dim"] == "4" and float(meta["ss_network_alpha"]) == 2.0
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_network_module"] == "networks.lora"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert meta["modelspec.resolution"] == "64x64"


def test_kohya_lora_loads_in_diffusers_with_same_output(lora_pipe, tmp_path):
    pipe, base, with_lora = lora_pipe
    path = tmp_path / "lora.safetensors"
    save_lora_kohya(path, kohya_lora_state_dict(pipe.unet, pipe.text_encoder), None, "fp32")
    fresh = _pipe()
    _load_lora_strictly(fresh, path)
    assert _count_lora_layers(fresh.unet) == _count_lora_layers(pipe.unet)
    assert _count_lora_layers(fresh.text_encoder) == _count_lora_layers(pipe.text_encoder)
    out = _image(fresh)
    assert (with_lora - base).abs().max() > 1e-2  # the LoRA does something
    torch.testing.assert_close(out, with_lora, atol=1e-4, rtol=0)  # alpha/rank respected


def test_locon_loads_in_diffusers_with_no_dropped_keys(tmp_path):
    pipe = _pipe("tiny-sd2")
    _add_lora(pipe, LOCON_TARGETS, seed=2)
    with_lora = _image(pipe)
    sd = kohya_lora_state_dict(pipe.unet, pipe.text_encoder, family="sd2")
    assert sd["lora_unet_down_blocks_1_resnets_0_conv1.lora_down.weight"].shape[2:] == (3, 3)
    assert sd["lora_unet_down_blocks_1_resnets_0_conv_shortcut.lora_up.weight"].ndim == 4
    assert "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_ff_net_0_proj.alpha" in sd
    path = tmp_path / "locon.safetensors"
    meta = lora_metadata("sd2", title="tiny", prediction_type="v_prediction")
    save_lora_kohya(path, sd, meta, "fp32")
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
        assert f.metadata()["ss_base_model_version"] == "sd_v2_v"
        assert "conv_dim" in f.metadata()["ss_network_args"]
    fresh = _pipe("tiny-sd2")
    _load_lora_strictly(fresh, path)
    assert _count_lora_layers(fresh.unet) == _count_lora_layers(pipe.unet)
    assert _count_lora_layers(fresh.text_encoder) == _count_lora_layers(pipe.text_encoder)
    torch.testing.assert_close(_image(fresh), with_lora, atol=1e-4, rtol=0)


def test_load_kohya_into_peft_restores_weights_and_alpha(lora_pipe, tmp_path):
    pipe, _, _ = lora_pipe
    path = tmp_path / "lora.safetensors"
    sd = kohya_lora_state_dict(pipe.unet, pipe.text_encoder)
    sd = {k: (torch.tensor(3.0) if k.endswith(".alpha") else v) for k, v in sd.items()}  # alpha 3 in the file
    save_lora_kohya(path, sd, None, "fp32")

    fresh = _pipe()
    _add_lora(fresh, UNET_TARGETS, seed=99)  # different weights, alpha 2
    loaded = load_lora_kohya_into_peft(path, fresh.unet, fresh.text_encoder)
    assert loaded == len([k for k in sd if k.endswith(".alpha")])
    for name in ("unet", "text_encoder"):
        ours, theirs = _lora_params(getattr(pipe, name)), _lora_params(getattr(fresh, name))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    layer = fresh.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert layer.lora_alpha["default"] == 3.0 and layer.scaling["default"] == 3.0 / 4


def test_load_kohya_into_peft_names_unmatched_keys(lora_pipe, tmp_path):
    pipe, _, _ = lora_pipe
    sd = kohya_lora_state_dict(pipe.unet)
    fresh = _pipe()
    _add_lora(fresh, ["to_q"], te=False)
    with pytest.raises(ValueError, match="attn1_to_k"):
        load_lora_kohya_into_peft(sd, fresh.unet)
    only_q = {k: v for k, v in sd.items() if "_to_q." in k}
    assert load_lora_kohya_into_peft(only_q, fresh.unet) > 0
    del only_q["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"]
    with pytest.raises(ValueError, match="mid_block_attentions_0_transformer_blocks_0_attn1_to_q"):
        load_lora_kohya_into_peft(only_q, fresh.unet)


def test_dora_scale_round_trip(tmp_path):
    """diffusers' SD loader drops kohya dora_scale (with a warning), so DoRA is checked through our loader."""
    pipe = _pipe()
    _add_lora(pipe, ["to_q", "conv1"], use_dora=True, te=False)
    sd = kohya_lora_state_dict(pipe.unet)
    channels = pipe.unet.config.block_out_channels[0]
    assert sd["lora_unet_down_blocks_0_resnets_0_conv1.dora_scale"].shape == (channels, 1, 1, 1)
    assert sd["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.dora_scale"].ndim == 2
    path = tmp_path / "dora.safetensors"
    save_lora_kohya(path, sd, None, "fp32")
    with pytest.raises(AssertionError, match="DoRA checkpoint"):  # also proves _load_lora_strictly hears logs
        _load_lora_strictly(_pipe(), path)
    fresh = _pipe()
    _add_lora(fresh, ["to_q", "conv1"], use_dora=True, te=False, seed=5)
    load_lora_kohya_into_peft(path, fresh.unet)
    ours, theirs = _lora_params(pipe.unet), _lora_params(fresh.unet)
    assert any("lora_magnitude_vector" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# Each loader's DoRA formula, as published (see trainer/formats/dora.py): base weight W, the file's up/down/alpha/
# dora_scale for one layer -> the weight the loader computes.
def _lora_diff(W, f):
    return (f["up"].flatten(1) @ f["down"].flatten(1)).reshape(W.shape) * (f["alpha"] / f["down"].shape[0])


def _input_axis_norm(V):
    return V.transpose(0, 1).reshape(V.shape[1], -1).norm(dim=1, keepdim=True) \
        .reshape(V.shape[1], *[1] * (V.dim() - 1)).transpose(0, 1)


def _comfyui(W, f):  # comfy/weight_adapter/base.py weight_decompose (also Forge's backend)
    V, s = W + _lora_diff(W, f), f["dora_scale"]
    if s.shape[0] == V.shape[0]:
        norm = W.reshape(W.shape[0], -1).norm(dim=1, keepdim=True).reshape(W.shape[0], *[1] * (W.dim() - 1))
    else:
        norm = _input_axis_norm(V)
    return V * (s / (norm + torch.finfo(W.dtype).eps))


def _a1111(W, f):  # extensions-builtin/Lora/network.py apply_weight_decompose (v1.10)
    V = W + _lora_diff(W, f)
    return V * (f["dora_scale"] / _input_axis_norm(V))


def _lycoris(W, f):  # LyCORIS apply_weight_decompose (decompose on the output axis), as peft trains it
    V = W + _lora_diff(W, f)
    return V * (f["dora_scale"] / V.reshape(V.shape[0], -1).norm(dim=1).reshape(V.shape[0], *[1] * (V.dim() - 1)))


LOADERS = {"comfyui": _comfyui, "a1111": _a1111, "lycoris": _lycoris}


def test_each_dora_format_rebuilds_the_trained_weights_in_its_loader(tmp_path):
    """For each output.dora_format, the loader it names rebuilds exactly the weight peft trained (and the
    other loaders do not: the formats really differ); resuming from each file restores the magnitudes."""
    import copy

    from safetensors.torch import load_file
    from trainer.families.common.sd_kit.lora import sd_named_targets as _named_targets
    pipe = _pipe()
    _add_lora(pipe, ["to_q", "conv1"], use_dora=True, te=False)
    layers = {k: layer for k, (_, layer) in _named_targets(pipe.unet, None, None, "default", "sd15").items()}
    base = {k: layer.get_base_layer().weight.detach().clone() for k, layer in layers.items()}
    merged_unet = copy.deepcopy(pipe.unet)
    merged = {}
    for k, (_, layer) in _named_targets(merged_unet, None, None, "default", "sd15").items():
        layer.merge(adapter_names=["default"])  # peft's own DoRA merge: the trained weight
        merged[k] = layer.get_base_layer().weight.detach()
    for fmt, loader in LOADERS.items():
        path = tmp_path / f"dora-{fmt}.safetensors"
        save_lora_kohya(path, kohya_lora_state_dict(pipe.unet, dora_format=fmt), {"atelier_dora_format": fmt}, "fp32")
        state = load_file(path)
        for k in layers:
            f = {"up": state[f"{k}.lora_up.weight"], "down": state[f"{k}.lora_down.weight"],
                 "alpha": float(state[f"{k}.alpha"]), "dora_scale": state[f"{k}.dora_scale"]}
            for other, apply in LOADERS.items():
                err = (apply(base[k], f) - merged[k]).abs().max().item() / merged[k].abs().max().item()
                if other == fmt:
                    assert err < 1e-5, (fmt, k, err)
                elif not (fmt, other) == ("comfyui", "lycoris"):  # peft's init can leave ‖W‖ = ‖V‖ on a row
                    assert err > 1e-3, (fmt, other, k, err)
        fresh = _pipe()
        _add_lora(fresh, ["to_q", "conv1"], use_dora=True, te=False, seed=5)
        load_lora_kohya_into_peft(path, fresh.unet, dora_format=fmt)
        ours, theirs = _lora_params(pipe.unet), _lora_params(fresh.unet)
        for name in ours:
            assert torch.allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6), (fmt, name)


def test_rslora_alpha_is_written_as_kohya_scale():
    from peft import LoraConfig

    pipe = _pipe()
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q"], use_rslora=True))
    sd = kohya_lora_state_dict(pipe.unet)
    layer = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    alpha = sd["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha"].item()
    assert alpha / 4 == pytest.approx(layer.scaling["default"])  # kohya scale = alpha / rank


def test_sdxl_unet_names_use_original_blocks():
    """SDXL topology (3 levels, attention only on the lower two): original block names."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(8, 16, 16),
        norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=64)
    expected = {
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
        "down_blocks.2.attentions.1.transformer_blocks.1.ff.net.2": "input_blocks.8.1.transformer_blocks.1.ff.net.2",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.resnets.0.conv_shortcut": "input_blocks.4.0.skip_connection",
        "mid_block.attentions.0.proj_in": "middle_block.1.proj_in",
        "mid_block.resnets.1.time_emb_proj": "middle_block.2.emb_layers.1",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "up_blocks.1.upsamplers.0.conv": "output_blocks.5.2.conv",
        "up_blocks.2.resnets.2.conv2": "output_blocks.8.0.out_layers.3",
        "add_embedding.linear_1": "label_emb.0.0", "conv_in": "input_blocks.0.0", "conv_out": "out.2",
    }
    for diffusers_name, original in expected.items():
        assert unet_key_to_original(diffusers_name, unet) == original


def _tiny_sdxl():
    """A seeded SDXL-topology pipeline (see LIBRARY-NOTES "Tiny offline models"); none ships in tiny.py yet."""
    import tempfile

    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from trainer.families.common.sd_kit.tiny import write_tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp, model_max_length=77)

    def text_config(hidden):
        return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                              projection_dim=hidden, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(16, 32, 32),
        norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16 + 32,
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 32)
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                          block_out_channels=(8, 16), norm_num_groups=8,
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
        text_encoder=CLIPTextModel(text_config(16)), text_encoder_2=CLIPTextModelWithProjection(text_config(32)),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sdxl_lora_with_original_block_names_loads_in_diffusers(tmp_path):
    from peft import LoraConfig

    def image(p):
        return torch.from_numpy(p(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                                  output_type="np", height=32, width=32).images)

    pipe = _tiny_sdxl()
    base = image(pipe)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=LOCON_TARGETS, init_lora_weights="gaussian"))
    for te in (pipe.text_encoder, pipe.text_encoder_2):
        te.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=TE_TARGETS, init_lora_weights="gaussian"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    with_lora = image(pipe)
    sd = kohya_lora_state_dict(pipe.unet, pipe.text_encoder, pipe.text_encoder_2, family="sdxl")
    for key in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.alpha",
                "lora_unet_output_blocks_2_2_conv.lora_down.weight", "lora_unet_input_blocks_3_0_op.alpha",
                "lora_unet_middle_block_2_emb_layers_1.alpha", "lora_unet_out_2.alpha",
                "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha",
                "lora_te2_text_model_encoder_layers_1_mlp_fc2.alpha"):
        assert key in sd, key
    assert not any("down_blocks" in k or "up_blocks" in k or "mid_block" in k for k in sd)
    path = tmp_path / "sdxl.safetensors"
    save_lora_kohya(path, sd, lora_metadata("sdxl", title="tiny"), "fp32")

    fresh = _tiny_sdxl()
    _load_lora_strictly(fresh, path)
    for name in ("unet", "text_encoder", "text_encoder_2"):
        assert _count_lora_layers(getattr(fresh, name)) == _count_lora_layers(getattr(pipe, name)), name
    assert (with_lora - base).abs().max() > 1e-2
    torch.testing.assert_close(image(fresh), with_lora, atol=1e-4, rtol=0)

    again = _tiny_sdxl()
    again.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=LOCON_TARGETS))
    for te in (again.text_encoder, again.text_encoder_2):
        te.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=TE_TARGETS))
    load_lora_kohya_into_peft(path, again.unet, again.text_encoder, again.text_encoder_2, family="sdxl")
    for name in ("unet", "text_encoder", "text_encoder_2"):
        ours, theirs = _lora_params(getattr(pipe, name)), _lora_params(getattr(again, name))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


# ------------------------------------------------------------------------------------------
# atomic writes and diffusers folders
# ------------------------------------------------------------------------------------------

def test_atomic_path_failure_keeps_previous_file(tmp_path):
    path = tmp_path / "model.safetensors"
    atomic_write_bytes(path, b"good")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half-writ")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary left behind
    (tmp_path / "plain").write_bytes(b"x")
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode  # umask respected, not 0600
    (tmp_path / "plain").unlink()

    save_safetensors_atomic({"w": torch.ones(2)}, path, {"step": 3})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "3"} and torch.equal(f.get_tensor("w"), torch.ones(2))


def test_atomic_dir_swaps_or_keeps_old(tmp_path):
    folder = tmp_path / "out"
    with atomic_dir(folder) as tmp:
        (tmp / "a.txt").write_text("v1")
    with pytest.raises(KeyError):
        with atomic_dir(folder) as tmp:
            (tmp / "a.txt").write_text("v2-partial")
            raise KeyError("boom")
    assert (folder / "a.txt").read_text() == "v1"
    with atomic_dir(folder) as tmp:
        (tmp / "b.txt").write_text("v2")
    assert sorted(p.name for p in folder.iterdir()) == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_save_diffusers_folder_fp16(tiny, tmp_path):
    from diffusers import StableDiffusionPipeline

    pipe, _ = tiny["tiny-sd"]
    folder = tmp_path / "exported"
    save_diffusers_folder(folder, pipe, "fp16")
    assert pipe.unet.dtype == torch.float32
    for file in folder.rglob("*.safetensors"):
        assert {t.dtype for t in load_file(file).values()} == {torch.float16}, file
    loaded = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float16)
    for name in ("unet", "vae", "text_encoder"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert all(torch.equal(ours[k].half(), theirs[k]) for k in ours), name

    save_diffusers_folder(folder, {"unet": pipe.unet}, "fp32")  # components: one sub-folder each
    assert sorted(p.name for p in folder.iterdir()) == ["unet"]


def test_a_folder_cast_to_another_dtype_keeps_files_readable_for_other_users(tmp_path):
    """output.dtype on a diffusers-folder result rewrites each weight file: as the umask says, not 0600."""
    import os
    import stat

    from safetensors.torch import load_file, save_file

    from trainer.formats.checkpoint import _cast_saved_folder
    (tmp_path / "unet").mkdir()
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(weights))
    os.chmod(weights, 0o644)
    mask = os.umask(0o022)
    try:
        _cast_saved_folder(tmp_path, "fp16")
    finally:
        os.umask(mask)
    assert load_file(str(weights))["w"].dtype == torch.float16
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644


def test_sdxl_text_encoder_2_dora_in_a1111_format_is_exact_in_a1111s_attention_layout():
    """A1111 runs SDXL's second text encoder as OpenCLIP: one nn.MultiheadAttention per layer (fused in_proj, out_proj).
    Its Lora extension (v1.10, networks.py ``network_apply_weights``) finds q/k/v/out_proj by name, decomposes q, k and
    v against their chunk of in_proj_weight and out_proj against out_proj.weight (network.py ``finalize_updown``:
    ΔW·α/r, then ``apply_weight_decompose``, the input-axis norm). Restated here: every module is the weight peft
    trained, out_proj included."""
    import copy

    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    pipe = _tiny_sdxl()
    te2 = pipe.text_encoder_2
    te2.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=TE_TARGETS, init_lora_weights="gaussian",
                               use_dora=True))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in te2.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + ("magnitude" in name))
    sd = kohya_lora_state_dict(None, None, te2, family="sdxl", dora_format="a1111")
    base = {n: m.get_base_layer().weight.detach().clone() for n, m in te2.named_modules() if isinstance(m, LoraLayer)}
    merged = copy.deepcopy(te2)
    trained = {}
    for name, module in merged.named_modules():
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=["default"])
            trained[name] = module.get_base_layer().weight.detach()

    def updown(key, orig):
        f = {"up": sd[f"{key}.lora_up.weight"], "down": sd[f"{key}.lora_down.weight"],
             "alpha": float(sd[f"{key}.alpha"]), "dora_scale": sd[f"{key}.dora_scale"]}
        return _a1111(orig, f) - orig

    for i in range(len(te2.text_model.encoder.layers)):
        path, key = f"text_model.encoder.layers.{i}.self_attn.", f"lora_te2_text_model_encoder_layers_{i}_self_attn_"
        in_proj = torch.cat([base[path + p] for p in ("q_proj", "k_proj", "v_proj")])
        chunks = in_proj.chunk(3, 0)
        in_proj = in_proj + torch.vstack([updown(key + p, w) for p, w in zip(("q_proj", "k_proj", "v_proj"), chunks)])
        out_proj = base[path + "out_proj"] + updown(key + "out_proj", base[path + "out_proj"])
        for p, weight in zip(("q_proj", "k_proj", "v_proj", "out_proj"), (*in_proj.chunk(3, 0), out_proj)):
            torch.testing.assert_close(weight, trained[path + p], atol=1e-6, rtol=1e-5, msg=path + p)
