"""The EfficientNet encoder of Stable Cascade / Würstchen 2: torchvision's layout, loading, preprocessing."""

import re

import pytest
import torch
from safetensors.torch import save_file

from trainer.families.common.effnet import (IMAGENET_MEAN, IMAGENET_STD, V2_S_STAGES, EfficientNetEncoder,
                                            effnet_preprocess, load_effnet, save_effnet, tiny_effnet)

# torchvision's efficientnet_v2_s: 21,458,488 parameters, of which its classifier Linear(1280, 1000) has 1,281,000
TORCHVISION_FEATURES_PARAMS = 21_458_488 - (1280 * 1000 + 1000)


def _real_on_meta(**kwargs) -> EfficientNetEncoder:
    with torch.device("meta"):
        return EfficientNetEncoder(**kwargs)


def test_real_spec_has_torchvision_layout():
    enc = _real_on_meta()
    assert sum(p.numel() for p in enc.backbone.parameters()) == TORCHVISION_FEATURES_PARAMS
    shapes = {k: tuple(v.shape) for k, v in enc.state_dict().items()}
    assert len([k for k in shapes if k.startswith("backbone.")]) == 780  # torchvision's features.state_dict()
    expected = {
        "backbone.0.0.weight": (24, 3, 3, 3), "backbone.0.1.running_mean": (24,),
        "backbone.1.0.block.0.0.weight": (24, 24, 3, 3), "backbone.1.1.block.0.1.bias": (24,),
        "backbone.2.0.block.0.0.weight": (96, 24, 3, 3), "backbone.2.0.block.1.0.weight": (48, 96, 1, 1),
        "backbone.4.0.block.0.0.weight": (256, 64, 1, 1), "backbone.4.0.block.1.0.weight": (256, 1, 3, 3),
        "backbone.4.0.block.2.fc1.weight": (16, 256, 1, 1), "backbone.4.0.block.2.fc2.bias": (256,),
        "backbone.5.8.block.2.fc1.weight": (40, 960, 1, 1), "backbone.6.14.block.3.1.running_var": (256,),
        "backbone.7.0.weight": (1280, 256, 1, 1), "backbone.7.1.weight": (1280,),
        "mapper.0.weight": (16, 1280, 1, 1), "mapper.1.running_mean": (16,), "mapper.1.running_var": (16,),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert "mapper.1.weight" not in shapes and "mapper.1.weight" in _real_on_meta(affine=True).state_dict()
    assert enc.backbone[0][1].eps == 1e-3 and enc.backbone[6][14].block[3][1].eps == 1e-3
    assert enc.mapper[1].eps == 1e-5


def test_real_spec_is_inferred_from_its_keys():
    state = _real_on_meta().state_dict()
    assert EfficientNetEncoder.config_from_state_dict(state) == dict(
        stages=V2_S_STAGES, stem=24, last=1280, c_latent=16, affine=False)
    assert isinstance(EfficientNetEncoder.from_state_dict(state), EfficientNetEncoder)


def test_1024_pixels_give_24x24_latents():
    x = effnet_preprocess(torch.zeros(1, 3, 1024, 1024))
    assert x.shape == (1, 3, 768, 768)
    assert _real_on_meta()(x.to("meta")).shape == (1, 16, 24, 24)


def test_preprocess_maps_to_imagenet_normalised_range():
    x = effnet_preprocess(torch.full((2, 3, 128, 64), -1.0))
    assert x.shape == (2, 3, 96, 48)
    expected = -torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), expected, atol=1e-5)


@pytest.mark.parametrize("affine", [False, True])
def test_tiny_round_trips_through_safetensors(tmp_path, affine):
    enc = tiny_effnet(affine=affine)
    path = tmp_path / "effnet_encoder.safetensors"
    save_effnet(enc, path)
    loaded = load_effnet(path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.mapper[1].affine is affine
    x = effnet_preprocess(torch.rand(2, 3, 128, 128) * 2 - 1)
    with torch.no_grad():
        out = enc(x)
        assert torch.equal(loaded(x), out)
    assert out.shape == (2, 16, 3, 3) and out.std() > 0.1


def test_checkpoint_wrappers_prefixes_and_num_batches_tracked(tmp_path):
    enc = tiny_effnet(c_latent=8, affine=True, seed=3)
    full = enc.state_dict()
    assert any(k.endswith("num_batches_tracked") for k in full)
    save_file(full, str(tmp_path / "with_counts.safetensors"))
    torch.save({"effnet_state_dict": {f"module.{k}": v for k, v in full.items()},
                "state_dict": {"other.weight": torch.zeros(2)}}, tmp_path / "model_v2_stage_b.pt")
    torch.save({"state_dict": {f"effnet.{k}": v for k, v in full.items()}}, tmp_path / "wrapped.ckpt")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for name in ("with_counts.safetensors", "model_v2_stage_b.pt", "wrapped.ckpt"):
            assert torch.equal(load_effnet(tmp_path / name)(x), enc(x)), name


def test_unrelated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "some_lora.safetensors"
    save_file({"lora_unet_down.lora_down.weight": torch.zeros(4, 8), "lora_unet_down.alpha": torch.ones(())},
              str(path))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not an EfficientNet image encoder.*LoRA"):
        load_effnet(path)


def test_mismatched_shapes_are_refused(tmp_path):
    state = tiny_effnet().state_dict()
    state["backbone.7.1.running_var"] = torch.ones(5)
    path = tmp_path / "broken.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*backbone.7.1.running_var"):
        load_effnet(path)


def test_tiny_is_seeded_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a, b, c = tiny_effnet(seed=0), tiny_effnet(seed=0), tiny_effnet(seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert not torch.equal(a.mapper[0].weight, c.mapper[0].weight)
