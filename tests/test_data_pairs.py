"""Training examples that are more than an image and a caption: control/reference images paired by file name,
concept roles (validation, regularisation, prior_prediction) and their rules. No model: a fake VAE pools pixels."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import picture
from trainer.config.checks import config_from_dict, cross_field_warnings, load_config
from trainer.config.schema import AtelierConfig
from trainer.data.concepts import scan_concepts
from trainer.data.order import epoch_order, item_repeats
from trainer.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parent.parent


def _pairs(root: Path, names=("cat_01", "cat_02", "cat_03"), controls=1, same=True) -> Path:
    """targets/<name>.png with control_<k>/<name>.jpg|png beside; ``same``: the control is the target's image."""
    for i, name in enumerate(names):
        target = picture(root / "targets" / f"{name}.png", i + 1)
        (root / "targets" / f"{name}.txt").write_text(f"make {name} blue")
        for k in range(controls):
            ext = ".png" if k % 2 == 0 else ".jpg"
            dst = root / f"control_{k}" / f"{name}{ext}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            Image.open(target).save(dst) if same else picture(dst, 10 + i + k)
    return root


def _cfg(tmp_path: Path, *concepts: dict, batch_size: int = 1, **data):
    node = OmegaConf.structured(AtelierConfig)
    data = {"resolution": "64", "bucket_step": 8, **data, "concepts": list(concepts),
            "cache_dir": str(tmp_path / "cache")}
    return OmegaConf.merge(node, {"general": {"workspace": str(tmp_path), "seed": 3, "dataloader_workers": 0},
                                  "training": {"batch_size": batch_size}, "data": data})


def _fake_vae(pixels):
    """mean = 8x8 average of the pixels (a stand-in VAE: a flip or crop of the pixels shows in it)."""
    mean = torch.nn.functional.avg_pool2d(pixels.float(), 8)
    return {"mean": mean, "std": torch.full_like(mean, 0.1)}


# --------------------------------------------------------------------------------------------
# pairing by file name
# --------------------------------------------------------------------------------------------

def test_each_image_gets_the_control_of_its_name_from_every_control_folder(tmp_path):
    root = _pairs(tmp_path, controls=2)
    concept = {"path": str(root / "targets"), "control_paths": [str(root / "control_0"), str(root / "control_1")]}
    items, report = scan_concepts(OmegaConf.create({"concepts": [{"enabled": True, "recursive": False,
                                                                  "caption_source": "txt", "caption_extension": ".txt",
                                                                  "repeats": 1, "loss_weight": 1, "name": "",
                                                                  "resolution": "", **concept}]}))
    assert [it.path.name for it in items] == ["cat_01.png", "cat_02.png", "cat_03.png"]
    for it in items:
        assert [c.parent.name for c in it.controls] == ["control_0", "control_1"]
        assert all(c.stem == it.path.stem for c in it.controls)  # a .jpg control pairs with a .png target
    assert report.concepts[0].controls == [str(root / "control_0"), str(root / "control_1")]


def test_a_control_folder_inside_the_concept_folder_holds_no_targets(tmp_path):
    root = _pairs(tmp_path)
    (root / "control_0").rename(root / "targets" / "control")
    cfg = _cfg(tmp_path, {"path": str(root / "targets"), "recursive": True,
                          "control_paths": [str(root / "targets" / "control")]})
    items, _ = scan_concepts(cfg.data)
    assert len(items) == 3 and all(it.path.parent.name == "targets" for it in items)


@pytest.mark.parametrize("break_it, words", [
    (lambda root: (root / "control_0" / "cat_02.png").unlink(), ("control_paths.0", "cat_02.png", "no control image")),
    (lambda root: picture(root / "control_0" / "dog_09.png", 9), ("control_paths.0", "dog_09.png", "pair with no image")),
    (lambda root: __import__("shutil").rmtree(root / "control_0"), ("control_paths.0", "does not exist")),
])
def test_an_unpaired_image_or_control_is_named_before_any_model_loads(tmp_path, break_it, words):
    root = _pairs(tmp_path)
    break_it(root)
    concept = {"path": str(root / "targets"), "control_paths": [str(root / "control_0")]}
    with pytest.raises(DataError) as err:
        scan_concepts(_cfg(tmp_path, concept).data)
    for w in words:
        assert w in str(err.value), str(err.value)
    assert err.value.key == "data.concepts.0.control_paths.0"
    # validate (no model, no torch) names it at the same field, as an error
    cfg = load_config(preset="demo", overrides=[f"data.concepts=[{{path: {root / 'targets'}, control_paths: "
                                                f"[{root / 'control_0'}]}}]", "model.path=somewhere/model.safetensors"])
    issues = [i for i in cross_field_warnings(cfg) if i.key == "data.concepts.0.control_paths.0"]
    assert issues and issues[0].level == "error" and words[1] in issues[0].message


def test_a_broken_control_image_skips_its_pair_with_a_warning(tmp_path):
    root = _pairs(tmp_path)
    (root / "control_0" / "cat_03.png").write_bytes(b"not an image")
    warnings: list = []
    items, report = scan_concepts(_cfg(tmp_path, {"path": str(root / "targets"),
                                                  "control_paths": [str(root / "control_0")]}).data,
                                  warn=warnings.append)
    assert [it.path.stem for it in items] == ["cat_01", "cat_02"]
    assert report.concepts[0].skipped[0][0] == "cat_03.png" and "control image" in report.concepts[0].skipped[0][1]
    assert any("cat_03" in w for w in warnings)


# --------------------------------------------------------------------------------------------
# a pair is one unit: same crop, same flip
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cached", [True, False])
def test_a_flipped_cropped_pair_stays_aligned(tmp_path, cached):
    """Each control is its target's own picture: whatever flip and crop a sample draws, the control's latents equal
    the target's (cached variants and per-step renders alike)."""
    from trainer.data.pipeline import DataPipeline
    root = _pairs(tmp_path)
    cfg = _cfg(tmp_path, {"path": str(root / "targets"), "control_paths": [str(root / "control_0")], "repeats": 4},
               random_flip=True, center_crop=False, crop_jitter=0.0 if cached else 0.2, augment_variants=0,
               cache_latents=cached)
    pipe = DataPipeline(cfg, warn=lambda m: None)
    pipe.prepare(_fake_vae, "fake-vae", "fp32")
    seen: dict = {}
    for epoch in range(2):
        for _, batch in pipe.iter_batches(epoch, 0, 100):
            (control,) = batch["control_latents"]
            torch.testing.assert_close(control["mean"], batch["latent_dist"]["mean"])
            (controls,) = batch["control_paths"]
            seen.setdefault(controls[0].stem, set()).add(batch["latent_dist"]["mean"].numpy().tobytes())
    assert any(len(v) > 1 for v in seen.values())  # samples were flipped or cropped: the pairs moved together
    assert (pipe.cache is not None) == cached


def test_controls_at_their_own_budget_keep_the_targets_aspect(tmp_path):
    from trainer.data.pipeline import DataPipeline
    root = _pairs(tmp_path, same=False)
    cfg = _cfg(tmp_path, {"path": str(root / "targets"), "control_paths": [str(root / "control_0")]},
               resolution="64", control_resolution="128")
    pipe = DataPipeline(cfg, warn=lambda m: None)
    pipe.prepare(_fake_vae, "fake-vae", "fp32")
    _, batch = next(pipe.iter_batches(0, 0, 1))
    h, w = batch["latent_dist"]["mean"].shape[-2:]
    ch, cw = batch["control_latents"][0]["mean"].shape[-2:]
    assert (ch * cw) == pytest.approx(4 * h * w, rel=0.25)  # 128² budget against the 64² target
    assert cw / ch == pytest.approx(w / h, rel=0.15)


# --------------------------------------------------------------------------------------------
# roles
# --------------------------------------------------------------------------------------------

def test_a_version_2_validation_concept_is_a_validation_role():
    cfg = config_from_dict({"version": 2, "base": "demo",
                            "data": {"concepts": [{"path": "presets/demo-data"},
                                                  {"path": "presets/demo-data", "validation": True}]}})
    assert [c.role for c in cfg.data.concepts] == ["train", "validation"] and cfg.version == 3
    cfg = load_config(preset="demo", overrides=["data.concepts.0.validation=true"])
    assert cfg.data.concepts[0].role == "validation"


def test_regularisation_images_are_drawn_in_the_ratio_the_concepts_ask(tmp_path):
    """20 subject images x 5 repeats beside 40 class images at samples = 100: one class image per subject image,
    every epoch, whatever the folder sizes."""
    for i in range(20):
        picture(tmp_path / "subject" / f"s{i:02d}.png", i)
    for i in range(40):
        picture(tmp_path / "class" / f"c{i:02d}.png", 50 + i)
    cfg = _cfg(tmp_path, {"path": str(tmp_path / "subject"), "repeats": 5},
               {"path": str(tmp_path / "class"), "role": "regularisation", "samples": 100, "loss_weight": 0.8})
    items, _ = scan_concepts(cfg.data)
    assert {it.role for it in items if it.concept_index == 1} == {"regularisation"}
    for epoch in range(3):
        order = epoch_order(items, item_repeats(items, cfg.data), epoch, seed=3)
        per_concept = Counter(items[i].concept_index for i in order)
        assert per_concept == {0: 100, 1: 100}
    assert {it.loss_weight for it in items if it.role == "regularisation"} == {0.8}


def test_prior_prediction_rows_are_marked_in_the_batch(tmp_path):
    from trainer.data.pipeline import DataPipeline
    picture(tmp_path / "subject" / "a.png", 1)
    picture(tmp_path / "prior" / "b.png", 2)
    cfg = _cfg(tmp_path, {"path": str(tmp_path / "subject")}, {"path": str(tmp_path / "prior"),
                                                               "role": "prior_prediction"}, batch_size=2)
    pipe = DataPipeline(cfg, warn=lambda m: None)
    pipe.prepare(_fake_vae, "fake-vae", "fp32")
    _, batch = next(pipe.iter_batches(0, 0, 1))
    roles = ["prior_prediction" if p.parent.name == "prior" else "train" for p in
             [pipe.items[i].path for i in pipe.epoch_batches(0)[0].indices]]
    assert batch["prior"].tolist() == [r == "prior_prediction" for r in roles]


@pytest.mark.parametrize("overrides, key, words", [
    (["training.method=embedding", "embedding.placeholder=<sks>", "data.concepts.0.role=regularisation"],
     "data.concepts.0.role", "nothing to preserve"),
    (["training.method=finetune", "data.concepts.0.role=prior_prediction"], "data.concepts.0.role",
     "training.method = lora"),
    (["data.concepts.0.control_paths=[presets/demo-data]"], "data.concepts.0.control_paths",
     "takes no control or reference images"),
    (["sampling.prompts=[{prompt: x, control_images: [presets/demo-data/0.png]}]"],
     "sampling.prompts.0.control_images", "takes none"),
])
def test_roles_and_controls_a_model_cannot_use_are_refused_by_validate(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(preset="demo", overrides=overrides)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_the_prior_prediction_target_is_the_base_models_own_prediction(tiny_workspace):
    """A LoRA whose adapters change the UNet's output: prior_prediction rows get exactly what the model without the
    LoRA predicts (a second, untouched load is the reference), the others keep their target, and the adapters are
    on again afterwards."""
    import contextlib
    from types import SimpleNamespace

    from conftest import load_tiny_fp32
    from trainer.methods.make import make_method
    from trainer.train.step import _prior_target

    ws = tiny_workspace
    cfg = load_config(preset="demo", overrides=[f"general.workspace={ws}", "parts.text_encoder_1.train=true"])
    model = load_tiny_fp32(ws, "builtin:tiny-sd")
    method = make_method(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for m in method.modules.values():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)  # a trained-looking LoRA (peft starts B at zero)
    base = load_tiny_fp32(ws, "builtin:tiny-sd")
    batch = {"captions": ["a red square", "a blue circle"]}
    noisy, timesteps = torch.randn(2, 4, 8, 8), torch.tensor([100, 700])
    target = torch.randn(2, 4, 8, 8)
    # an fp32 run's autocast (none): accelerate's Accelerator shares its state within a process, so one made here would
    # take the bf16 autocast of an Accelerator an earlier test in this worker made
    state = SimpleNamespace(model=model, method=method, accelerator=SimpleNamespace(autocast=contextlib.nullcontext),
                            unet_dtype=torch.float32)
    with torch.no_grad():
        with_lora = model.predict(noisy, timesteps, model.batch_condition(batch, lambda c: c, set()))
        reference = base.predict(noisy, timesteps, base.batch_condition(batch, lambda c: c, set()))
    assert not torch.allclose(with_lora, reference)  # the LoRA (on the UNet and the text encoder) changes it
    out = _prior_target(state, batch, noisy, timesteps, target, torch.tensor([True, False]), {})
    torch.testing.assert_close(out[0], reference[0])
    torch.testing.assert_close(out[1], target[1])
    with torch.no_grad():
        again = model.predict(noisy, timesteps, model.batch_condition(batch, lambda c: c, set()))
    torch.testing.assert_close(again, with_lora)  # adapters back on


def test_regularisation_alone_is_named_as_learning_nothing():
    issues = cross_field_warnings(load_config(preset="demo", overrides=["data.concepts.0.role=regularisation"]))
    assert any(i.key == "data.concepts" and "learns nothing new" in i.message for i in issues)
    assert not any("learns nothing new" in i.message for i in cross_field_warnings(load_config(preset="demo")))
