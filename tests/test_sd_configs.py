"""Shipped SD 1.5 / 2.x diffusers configs, the CLIP tokenizer built from the BPE file, and
checkpoint family detection (trainer/families/common/sd_kit/sd_configs.py). Fast and offline."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.families.common.sd_kit import sd_configs
from trainer.families.common.sd_kit.sd_configs import (CONFIG_NAMES, CONFIGS_DIR, config_folder, default_config_for,
                                       detect_family)

U = "model.diffusion_model."


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sdcfg")
    for name in CONFIG_NAMES:
        config_folder(name, root)
    return root


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def test_clip_vocab_matches_openai_layout():
    vocab, merges = sd_configs.clip_vocab_and_merges()
    assert len(vocab) == 49408 and len(merges) == 48894
    assert vocab["!"] == 0 and vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert vocab["!</w>"] == 256 and merges[0] == "i n" and vocab["in"] == 512
    table = sd_configs.bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256 and table[ord(" ")] == "Ġ"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_tokenizer_encodes_like_clip(cache_root, name):
    from transformers import CLIPTokenizer

    folder = config_folder(name, cache_root)
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    assert len(tok) == 49408
    assert tok.model_max_length == 77
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    # the subfolder form is what from_single_file uses
    tok2 = CLIPTokenizer.from_pretrained(str(folder), subfolder="tokenizer", local_files_only=True)
    assert tok2("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    ids = tok("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77
    if name.startswith("sd2"):  # OpenCLIP pads with "!" (id 0)
        assert tok.pad_token == "!" and tok.pad_token_id == 0
        assert ids[7:] == [0] * 70
    else:  # SD 1.x pads with <|endoftext|>
        assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 49407
        assert ids[7:] == [49407] * 70


# --------------------------------------------------------------------------------------------
# materialising
# --------------------------------------------------------------------------------------------

def test_config_folder_layout_and_idempotence(tmp_path):
    folder = config_folder("sd2", tmp_path)
    assert folder == tmp_path / "configs" / "sd2"
    for rel in ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
                "scheduler/scheduler_config.json", "tokenizer/tokenizer_config.json",
                "tokenizer/special_tokens_map.json", "tokenizer/vocab.json", "tokenizer/merges.txt"):
        assert (folder / rel).is_file(), rel
    merges = (folder / "tokenizer" / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and len(merges) == 1 + 48894
    before = (folder / "tokenizer" / "vocab.json").stat().st_mtime_ns
    assert config_folder("sd2", tmp_path) == folder  # second call: nothing rebuilt
    assert (folder / "tokenizer" / "vocab.json").stat().st_mtime_ns == before
    # no temporary folders left behind
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == ["sd2"]


def test_config_folder_rebuilds_stale_or_broken_copy(tmp_path):
    folder = config_folder("sd15", tmp_path)
    (folder / "tokenizer" / "vocab.json").unlink()
    (folder / ".atelier-config").write_text("stale")
    assert config_folder("sd15", tmp_path) == folder
    assert (folder / "tokenizer" / "vocab.json").is_file()
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == ["sd15"]


def test_config_folder_rejects_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="sd15, sd2, sd2-base"):
        config_folder("sd3", tmp_path)


# --------------------------------------------------------------------------------------------
# shipped configs: what the hub repos say, real parameter counts
# --------------------------------------------------------------------------------------------

# (unet, vae, text encoder) parameter counts of the real models
REAL_COUNTS = {
    "sd15": (859_520_964, 83_653_863, 123_060_480),
    "sd2": (865_910_724, 83_653_863, 340_387_840),
    "sd2-base": (865_910_724, 83_653_863, 340_387_840),
}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_shipped_configs_build_real_sized_models_on_meta(name):
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    src = CONFIGS_DIR / name
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(src / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(src / "vae"))
        te = CLIPTextModel(CLIPTextConfig.from_pretrained(src / "text_encoder"))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert next(unet.parameters()).device.type == "meta"
    assert (count(unet), count(vae), count(te)) == REAL_COUNTS[name]
    assert vae.config.scaling_factor == 0.18215


def test_shipped_config_values():
    def load(name, rel):
        return json.loads((CONFIGS_DIR / name / rel).read_text(encoding="utf-8"))

    u15, u2, u2b = (load(n, "unet/config.json") for n in ("sd15", "sd2", "sd2-base"))
    assert u15["cross_attention_dim"] == 768 and u15["attention_head_dim"] == 8
    assert not u15.get("use_linear_projection", False) and u15["sample_size"] == 64
    assert u2["attention_head_dim"] == [5, 10, 20, 20] and u2["use_linear_projection"] is True
    assert u2["cross_attention_dim"] == 1024 and u2["sample_size"] == 96 and u2["upcast_attention"] is True
    assert u2b["sample_size"] == 64 and {k: v for k, v in u2b.items() if k not in ("sample_size",)} == {
        k: v for k, v in u2.items() if k not in ("sample_size", "upcast_attention")}

    s15, s2, s2b = (load(n, "scheduler/scheduler_config.json") for n in ("sd15", "sd2", "sd2-base"))
    for s in (s15, s2, s2b):
        assert (s["beta_start"], s["beta_end"], s["beta_schedule"]) == (0.00085, 0.012, "scaled_linear")
        assert s["num_train_timesteps"] == 1000 and s["steps_offset"] == 1 and s["clip_sample"] is False
    assert s15["prediction_type"] == "epsilon" and s2b["prediction_type"] == "epsilon"
    assert s2["prediction_type"] == "v_prediction"

    t15, t2 = load("sd15", "text_encoder/config.json"), load("sd2", "text_encoder/config.json")
    assert (t15["hidden_size"], t15["num_hidden_layers"], t15["hidden_act"]) == (768, 12, "quick_gelu")
    assert (t2["hidden_size"], t2["num_hidden_layers"], t2["num_attention_heads"], t2["intermediate_size"],
            t2["hidden_act"], t2["projection_dim"]) == (1024, 23, 16, 4096, "gelu", 512)
    assert load("sd2-base", "text_encoder/config.json") == t2

    for name in CONFIG_NAMES:
        index = load(name, "model_index.json")
        assert index["_class_name"] == "StableDiffusionPipeline"
        assert index["safety_checker"] == [None, None] and index["feature_extractor"] == [None, None]
        assert index["requires_safety_checker"] is False
        assert index["scheduler"][1] == load(name, "scheduler/scheduler_config.json")["_class_name"]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_components_load_from_materialised_folder_like_from_single_file(cache_root, name):
    """The non-weight components load through the same calls from_single_file makes."""
    import diffusers
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextConfig

    folder = str(config_folder(name, cache_root))
    index = StableDiffusionPipeline.load_config(folder)
    assert index["_class_name"] == "StableDiffusionPipeline"
    sched_cls = getattr(diffusers, index["scheduler"][1])
    sched = sched_cls.from_pretrained(folder, subfolder="scheduler", local_files_only=True)
    assert sched.config.prediction_type == ("v_prediction" if name == "sd2" else "epsilon")
    te_cfg = CLIPTextConfig.from_pretrained(folder, subfolder="text_encoder", local_files_only=True)
    assert te_cfg.vocab_size == 49408


# --------------------------------------------------------------------------------------------
# inpainting variants: the base config with a 9-channel UNet
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, base, pipeline", [
    ("sd15-inpaint", "sd15", "StableDiffusionInpaintPipeline"),
    ("sd2-inpaint", "sd2-base", "StableDiffusionInpaintPipeline"),
    ("sdxl-inpaint", "sdxl", "StableDiffusionXLInpaintPipeline"),
])
def test_inpaint_config_variants(tmp_path, name, base, pipeline):
    import diffusers
    folder, ref = config_folder(name, tmp_path), config_folder(base, tmp_path)
    assert folder == tmp_path / "configs" / name
    assert detect_family(folder) == name
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert files == {p.relative_to(ref).as_posix() for p in ref.rglob("*") if p.is_file()}
    changed = {"unet/config.json", "model_index.json", ".atelier-config"}
    for rel in files - changed:  # scheduler, VAE, text encoders, tokenizers: the base's, byte for byte
        assert (folder / rel).read_bytes() == (ref / rel).read_bytes(), rel
    unet, unet_ref = (json.loads((f / "unet" / "config.json").read_text()) for f in (folder, ref))
    assert unet.pop("in_channels") == 9 and unet_ref.pop("in_channels") == 4 and unet == unet_ref
    index, index_ref = (json.loads((f / "model_index.json").read_text()) for f in (folder, ref))
    assert index.pop("_class_name") == pipeline
    assert index.pop("requires_aesthetics_score", False) is False
    index_ref.pop("_class_name")
    assert index == index_ref
    # loads like from_single_file reads it; SD 2 inpainting is the 512 epsilon model
    pipe_cls = getattr(diffusers, pipeline)
    assert pipe_cls.load_config(str(folder))["_class_name"] == pipeline
    sched = getattr(diffusers, index["scheduler"][1]).from_pretrained(str(folder), subfolder="scheduler",
                                                                     local_files_only=True)
    assert sched.config.prediction_type == "epsilon"
    assert unet["sample_size"] == {"sdxl-inpaint": 128}.get(name, 64)
    assert config_folder(name, tmp_path) == folder  # idempotent; the base's folder is untouched
    assert json.loads((ref / "unet" / "config.json").read_text())["in_channels"] == 4


def test_diffusers_single_file_loader_maps_nine_channel_checkpoints_like_we_do(tmp_path):
    """What diffusers' own from_single_file (no config) picks for 9-channel checkpoints: SD 1.5
    inpainting, SD 2 inpainting at 512 (stabilityai/stable-diffusion-2-inpainting: epsilon, the
    512-base lineage, hence our sd2-base-derived sd2-inpaint) and SDXL inpainting 0.1."""
    from diffusers.loaders.single_file_utils import (CHECKPOINT_KEY_NAMES, DIFFUSERS_DEFAULT_PIPELINE_PATHS,
                                                     DIFFUSERS_TO_LDM_DEFAULT_IMAGE_SIZE_MAP,
                                                     infer_diffusers_model_type)
    cases = [("sd15", 768, "inpainting", "stable-diffusion-v1-5/stable-diffusion-inpainting", 512),
             ("sd2", 1024, "inpainting_v2", "stabilityai/stable-diffusion-2-inpainting", 512),
             ("sdxl", None, "xl_inpaint", "diffusers/stable-diffusion-xl-1.0-inpainting-0.1", 1024)]
    for kind, ctx, model_type, repo, size in cases:
        sd = _fake(kind, 9, ctx)
        if ctx:
            sd[CHECKPOINT_KEY_NAMES["v2"]] = _z(8, ctx)
        if kind == "sdxl":
            sd[CHECKPOINT_KEY_NAMES["xl_base"]] = _z(8)
        path = _write(sd, tmp_path / f"{kind}.safetensors", "safetensors")
        assert detect_family(path) == f"{kind}-inpaint"
        assert default_config_for(f"{kind}-inpaint", None) == f"{kind}-inpaint"
        assert infer_diffusers_model_type(sd) == model_type
        assert DIFFUSERS_DEFAULT_PIPELINE_PATHS[model_type]["pretrained_model_name_or_path"] == repo
        assert DIFFUSERS_TO_LDM_DEFAULT_IMAGE_SIZE_MAP[model_type] == size


# --------------------------------------------------------------------------------------------
# default_config_for
# --------------------------------------------------------------------------------------------

def test_default_config_for():
    assert default_config_for("sd15", "epsilon") == "sd15"
    assert default_config_for("sd15", "v_prediction") == "sd15"
    assert default_config_for("sd2", "epsilon") == "sd2-base"
    assert default_config_for("sd2", "v_prediction") == "sd2"
    assert default_config_for("sd2", None) == "sd2"
    assert default_config_for("sdxl", "epsilon") == "sdxl"
    # inpainting families: their variants, whatever the prediction type (SD 2 inpainting is 512 epsilon)
    for pred in (None, "epsilon", "v_prediction"):
        assert default_config_for("sd15-inpaint", pred) == "sd15-inpaint"
        assert default_config_for("sd2-inpaint", pred) == "sd2-inpaint"
        assert default_config_for("sdxl-inpaint", pred) == "sdxl-inpaint"
    with pytest.raises(ValueError, match="unknown model family"):
        default_config_for("sd3", "epsilon")
    with pytest.raises(ValueError, match="unknown prediction_type"):
        default_config_for("sd2", "v-pred")


# --------------------------------------------------------------------------------------------
# detect_family on single files
# --------------------------------------------------------------------------------------------

def _z(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


def _fake(kind: str, in_ch: int = 4, ctx: int | None = None) -> dict[str, torch.Tensor]:
    """A few tensors with the characteristic original-layout key names (small shapes, except the
    dimension that is read)."""
    sd = {U + "input_blocks.0.0.weight": _z(8, in_ch, 3, 3), U + "input_blocks.0.0.bias": _z(8),
          U + "out.2.weight": _z(4, 8, 3, 3), "first_stage_model.decoder.conv_in.weight": _z(8, 4, 3, 3)}
    if kind == "sd15":
        sd["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"] = _z(10, 8)
        if ctx:
            sd[U + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = _z(8, ctx)
            sd[U + "input_blocks.1.1.proj_in.weight"] = _z(8, 8, 1, 1)
    elif kind == "sd2":
        sd["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"] = _z(24, 8)
        if ctx:
            sd[U + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"] = _z(8, ctx)
            sd[U + "input_blocks.1.1.proj_in.weight"] = _z(8, 8)
    elif kind == "sdxl":
        sd["conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"] = _z(10, 8)
        sd["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"] = _z(24, 8)
        sd[U + "label_emb.0.0.weight"] = _z(8, 2816)
    elif kind == "sdxl-refiner":
        sd["conditioner.embedders.0.model.transformer.resblocks.0.attn.in_proj_weight"] = _z(24, 8)
        sd[U + "label_emb.0.0.weight"] = _z(8, 2560)
    else:
        raise AssertionError(kind)
    return sd


def _write(sd: dict, path: Path, fmt: str) -> Path:
    if fmt == "safetensors":
        save_file(sd, str(path))
    elif fmt == "ckpt":
        torch.save({"state_dict": sd, "global_step": 1000}, path)
    elif fmt == "ckpt-flat":
        torch.save(sd, path)
    elif fmt == "ckpt-legacy":
        torch.save({"state_dict": sd}, path, _use_new_zipfile_serialization=False)
    else:
        raise AssertionError(fmt)
    return path


CASES = [
    ("sd15", 4, None, "sd15"), ("sd15", 4, 768, "sd15"), ("sd15", 9, None, "sd15-inpaint"),
    ("sd2", 4, None, "sd2"), ("sd2", 4, 1024, "sd2"), ("sd2", 9, 1024, "sd2-inpaint"),
    ("sdxl", 4, None, "sdxl"), ("sdxl", 9, None, "sdxl-inpaint"),
    # the UNet's context width wins over the text encoder's layout
    ("sd15", 4, 1024, "sd2"),
]


@pytest.mark.parametrize("fmt", ["safetensors", "ckpt", "ckpt-flat", "ckpt-legacy"])
def test_detect_family_single_files(tmp_path, fmt):
    suffix = ".safetensors" if fmt == "safetensors" else ".ckpt"
    for i, (kind, in_ch, ctx, expected) in enumerate(CASES):
        path = _write(_fake(kind, in_ch, ctx), tmp_path / f"m{i}{suffix}", fmt)
        assert detect_family(path) == expected, (kind, in_ch, ctx)


def test_detect_family_by_unet_structure_only(tmp_path):
    """UNet-only files of unusual width: proj_in conv (SD 1) vs linear (SD 2)."""
    base = {U + "input_blocks.0.0.weight": _z(8, 4, 3, 3),
            U + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": _z(8, 32)}
    p1 = tmp_path / "a.safetensors"
    save_file({**base, U + "input_blocks.1.1.proj_in.weight": _z(8, 8, 1, 1)}, str(p1))
    p2 = tmp_path / "b.safetensors"
    save_file({**base, U + "input_blocks.1.1.proj_in.weight": _z(8, 8)}, str(p2))
    assert detect_family(p1) == "sd15" and detect_family(p2) == "sd2"


@pytest.mark.parametrize("sd, message", [
    ({"encoder.conv_in.weight": _z(4, 3, 3, 3), "decoder.conv_in.weight": _z(4, 4, 3, 3),
      "quant_conv.weight": _z(8, 8, 1, 1)}, "looks like a VAE-only file"),
    ({"first_stage_model.encoder.conv_in.weight": _z(4, 3, 3, 3)}, "looks like a VAE-only file"),
    ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": _z(4, 8),
      "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(4.0)}, "looks like a LoRA"),
    ({"emb_params": _z(2, 768)}, "textual-inversion embedding"),
    ({"conv_in.weight": _z(8, 4, 3, 3), "down_blocks.0.resnets.0.conv1.weight": _z(8, 8, 3, 3)},
     "diffusers-format UNet"),
    ({"cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": _z(10, 8)},
     "text-encoder-only"),
    ({"foo.weight": _z(2, 2), "bar": _z(3)},
     r"not a Stable Diffusion checkpoint: no model\.diffusion_model\.\* keys"),
    ({}, "holds no tensors"),
    ({"first_stage_model.encoder.conv_in.weight": _z(4, 3, 3, 3),
      "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": _z(10, 8)}, "no UNet"),
    ({**_fake("sdxl-refiner")}, "SDXL refiner"),
    ({**_fake("sd2", 5, 1024)}, "5 channels"),
    ({U + "joint_blocks.0.x_block.attn.qkv.weight": _z(6, 2)}, "Stable Diffusion 3"),
    ({U + "time_embed.0.weight": _z(8, 8)}, "no UNet input conv"),
])
def test_detect_family_says_what_it_found(tmp_path, sd, message):
    path = tmp_path / "x.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=message):
        detect_family(path)


def test_detect_family_garbage_and_unsafe_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a model at all\n" * 10)
    with pytest.raises(ValueError, match="not a Stable Diffusion checkpoint"):
        detect_family(junk)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a Stable Diffusion checkpoint"):
        detect_family(empty)
    # a safetensors header that promises more than the file holds
    good = _write(_fake("sd15"), tmp_path / "good.safetensors", "safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError):
        detect_family(cut)
    # a pickle with arbitrary Python objects is refused, not executed
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": _fake("sd15"), "hparams": argparse.Namespace(lr=1)}, unsafe)
    with pytest.raises(ValueError, match="weights_only"):
        detect_family(unsafe)
    with pytest.raises(ValueError, match="not a state dict"):
        detect_family(_write_obj(tmp_path / "list.ckpt", [1, 2, 3]))
    with pytest.raises(FileNotFoundError):
        detect_family(tmp_path / "missing.safetensors")


def _write_obj(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


# --------------------------------------------------------------------------------------------
# detect_family on diffusers folders
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in ("tiny-sd", "tiny-sd2"):
        build_tiny_pipeline(kind).save_pretrained(root / kind, safe_serialization=True)
        out[kind] = root / kind
    return out


def _edit_unet_config(folder: Path, **changes) -> None:
    path = folder / "unet" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_detect_family_diffusers_folders(tiny_folders, tmp_path):
    import shutil

    assert detect_family(tiny_folders["tiny-sd"]) == "sd15"
    assert detect_family(tiny_folders["tiny-sd2"]) == "sd2"

    inpaint = tmp_path / "inpaint"
    shutil.copytree(tiny_folders["tiny-sd"], inpaint, ignore=shutil.ignore_patterns("*.safetensors"))
    _edit_unet_config(inpaint, in_channels=9)
    assert detect_family(inpaint) == "sd15-inpaint"

    # the shipped configs are diffusers folders too (without weights)
    assert detect_family(CONFIGS_DIR / "sd15") == "sd15"
    assert detect_family(CONFIGS_DIR / "sd2") == "sd2"
    assert detect_family(CONFIGS_DIR / "sd2-base") == "sd2"

    xl = tmp_path / "xl"
    (xl / "unet").mkdir(parents=True)
    (xl / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionXLPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}))
    (xl / "unet" / "config.json").write_text(json.dumps({
        "_class_name": "UNet2DConditionModel", "cross_attention_dim": 2048, "in_channels": 4,
        "addition_embed_type": "text_time"}))
    assert detect_family(xl) == "sdxl"
    _edit_unet_config(xl, in_channels=9)
    assert detect_family(xl) == "sdxl-inpaint"
    (xl / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionXLImg2ImgPipeline", "text_encoder": [None, None],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}))
    _edit_unet_config(xl, in_channels=4, cross_attention_dim=1280)
    with pytest.raises(ValueError, match="SDXL refiner"):
        detect_family(xl)

    with pytest.raises(ValueError, match="not a diffusers pipeline folder"):
        detect_family(tmp_path / "inpaint" / "tokenizer")
    with pytest.raises(ValueError, match="single diffusers component folder"):
        detect_family(tiny_folders["tiny-sd"] / "vae")


# --------------------------------------------------------------------------------------------
# folders and hub snapshots without a usable model_index.json: the UNet's config decides
# --------------------------------------------------------------------------------------------

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(hub: Path, repo: str, folder: Path, drop=()) -> None:
    """``folder`` as the cached snapshot of hub repo ``repo`` (huggingface_hub's cache layout)."""
    import shutil
    root = hub / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / REVISION)
    for rel in drop:
        target = root / "snapshots" / REVISION / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)


def _model_cfg(path: str, **model):
    from omegaconf import OmegaConf

    from trainer.config.checks import load_config
    cfg = load_config(preset="demo")
    OmegaConf.update(cfg, "model.path", path)
    for k, v in model.items():
        OmegaConf.update(cfg, f"model.{k}", v)
    return cfg.model


@pytest.fixture(scope="module")
def xl_inpaint_folder(tmp_path_factory) -> tuple:
    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline
    pipe = build_tiny_pipeline("tiny-sdxl-inpaint")
    folder = tmp_path_factory.mktemp("xlinp") / "tiny-sdxl-inpaint"
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder, pipe


def test_hub_and_folder_detection_fall_back_to_the_unet_config(tiny_folders, xl_inpaint_folder, tmp_path):
    import shutil

    from trainer.families.sources import ModelSource, detect_source_family
    from trainer.errors import ModelLoadError
    xl_folder, _ = xl_inpaint_folder
    # local folders: no model_index.json, or an unreadable one
    sd2 = tmp_path / "sd2"
    shutil.copytree(tiny_folders["tiny-sd2"], sd2, ignore=shutil.ignore_patterns("*.safetensors"))
    (sd2 / "model_index.json").write_text("{not json")
    assert detect_family(sd2) == "sd2"
    (sd2 / "model_index.json").unlink()
    assert detect_family(sd2) == "sd2"

    hub = tmp_path / "hub"
    _snapshot(hub, "atelier/sd2", tiny_folders["tiny-sd2"])
    _snapshot(hub, "atelier/xl-noindex", xl_folder, drop=["model_index.json"])
    _snapshot(hub, "atelier/xl-badindex", xl_folder)
    (hub / "models--atelier--xl-badindex" / "snapshots" / REVISION / "model_index.json").write_text("[1, 2]")
    _snapshot(hub, "atelier/xl-index-only", xl_folder, drop=["unet"])
    _snapshot(hub, "atelier/nothing", xl_folder, drop=["model_index.json", "unet"])
    mcfg = _model_cfg("", hub_offline=True, cache_dir=str(hub))

    def family(repo: str):
        return detect_source_family(ModelSource("hub", repo, repo), mcfg)
    assert family("atelier/sd2") == "sd2"  # model_index.json alone cannot tell SD 2 from SD 1
    assert family("atelier/xl-noindex") == "sdxl-inpaint"  # unet/config.json: text_time, in_channels 9
    assert family("atelier/xl-badindex") == "sdxl-inpaint"
    assert family("atelier/xl-index-only") == "sdxl-inpaint"  # the pipeline class, without the UNet's config
    assert family("atelier/not-cached") is None  # the loader says it is not in the cache
    with pytest.raises(ModelLoadError, match="neither model_index.json nor unet/config.json"):
        family("atelier/nothing")


def test_folder_and_hub_snapshot_without_model_index_load(tiny_folders, xl_inpaint_folder, tmp_path):
    import shutil

    from trainer.families.sources import load_model
    xl_folder, xl_pipe = xl_inpaint_folder
    local = tmp_path / "xl-local"
    shutil.copytree(xl_folder, local)
    (local / "model_index.json").unlink()
    hub = tmp_path / "hub"
    _snapshot(hub, "atelier/xl-noindex", xl_folder, drop=["model_index.json"])
    for path, extra in ((str(local), {}), ("atelier/xl-noindex", {"hub_offline": True, "cache_dir": str(hub)})):
        model = load_model(_model_cfg(path, **extra), str(tmp_path))
        assert type(model).__name__ == "StableDiffusionXL" and model.inpainting and model.family == "sdxl"
        assert model.source.kind == ("folder" if path == str(local) else "hub")
        for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
            want, got = getattr(xl_pipe, name).state_dict(), getattr(model, name).state_dict()
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
        assert type(model.pipeline("euler")).__name__ == "StableDiffusionXLInpaintPipeline"
        assert model.tokenize(["a red square"])[0].shape == (1, 77)
    # an SD 2 folder without model_index.json: detected as SD 2 and loaded component by component
    sd2 = tmp_path / "sd2"
    shutil.copytree(tiny_folders["tiny-sd2"], sd2)
    (sd2 / "model_index.json").unlink()
    model = load_model(_model_cfg(str(sd2)), str(tmp_path))
    assert model.family == "sd2" and not model.inpainting and model.prediction_type == "v_prediction"


# --------------------------------------------------------------------------------------------
# full offline from_single_file round trip (the SD kit's single-file writer)
# --------------------------------------------------------------------------------------------

def _exporter():
    from trainer.families.common.sd_kit.keys import save_single_file_sd
    return save_single_file_sd


@pytest.mark.parametrize("kind, family", [("tiny-sd", "sd15"), ("tiny-sd2", "sd2")])
def test_from_single_file_offline_round_trip(tiny_folders, tmp_path, kind, family):
    save_single_file_sd = _exporter()
    if save_single_file_sd is None:
        pytest.skip("the SD kit's save_single_file_sd does not exist")
    from diffusers import StableDiffusionPipeline
    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(kind)
    path = tmp_path / f"{kind}.safetensors"
    save_single_file_sd(path, pipe.unet, pipe.vae, pipe.text_encoder, family=family, dtype="fp32")
    assert detect_family(path) == family
    loaded = StableDiffusionPipeline.from_single_file(
        str(path), config=str(tiny_folders[kind]), local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert set(want) == set(got), name
        for k in want:
            assert torch.equal(want[k], got[k]), (name, k)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_config_folder_concurrent_builders(tmp_path):
    """Several processes materialising the same config at once all get a complete folder."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from trainer.families.common.sd_kit.sd_configs import config_folder; "
            "f = config_folder('sd2-base', Path(sys.argv[1])); "
            "assert (f / 'tokenizer' / 'vocab.json').stat().st_size > 900_000; print(f)")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [err for _, err, _ in results]
    assert {out.strip() for out, _, _ in results} == {str(tmp_path / "configs" / "sd2-base")}
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == ["sd2-base"]
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(tmp_path / "configs" / "sd2-base" / "tokenizer")
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


@pytest.mark.parametrize("std, expected", [(0.12, "v_prediction"), (0.05, "epsilon")])
def test_an_sd2_single_file_tells_v_from_epsilon_as_comfyui_does(tmp_path, std, expected):
    """ComfyUI's test (comfy/supported_models.py SD20.model_type): the population std of the last output block's first
    norm1.bias above 0.09 is a 768 px v-prediction model, below it the 512 px ε base (v2-1_512-ema-pruned)."""
    import torch
    from safetensors.torch import save_file

    from trainer.families.common.sd_kit.sd_configs import V_PREDICTION_STATISTIC, sd2_prediction
    bias = torch.randn(320, generator=torch.Generator().manual_seed(0))
    bias = (bias - bias.mean()) / bias.std(unbiased=False) * std
    path = tmp_path / "sd2.safetensors"
    save_file({V_PREDICTION_STATISTIC: bias, "model.diffusion_model.out.2.bias": torch.zeros(4)}, str(path))
    assert sd2_prediction(path) == expected
    ckpt = tmp_path / "sd2.ckpt"
    torch.save({"state_dict": {V_PREDICTION_STATISTIC: bias}}, ckpt)
    assert sd2_prediction(ckpt) == expected
    save_file({"model.diffusion_model.out.2.bias": torch.zeros(4)}, str(path))
    assert sd2_prediction(path) is None  # a file without it (a tiny model): model.prediction_type decides


def test_the_sd2_single_file_loader_takes_the_config_of_the_prediction_it_was_told(tmp_path, monkeypatch):
    """A 512 px ε base single file must load with the sd2-base config (ε, 512) under model.prediction_type auto."""
    from trainer.families import sources
    from trainer.families.common.sd_kit import sd_configs
    chosen = []
    monkeypatch.setattr(sd_configs, "default_config_for", lambda family, pred: chosen.append(pred) or "sd2-base")
    source = sources.ModelSource("single_file", str(tmp_path / "missing.safetensors"), "missing.safetensors")
    mcfg = type("M", (), {"prediction_type": "auto", "config_path": ""})()
    with pytest.raises(Exception):
        sources.load_pipeline(object, source, mcfg, str(tmp_path), family="sd2", prediction_type="epsilon")
    assert chosen == ["epsilon"]
