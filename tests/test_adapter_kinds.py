"""The adapters other trainers added: LoRA+ (kohya's loraplus_lr_ratio), LoKr with both factors full (LyCORIS'
full_matrix) and OFT (LyCORIS diag-OFT). Each trains real optimizer steps on the tiny SD model; the saved file,
computed the way ComfyUI computes it (the formulas of comfy/weight_adapter/lokr.py and oft.py, restated below),
gives the trained layers' weights; validate refuses the bad combinations naming the field.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft.tuners.lokr import LoKrLayer
from safetensors.torch import load_file

from trainer.config.checks import load_config
from trainer.errors import ConfigError
from trainer.families.sources import load_model
from trainer.formats.kohya import named_targets
from trainer.methods.lora import LoraMethod
from trainer.methods.oft import oft_layers
from trainer.optim.build import build_optimizer, param_groups
from trainer.optim.schedule import ComponentSchedule

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_sd(tiny_workspace):
    """The tiny SD model in fp32, loaded once; each test adapts its own deep copy."""
    path = tiny_workspace / "models" / "tiny-sd"
    return path, load_model(load_config(None, [f"model.path={path}"]).model, str(tiny_workspace))


FEW = ("parts.denoiser.lora_targets=custom", "lora.custom_targets=[attn1.to_q, ff.net.2, conv1]")  # a few of each kind


def _method(tiny_sd, *settings: str, seed: int = 0):
    path, base = tiny_sd
    cfg = load_config(None, [f"model.path={path}", "training.learning_rate=0.001", *FEW, *settings])
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    return model, LoraMethod(model, cfg), cfg


def _train(model, method, cfg, steps: int = 2):
    """``steps`` real optimizer steps (the run's groups and optimizer) on a loss through the text encoder and UNet."""
    opt = build_optimizer(param_groups(method, cfg), cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.text_encoder.config.vocab_size, (1, 6), generator=g)
    x = torch.randn(1, 4, 8, 8, generator=g)
    for _ in range(steps):
        cond = model.text_encoder(ids)[0]
        model.unet(x, 10, encoder_hidden_states=cond).sample.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_loraplus_gives_b_its_ratio_of_the_learning_rate(tiny_sd):
    plain_model, plain, cfg0 = _method(tiny_sd, "parts.text_encoder_1.train=true")
    plus_model, plus, cfg = _method(tiny_sd, "parts.text_encoder_1.train=true", "lora.loraplus_lr_ratio=4",
                                    "lora.loraplus_text_encoder_lr_ratio=2")
    groups = {g["name"]: g for g in param_groups(plus, cfg)}
    assert set(groups) == {"unet", "unet.lora_up", "text_encoder", "text_encoder.lora_up"}
    assert groups["unet.lora_up"]["lr"] == pytest.approx(4 * groups["unet"]["lr"])
    assert groups["text_encoder.lora_up"]["lr"] == pytest.approx(2 * groups["text_encoder"]["lr"])
    for slot in ("unet", "text_encoder"):  # B (kohya's lora_up) and nothing else in the LoRA+ group
        b = {id(p) for n, p in plus.modules[slot].named_parameters() if ".lora_B." in n}
        assert {id(p) for p in groups[f"{slot}.lora_up"]["params"]} == b and b
        assert not b & {id(p) for p in groups[slot]["params"]}

    before = {n: p.detach().clone() for n, p in plus.modules["unet"].named_parameters() if p.requires_grad}
    assert all(torch.equal(before[n], p) for n, p in plain.modules["unet"].named_parameters() if p.requires_grad)
    _train(plain_model, plain, cfg0, steps=1)
    opt = _train(plus_model, plus, cfg, steps=1)
    moved = {n: (dict(plus.modules["unet"].named_parameters())[n] - before[n],
                 dict(plain.modules["unet"].named_parameters())[n] - before[n]) for n in before}
    b_moves = [(d_plus, d_plain) for n, (d_plus, d_plain) in moved.items() if ".lora_B." in n]
    assert sum(bool(d_plain.abs().sum() > 0) for _, d_plain in b_moves) > len(b_moves) // 2
    for d_plus, d_plain in b_moves:  # Adam's first step is lr x a unit step: B moves 4x as far
        torch.testing.assert_close(d_plus, 4 * d_plain, rtol=1e-4, atol=1e-9)
    for n, (d_plus, d_plain) in moved.items():
        if ".lora_A." in n:
            torch.testing.assert_close(d_plus, d_plain)

    # a component's training window freezes its LoRA+ group with it
    stop = load_config(None, [f"model.path={tiny_sd[0]}", "parts.denoiser.stop_after_steps=1"])
    assert ComponentSchedule(opt, stop, steps_per_epoch=10).apply(1) == ["unet"]
    frozen = [g for g in opt.param_groups if g["name"].startswith("unet")]
    assert len(frozen) == 2 and all(g["lr"] == 0 and not any(p.requires_grad for p in g["params"]) for g in frozen)


def _comfy_lokr(weight: torch.Tensor, layer: dict) -> torch.Tensor:
    """ComfyUI's comfy/weight_adapter/lokr.py: w1, w2 from their full keys or _a @ _b; scale alpha / dim where dim
    is the rank of a decomposed factor, else 1; a 4-D w2 takes w1 as 1x1; W + scale · kron(w1, w2)."""
    dim = None
    w1 = layer.get("lokr_w1")
    if w1 is None:
        dim, w1 = layer["lokr_w1_b"].shape[0], layer["lokr_w1_a"] @ layer["lokr_w1_b"]
    w2 = layer.get("lokr_w2")
    if w2 is None:
        dim, w2 = layer["lokr_w2_b"].shape[0], layer["lokr_w2_a"] @ layer["lokr_w2_b"]
    scale = float(layer["alpha"]) / dim if dim is not None and "alpha" in layer else 1.0
    if w2.ndim == 4:
        w1 = w1[:, :, None, None]
    return weight + scale * torch.kron(w1, w2).reshape(weight.shape)


def _file_layers(path) -> dict:
    layers: dict = {}
    for key, value in load_file(str(path)).items():
        name, _, part = key.partition(".")
        layers.setdefault(name, {})[part] = value.double()
    return layers


def test_lokr_full_matrix_file_is_two_full_factors_comfyui_reproduces(tiny_sd, tmp_path):
    model, method, cfg = _method(tiny_sd, "lora.type=lokr", "lora.lokr_full_matrix=true", "lora.factor=4",
                                 "lora.rank=1")
    _train(model, method, cfg)
    method.save(tmp_path / "lokr.safetensors", "fp32", {})
    layers = _file_layers(tmp_path / "lokr.safetensors")
    targets = named_targets(method._adapted(), model.lora_namer(), "default",
                            lambda m, a: ((n, x) for n, x in m.named_modules() if isinstance(x, LoKrLayer)))
    assert set(layers) == set(targets) and any(".conv" in p for p, _ in targets.values())
    changed = 0
    for name, (path, layer) in targets.items():
        assert set(layers[name]) == {"lokr_w1", "lokr_w2", "alpha"}, name  # rank 1 and no lokr_w2_a/_b
        base = layer.get_base_layer().weight.double()
        trained = base + layer.get_delta_weight("default").double()
        changed += not torch.allclose(trained, base)
        torch.testing.assert_close(_comfy_lokr(base, layers[name]), trained, rtol=1e-5, atol=1e-6)
    assert changed > len(targets) // 2  # trained (mid_block attn1.to_q sees one token: no gradient)


def _comfy_oft(weight: torch.Tensor, layer: dict) -> torch.Tensor:
    """ComfyUI's comfy/weight_adapter/oft.py at strength 1: Q = B - Bᵀ, clamped to norm alpha when alpha > 0;
    R = (I + Q)(I - Q)⁻¹; W + einsum("k n m, k n ... -> k m ...", R - I, W split into blocks of rows)."""
    blocks, alpha = layer["oft_blocks"], float(layer.get("alpha", torch.tensor(0.0)))
    block_num, block_size, _ = blocks.shape
    eye = torch.eye(block_size, dtype=blocks.dtype)
    q = blocks - blocks.transpose(1, 2)
    if alpha > 0 and torch.norm(q) + 1e-8 > alpha:
        q = q * alpha / (torch.norm(q) + 1e-8)
    r = (eye + q) @ (eye - q).inverse()
    _, *shape = weight.shape
    diff = torch.einsum("k n m, k n ... -> k m ...", r - eye, weight.reshape(block_num, block_size, *shape))
    return weight + diff.reshape(weight.shape)


def test_oft_file_in_comfyuis_formula_gives_the_trained_layers(tiny_sd, tmp_path):
    model, method, cfg = _method(tiny_sd, "lora.type=oft", "lora.rank=4", "parts.text_encoder_1.train=true")
    _train(model, method, cfg)
    method.save(tmp_path / "oft.safetensors", "fp32", {})
    layers = _file_layers(tmp_path / "oft.safetensors")
    targets = named_targets(method._adapted(), model.lora_namer(), "default", oft_layers)
    assert set(layers) == set(targets)
    assert any(n.startswith("lora_te_") for n in targets) and any(".conv" in p for p, _ in targets.values())
    g, changed = torch.Generator().manual_seed(2), 0
    for name, (path, layer) in targets.items():
        assert set(layers[name]) == {"oft_blocks", "alpha"} and layers[name]["oft_blocks"].shape[1:] == (4, 4)
        base = layer.base_layer
        comfy = _comfy_oft(base.weight.double(), layers[name]).float()
        changed += not torch.allclose(comfy, base.weight)  # trained: the rotation is no identity
        # the layer as it trained (its forward) equals the frozen layer run with ComfyUI's weight
        if isinstance(base, torch.nn.Linear):
            x = torch.randn(2, base.in_features, generator=g)
            expected = F.linear(x, comfy, base.bias)
        else:
            x = torch.randn(1, base.in_channels, 6, 6, generator=g)
            expected = base._conv_forward(x, comfy, base.bias)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-5)
    assert changed > len(targets) // 2


def test_oft_rank_the_layer_cannot_take_is_refused_naming_it(tiny_sd):
    with pytest.raises(ConfigError, match=r"OFT with a rank the layer cannot take: lora.rank = 3 .*layer "
                                          r"down_blocks\.0\.\S+ has 16 outputs"):
        _method(tiny_sd, "lora.type=oft", "lora.rank=3")


@pytest.mark.parametrize("settings, key", [
    (["lora.type=loha", "lora.loraplus_lr_ratio=16"], "lora.loraplus_lr_ratio"),
    (["lora.type=oft", "lora.loraplus_text_encoder_lr_ratio=4"], "lora.loraplus_text_encoder_lr_ratio"),
    (["lora.type=loha", "lora.lokr_full_matrix=true"], "lora.lokr_full_matrix"),
    (["lora.type=lokr", "lora.lokr_full_matrix=true", "lora.decompose_both=true"], "lora.lokr_full_matrix"),
    (["lora.type=oft", "lora.dropout=0.1"], "lora.dropout"),
    (["lora.type=oft", "lora.conv_rank=4"], "lora.conv_rank"),
])
def test_validate_refuses_an_option_of_another_adapter_in_one_line(settings, key):
    with pytest.raises(ConfigError) as err:
        load_config(preset="demo", overrides=settings)
    assert err.value.key == key and key in str(err.value) and "\n" not in str(err.value)


def test_validate_takes_the_good_combinations():
    cfg = load_config(preset="demo", overrides=["lora.type=dora", "lora.loraplus_lr_ratio=16"])
    assert cfg.lora.loraplus_lr_ratio == 16
    assert load_config(preset="demo", overrides=["lora.type=lokr", "lora.lokr_full_matrix=true"]).lora.lokr_full_matrix
