"""Qwen-Image beyond the family contract: text features and latents as the pipeline makes them, true CFG in
samples, the transformer as one file, what validate refuses; and its edit models (Qwen-Image-Edit, -2509, -2511):
told apart, their transformer and text-encoder inputs equal to what the edit pipelines build for the same images and
instruction, the text cache keyed by the control images, a LoRA trained on pairs with two references loading in
the edit pipeline and changing what it draws."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import DEMO_DATA, load_tiny, train_quiet, transformer_inputs, picture

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("qwen-ws")
    return ws, build_tiny("tiny-qwen-image", ws / "models")


@pytest.fixture(scope="module")
def edit_ws(tmp_path_factory):
    """A workspace with the three tiny edit models built."""
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("qwen-edit-ws")
    return ws, {name: build_tiny(name, ws / "models") for name in
                ("tiny-qwen-image-edit", "tiny-qwen-image-edit-2509", "tiny-qwen-image-edit-2511")}


@pytest.fixture()
def small_pipeline_sizes(monkeypatch):
    """The pipelines resize control images to 1024² pixels (and 384² for Plus's VL encoder): seconds a call for the
    tiny models' VAE. The same rule at 64² (VAE) and 56² (VL), in the pipelines and the family alike."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from trainer.families.qwenimage import vl
    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(area // 256, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 56 * 56)
    monkeypatch.setitem(vl.VL_AREA, "qwen-image-edit", 64 * 64)
    for variant in ("qwen-image-edit-2509", "qwen-image-edit-2511"):
        monkeypatch.setitem(vl.VL_AREA, variant, 56 * 56)


# --- Qwen-Image (text to image) ---------------------------------------------------------------

def test_text_features_latents_and_guidance_are_the_pipelines(qwen):
    ws, paths = qwen
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square on a white background"
    sampler = model.pipeline(None)
    features, mask = sampler.encode_prompt(caption, device="cpu")
    real = features.shape[1] if mask is None else int(mask.sum())
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    assert int(cond.prompt_mask[0].sum()) == real
    torch.testing.assert_close(cond.prompt_embeds[0, :real], features[0, :real])
    # the training latent is what the pipeline's decode turns back: z = latent · std + mean
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    dist = model.encode_pixels(pixels)
    latent = model.sample_latents(dist, torch.Generator().manual_seed(0))
    c = model.vae.config
    z = latent * torch.tensor(c.latents_std).view(1, -1, 1, 1) + torch.tensor(c.latents_mean).view(1, -1, 1, 1)
    eps = torch.randn(dist["mean"].shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(z, dist["mean"] + dist["std"] * eps, atol=1e-5, rtol=1e-5)
    # cfg_scale drives the pipeline's true CFG
    images = [sampler(caption, guidance_scale=g, num_inference_steps=2, width=64, height=64, output_type="np",
                      generator=torch.Generator().manual_seed(0), **model.sampling_kwargs()).images[0] for g in (1.0, 6.0)]
    assert abs(images[0] - images[1]).max() > 1e-4


def test_the_transformer_sees_sigma_in_fp32_as_diffusers_qwen_image_trainer_passes_it(qwen):
    """train_dreambooth_lora_qwen_image.py passes ``timesteps / 1000`` of the fp32 schedule (a bf16 σ would be 0.9375
    for 0.93796); the transformer casts it to its hidden states' dtype itself."""
    ws, paths = qwen
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    seen = transformer_inputs(model, torch.zeros(1, 16, 8, 12, dtype=torch.bfloat16), torch.tensor([0.93796]), cond)
    assert seen["timestep"].dtype == torch.float32 and seen["timestep"].item() == pytest.approx(0.93796, abs=1e-7)


def test_the_transformer_sees_the_captions_as_the_pipeline_pads_them(qwen):
    """The cache kept 512 tokens a caption, mostly padding, and the step passed them all; now a cached entry is as
    long as its caption and the transformer gets the batch's longest caption (no mask when every row fills it), as
    ``QwenImagePipeline.encode_prompt`` hands it over: the same features and the same prediction as the padded,
    masked call, in a fraction of the text tokens. A cached batch's lengths come from the host (the mask is not read
    back)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    from trainer.data.text_rows import prefix_lengths, stack_padded
    from trainer.families.common.transformer_kit import MaskedText, pad_tokens
    ws, paths = qwen
    model = load_tiny(ws, paths["diffusers"])
    pipe = model.pipeline(None).pipe
    x, sigma = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(1)), torch.tensor([0.3, 0.8])
    for captions in (("a red square on a white background", "x"), ("a red square", "a red square")):
        theirs, their_mask = QwenImagePipeline.encode_prompt(pipe, list(captions), device="cpu")
        rows = [model.encode_captions([c]) for c in captions]
        batch = {k: stack_padded([r[k][0] for r in rows]) for k in rows[0]}
        batch["prompt_lengths"] = prefix_lengths(batch["prompt_mask"])
        cond = model.batch_condition(batch, lambda c: c, set())
        # each entry as long as its caption (the step cuts the rest off anyway)
        assert [r["prompt_mask"].shape[1] for r in rows] == [int(r["prompt_mask"].sum()) for r in rows]
        mask = torch.zeros_like(cond.prompt_mask)  # a mask the step must not read
        seen = transformer_inputs(model, x, sigma, MaskedText(cond.prompt_embeds, mask, cond.lengths))
        torch.testing.assert_close(seen["encoder_hidden_states"], theirs)
        if their_mask is None:
            assert seen["encoder_hidden_states_mask"] is None
        else:  # told from the host's lengths, not the (zeroed) mask
            assert seen["encoder_hidden_states_mask"] is not None and not seen["encoder_hidden_states_mask"].any()
        # the reference: every caption padded to the 512 tokens the cache kept before, with the mask
        embeds, full = pad_tokens(cond.prompt_embeds, cond.prompt_mask, model.max_sequence_length)
        with torch.no_grad():
            padded = model.transformer(
                hidden_states=QwenImagePipeline._pack_latents(x, 2, 16, 4, 6), timestep=sigma,
                encoder_hidden_states=embeds, encoder_hidden_states_mask=full,
                img_shapes=[[(1, 2, 3)]] * 2, return_dict=False)[0]
            ours = model.predict(x, sigma, cond)  # uncached (no lengths): the mask gives the same cut
            assert torch.equal(ours, model.predict(x, sigma, MaskedText(cond.prompt_embeds, cond.prompt_mask)))
        f = model.vae_scale_factor
        torch.testing.assert_close(ours, QwenImagePipeline._unpack_latents(padded, 4 * f, 6 * f, f).squeeze(2),
                                   atol=1e-5, rtol=1e-5)


def test_the_transformer_alone_loads_and_fine_tunes_save_back_to_it(qwen, tmp_path):
    ws, paths = qwen
    folder = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "qwen-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    assert again.family == "qwen-image"
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_layered_and_controlnet_pipelines_are_refused(tmp_path):
    """(The edit pipelines were refused here before they trained.)"""
    from trainer.errors import ModelLoadError
    for name in ("QwenImageLayeredPipeline", "QwenImageControlNetPipeline"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": name}))
        with pytest.raises(ModelLoadError, match=name) as err:
            load_tiny(tmp_path, folder)
        assert err.value.key == "model.path"


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("loss.min_snr_gamma=5", "loss.min_snr_gamma")])
def test_validate_refuses_what_qwen_image_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-qwen-image", setting])
    assert err.value.key == key, str(err.value)


# --- the edit models: which is which --------------------------------------------------------------

def _folder_evidence(where: str, index: dict, transformer: dict):
    from trainer.families import MISSING, Evidence
    files = {"model_index.json": index, "transformer/config.json": transformer}
    return Evidence("folder", where, read_json=lambda rel: files.get(rel, MISSING))


def test_the_edit_models_are_told_apart_or_named_by_model_family(tmp_path):
    from types import SimpleNamespace

    from trainer.errors import ModelLoadError
    from trainer.families import Evidence
    from trainer.families.checks import family_without_loading
    from trainer.families.qwenimage.detect import claim
    from trainer.families.qwenimage.edit import resolve_variant

    t = {"_class_name": "QwenImageTransformer2DModel"}
    assert claim(_folder_evidence("a", {"_class_name": "QwenImagePipeline"}, t)) == "qwen-image"
    assert claim(_folder_evidence("a", {"_class_name": "QwenImageEditPipeline"}, t)) == "qwen-image-edit"
    plus = {"_class_name": "QwenImageEditPlusPipeline"}
    assert claim(_folder_evidence("a", plus, dict(t, zero_cond_t=False))) == "qwen-image-edit-2509"
    assert claim(_folder_evidence("a", plus, dict(t, zero_cond_t=True))) == "qwen-image-edit-2511"
    assert claim(_folder_evidence("Qwen/Qwen-Image-Edit-2511", plus, t)) == "qwen-image-edit-2511"  # config silent
    assert claim(_folder_evidence("Qwen/Qwen-Image-Edit-2509", plus, t)) == "qwen-image-edit-2509"
    keys = {f"model.diffusion_model.{k}": (1,) for k in ("transformer_blocks.0.img_mod.1.weight", "txt_norm.weight",
                                                         "img_in.weight")}
    assert claim(Evidence("single_file", "f", shapes=keys)) == "qwen-image"  # Qwen-Image, -Edit, -2509 alike
    marked = dict(keys, **{"model.diffusion_model.__index_timestep_zero__": (0,)})  # ComfyUI's 2511 file
    assert claim(Evidence("single_file", "f", shapes=marked)) == "qwen-image-edit-2511"
    layered = dict(keys, **{"time_text_embed.addition_t_embedding.weight": (1,)})
    with pytest.raises(ValueError, match="Layered"):
        claim(Evidence("single_file", "f", shapes=layered))

    file, folder = SimpleNamespace(kind="single_file", display="f"), SimpleNamespace(kind="folder", display="d")
    assert resolve_variant(SimpleNamespace(family="auto"), file, "qwen-image") == "qwen-image"
    assert resolve_variant(SimpleNamespace(family="qwen-image-edit-2509"), file, "qwen-image") == "qwen-image-edit-2509"
    assert resolve_variant(SimpleNamespace(family="qwen-image-edit-2511"), folder,
                           "qwen-image-edit-2509") == "qwen-image-edit-2511"  # one pipeline, one set of tensors
    for asked, found in (("qwen-image-edit", "qwen-image"), ("qwen-image", "qwen-image-edit-2511"),
                         ("qwen-image-edit-2509", "qwen-image-edit")):
        with pytest.raises(ModelLoadError, match=f"model.family is {asked}") as err:
            resolve_variant(SimpleNamespace(family=asked), folder, found)
        assert err.value.key == "model.family"
    # validate knows a built-in edit model's variant without loading it
    builtin = SimpleNamespace(path="builtin:tiny-qwen-image-edit-2509", family="auto")
    assert family_without_loading(builtin) == "qwen-image-edit-2509"


def _pairs(root: Path, controls: int, names=("a", "b")) -> dict:
    """targets with ``controls`` control folders (the same file names) and instructions as captions."""
    for i, name in enumerate(names):
        picture(root / "targets" / f"{name}.png", i + 1)
        (root / "targets" / f"{name}.txt").write_text(f"make picture {i + 1} green")
        for k in range(controls):
            picture(root / f"control_{k}" / f"{name}.png", 5 + 3 * i + k, size=(64, 96) if k else (96, 64))
    return {"path": str(root / "targets"), "control_paths": [str(root / f"control_{k}") for k in range(controls)]}


def test_validate_wants_the_control_images_each_edit_model_takes(tmp_path):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError

    def check(model: str, controls: int, *extra: str):
        concept = _pairs(tmp_path / f"{model}-{controls}", controls)
        return load_config(None, [f"model.path=builtin:{model}",
                                  f"data.concepts=[{{path: {concept['path']}, control_paths: "
                                  f"[{', '.join(concept['control_paths'])}]}}]", *extra])

    check("tiny-qwen-image-edit", 1)
    check("tiny-qwen-image-edit-2509", 3)
    with pytest.raises(ConfigError, match="at most 1"):
        check("tiny-qwen-image-edit", 2)
    with pytest.raises(ConfigError, match="learns from pairs"):
        check("tiny-qwen-image-edit-2511", 0)
    with pytest.raises(ConfigError, match="set model.family to it") as err:  # a transformer file says nothing
        check("tiny-qwen-image", 1)
    assert "qwen-image-edit-2509" in str(err.value)
    with pytest.raises(ConfigError, match="control_images"):
        check("tiny-qwen-image-edit", 1, "sampling.prompts=[{prompt: make it green}]")


# --- the edit models: inputs as the pipelines build them ----------------------------------------

class _Stop(Exception):
    pass


def _transformer_inputs(transformer, call) -> dict:
    """The keyword arguments of the transformer's first call made by ``call()``."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)
        raise _Stop

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call()
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("name, controls", [("tiny-qwen-image-edit", 1), ("tiny-qwen-image-edit-2509", 2),
                                            ("tiny-qwen-image-edit-2511", 2)])
def test_transformer_and_text_encoder_inputs_are_the_edit_pipelines(edit_ws, small_pipeline_sizes, name, controls,
                                                                    tmp_path):
    """For the same control images and instruction: the VL template with the images (Edit's, or Plus's "Picture
    1: …" per reference), the control latents normalised and packed after the target's tokens, ``img_shapes``
    listing the target and each control, the timestep; and 2511's transformer modulating the references at t=0."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

    from trainer.families.qwenimage.vl import open_control
    ws, paths = edit_ws
    model = load_tiny(ws, paths[name]["diffusers"])
    assert model.family == name.removeprefix("tiny-") and model.text_sees_controls
    assert model.transformer.config.zero_cond_t == (name == "tiny-qwen-image-edit-2511")
    files = [picture(tmp_path / f"c{k}.png", 7 + k, size=(96, 64) if k == 0 else (64, 80)) for k in range(controls)]
    images = [open_control(f) for f in files]
    caption = "put the red box on the green ball"
    sampler = model.pipeline(None)
    pipe = sampler.pipe
    z = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    packed = pipe._pack_latents(z, 1, 16, 8, 8)
    theirs = _transformer_inputs(model.transformer, lambda: pipe(
        image=images if model.plus else images[0], prompt=caption, true_cfg_scale=1.0, num_inference_steps=1,
        width=64, height=64, latents=packed, output_type="latent"))

    # the control latents the data pipeline would hand over: each control at the pipeline's VAE size
    module = plus_module if model.plus else edit_module
    latents = []
    for img in images:
        w, h = module.calculate_dimensions(plus_module.VAE_IMAGE_SIZE if model.plus else 1024 * 1024,
                                           img.size[0] / img.size[1])[:2]
        latents.append(model.encode_pixels(pipe.image_processor.preprocess(img, h, w)))
    batch = {"captions": [caption], "control_paths": [tuple(files)], "control_latents": latents}
    cond = model.batch_condition(batch, lambda c: c, set())
    ours = _transformer_inputs(model.transformer, lambda: model.predict(z, theirs["timestep"], cond))

    assert ours["img_shapes"] == theirs["img_shapes"] and len(ours["img_shapes"][0]) == 1 + controls
    torch.testing.assert_close(ours["hidden_states"], theirs["hidden_states"])  # target ‖ controls
    assert theirs["encoder_hidden_states_mask"] is None  # one prompt: every token real
    assert ours["encoder_hidden_states_mask"] is None
    torch.testing.assert_close(ours["encoder_hidden_states"], theirs["encoder_hidden_states"])
    torch.testing.assert_close(ours["timestep"], theirs["timestep"])
    # caption dropout: the empty instruction with the row's own images, as the pipeline encodes it
    vl = []
    for img in images:
        w, h = (plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, img.size[0] / img.size[1])
                if model.plus else edit_module.calculate_dimensions(1024 * 1024, img.size[0] / img.size[1])[:2])
        vl.append(pipe.image_processor.resize(img, h, w))
    empty, _ = pipe.encode_prompt("", image=vl if model.plus else vl[0], device="cpu")
    dropped = model.batch_condition(batch, lambda c: c, set(), drop_te1=[True])
    assert int(dropped.prompt_mask[0].sum()) == empty.shape[1]
    torch.testing.assert_close(dropped.prompt_embeds[0, :empty.shape[1]], empty[0])
    # …and the same from the text cache's entry for the row's empty instruction (what batches carry)
    cached = model.batch_condition(dict(batch, empty_text=model.encode_captions([""], [tuple(files)])), lambda c: c,
                                   set(), drop_te1=[True])
    torch.testing.assert_close(cached.prompt_embeds[0, :empty.shape[1]], empty[0].to(cached.prompt_embeds))
    assert torch.equal(cached.prompt_mask, dropped.prompt_mask)
    # the stand-in for an encode without files (the VRAM estimate's) has the real sequence length
    sizes = [[(img.size[0], img.size[1]) for img in images]]
    assert model._encode_standin([caption], sizes)[0].shape == cond.prompt_embeds.shape


# --- the edit models: the text cache and training ----------------------------------------------

def test_the_text_cache_keys_each_pair_by_its_control_images(tmp_path):
    """Two targets with one instruction and different control images get two entries; a batch reads its own;
    an edited control image is encoded again, alone; entries of different lengths stack padded."""
    from omegaconf import OmegaConf

    from trainer.config.schema import AtelierConfig
    from trainer.data.pipeline import DataPipeline
    concept = _pairs(tmp_path / "pairs", 1, names=("a", "b", "c"))
    for name in ("a", "b", "c"):
        (tmp_path / "pairs" / "targets" / f"{name}.txt").write_text("make it green")  # one caption for all
    cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig), {
        "general": {"workspace": str(tmp_path), "seed": 1}, "training": {"batch_size": 3},
        "data": {"resolution": "64", "bucket_step": 8, "aspect_buckets": False, "concepts": [concept],
                 "cache_dir": str(tmp_path / "cache")}})
    calls = []

    def encode(captions, controls=None):
        calls.append([tuple(Path(str(c)).name for c in row) for row in controls] if controls else None)
        if controls is None or not isinstance(controls[0][0], (str, Path)):  # the probe's grey image
            n = [3] * len(captions)
        else:
            n = [2 + Path(str(row[0])).read_bytes()[-20] % 4 for row in controls]  # a length per image
        embeds = torch.zeros(len(captions), max(n), 4)
        for i, length in enumerate(n):
            embeds[i, :length] = float(length)
        mask = (torch.arange(max(n))[None] < torch.tensor(n)[:, None]).float()
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    def vae(pixels):
        mean = torch.nn.functional.avg_pool2d(pixels, 8)
        return {"mean": mean, "std": torch.ones_like(mean)}

    pipe = DataPipeline(cfg, warn=lambda m: None)
    summary = pipe.prepare(vae, "v", "fp32", encode_text_fn=encode, text_fingerprint="t", text_controls=True)
    assert summary["text_encoded"] == 3 and summary["text_cache"] == "on"
    assert sorted(calls[1]) == [("a.png",), ("b.png",), ("c.png",)]  # after the probe: one encode per pair
    batch = pipe.batch(list(range(3)), 0)
    lengths = batch["prompt_mask"].sum(1).tolist()
    for row, files in enumerate(batch["control_paths"]):
        expected = 2 + Path(files[0]).read_bytes()[-20] % 4
        assert lengths[row] == expected and float(batch["prompt_embeds"][row, 0, 0]) == expected
    assert "empty_text" not in batch
    # the step's own caption dropout: each pair's empty instruction with its images is cached too, and batches
    # carry it, lengths included, so a dropped row takes it without running the encoder
    calls.clear()
    dropping = DataPipeline(cfg, warn=lambda m: None)
    assert dropping.prepare(vae, "v", "fp32", encode_text_fn=encode, text_fingerprint="t", text_controls=True,
                            text_empty=True)["text_encoded"] == 3  # the three empty instructions, not the captions
    assert sorted(calls[1]) == [("a.png",), ("b.png",), ("c.png",)]
    batch = dropping.batch(list(range(3)), 0)
    empty = batch["empty_text"]
    assert empty["prompt_lengths"] == [2 + Path(files[0]).read_bytes()[-20] % 4 for files in batch["control_paths"]]

    from trainer.families.qwenimage.edit import _dropped_from_cache
    drops = [True, False, True]
    mask = batch["prompt_mask"].bool()
    embeds = (batch["prompt_embeds"] + 10) * mask[..., None]  # told apart from the empty rows
    out, out_mask, out_lengths = _dropped_from_cache(embeds, mask, batch["prompt_lengths"], drops, empty)
    for row, dropped in enumerate(drops):
        source, source_mask = (empty["prompt_embeds"], empty["prompt_mask"]) if dropped else (embeds, mask)
        n = source_mask[row].bool().sum()
        torch.testing.assert_close(out[row, :n], source[row, :n])
        assert out_mask[row].sum() == n and not out_mask[row, n:].any() and not out[row, n:].any()
        assert out_lengths[row] == n
    assert _dropped_from_cache(embeds, mask, None, drops, empty)[2] is None  # a length not known stays unknown

    picture(tmp_path / "pairs" / "control_0" / "b.png", 42)  # an edited control
    calls.clear()
    again = DataPipeline(cfg, warn=lambda m: None)
    assert again.prepare(vae, "v", "fp32", encode_text_fn=encode, text_fingerprint="t",
                         text_controls=True)["text_encoded"] == 1
    assert [("b.png",)] in calls


def _sample_png(run: Path) -> Path:
    return sorted((run / "samples").glob("*.png"))[-1]


@pytest.mark.slow
def test_a_2509_lora_on_pairs_with_two_references_loads_in_the_edit_pipeline(edit_ws, small_pipeline_sizes, tmp_path,
                                                                             peft_strict):
    """Train on edit pairs with two reference folders (text cache on: one entry per pair), sample through the loop
    with two control images, then load the file in QwenImageEditPlusPipeline: it changes what the pipeline draws."""
    ws, paths = edit_ws
    data = tmp_path / "pairs"
    concept = _pairs(data, 2)
    sample_images = [shutil.copy(DEMO_DATA / "00-red-square.png", tmp_path / "s0.png"),
                     shutil.copy(DEMO_DATA / "03-blue-circle.png", tmp_path / "s1.png")]
    run = train_quiet(ws, "edit-2509", "demo-qwen-image", "model.path=builtin:tiny-qwen-image-edit-2509",
                      f"data.concepts=[{{path: {concept['path']}, control_paths: [{', '.join(concept['control_paths'])}]}}]",
                      "training.max_steps=4", "training.batch_size=2", "training.learning_rate=0.01",
                      "lora.unet_targets=attn_mlp", "sampling.every_n_epochs=0", "sampling.at_end=true",
                      f"sampling.prompts=[{{prompt: make picture 1 green, steps: 2, width: 64, height: 64, "
                      f"control_images: [{sample_images[0]}, {sample_images[1]}]}}]")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    started = next(e for e in events if e["type"] == "started")
    assert started["cache"]["text_cache"] == "on" and started["cache"]["text_encoded"] == 2  # one entry per pair
    assert [e for e in events if e["type"] == "step"][-1]["step"] == 4
    assert [e for e in events if e["type"] == "sample"] and _sample_png(run).is_file()
    lora = run / f"{run.name}.safetensors"
    from safetensors.torch import load_file
    keys = load_file(str(lora))
    assert keys and all(k.startswith("transformer.transformer_blocks.") and ".lora_" in k for k in keys)

    pipe = load_tiny(ws, paths["tiny-qwen-image-edit-2509"]["diffusers"]).pipeline(None)
    images = [Image.open(p).convert("RGB") for p in sample_images]

    def draw():
        return pipe("make picture 1 green", image=images, num_inference_steps=2, width=64, height=64,
                    generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    before = draw()
    pipe.load_lora_weights(str(lora))
    assert abs(draw() - before).max() > 1e-3


def test_a_2511_single_file_is_told_by_comfyuis_marker_and_saved_with_it(edit_ws, tmp_path):
    """ComfyUI's 2511 file carries ``__index_timestep_zero__``: it loads as 2511 with zero_cond_t on, and a fine-tune
    is saved with the marker again; a file without it is Qwen-Image unless model.family names the edit model."""
    from safetensors import safe_open
    ws, paths = edit_ws
    folder = paths["tiny-qwen-image-edit-2511"]["diffusers"]
    model = load_tiny(ws, paths["tiny-qwen-image-edit-2511"]["single_file"], f"model.config_path={folder}")
    assert model.family == "qwen-image-edit-2511" and model.transformer.zero_cond_t
    assert all(block.zero_cond_t for block in model.transformer.transformer_blocks)
    out = tmp_path / "ft.safetensors"
    model.save_single_file(out, "fp32", {})
    with safe_open(str(out), "pt") as f:
        assert "__index_timestep_zero__" in set(f.keys())
    plain = paths["tiny-qwen-image-edit-2509"]
    as_2511 = load_tiny(ws, plain["single_file"], f"model.config_path={plain['diffusers']}",
                        "model.family=qwen-image-edit-2511")  # 2509's weights read as 2511: model.family decides
    assert as_2511.family == "qwen-image-edit-2511" and as_2511.transformer.zero_cond_t


@pytest.mark.parametrize("variant", ["qwen-image-edit", "qwen-image-edit-2511"])
def test_the_edit_models_full_size_configs_are_qwen_images(variant, tmp_path):
    """The VRAM estimate's shipped configs: Qwen-Image's 20.43B transformer (2511's with zero_cond_t) and
    Qwen2.5-VL-7B with its vision tower (8.29B), and the processor folder the family reads."""
    import diffusers
    import transformers

    from trainer.families.common import full_size
    folder = full_size.config_folder(variant, tmp_path)
    assert (folder / "processor" / "preprocessor_config.json").is_file()
    assert json.loads((folder / "transformer" / "config.json").read_text())["zero_cond_t"] == variant.endswith("2511")
    for component, billions in (("transformer", 20.43), ("text_encoder", 8.29)):
        cfg = json.loads((folder / component / "config.json").read_text())
        with torch.device("meta"):
            if cfg.get("_class_name"):
                cls = getattr(diffusers, cfg["_class_name"])
                module = cls.from_config(cls.load_config(str(folder / component)))
            else:
                cls = getattr(transformers, cfg["architectures"][0])
                module = cls(cls.config_class.from_pretrained(str(folder / component)))
        assert sum(p.numel() for p in module.parameters()) / 1e9 == pytest.approx(billions, rel=0.005), component
