"""``model.training_adapter``: a de-distilling LoRA (in the layout ai-toolkit publishes Z-Image Turbo's) is in the loss
exactly as if merged into the base, out of the samples and out of the saved LoRA; an adapter of another family or
layout is refused in one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEMO_DATA, load_tiny_fp32, train_quiet

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TARGETS = ("attention.to_q", "attention.to_k", "feed_forward.w1")


def write_adapter(model, out: Path, rank: int = 2, prefix: str = "diffusion_model", seed: int = 0) -> Path:
    """A LoRA of ``model``'s transformer in ai-toolkit's published layout (``diffusion_model.<diffusers module>
    .lora_A/lora_B.weight``, no alpha: scale 1), large enough to move the prediction."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for path, module in model.transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and path.endswith(TARGETS):
            state[f"{prefix}.{path}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.3
            state[f"{prefix}.{path}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.3
    save_file(state, str(out))
    return out


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("adapter-ws")
    paths = build_tiny("tiny-zimage", ws / "models")
    model = load_tiny_fp32(ws, paths["diffusers"])
    return ws, paths, write_adapter(model, ws / "zimage_turbo_training_adapter.safetensors")


def _loss(model) -> torch.Tensor:
    """The flow loss of one fixed batch (latents, σ, noise and caption fixed)."""
    gen = torch.Generator().manual_seed(3)
    x, noise = torch.randn(1, 16, 8, 8, generator=gen), torch.randn(1, 16, 8, 8, generator=gen)
    sigma = torch.tensor([0.6])
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    with torch.no_grad():
        pred = model.predict((1 - sigma) * x + sigma * noise, sigma, cond)
    return torch.nn.functional.mse_loss(pred, noise - x)


def test_the_adapter_is_in_the_loss_as_if_merged_and_out_of_the_samples(zimage):
    from trainer.tools.common import apply_loras, read_lora
    from trainer.train.training_adapter import adapter_off, attach_training_adapter, comfy_names_as_family
    ws, paths, adapter = zimage
    model = load_tiny_fp32(ws, paths["diffusers"])
    without = _loss(model)
    model.training_adapter = attach_training_adapter(model, str(adapter), model)
    assert model.training_adapter.layers == len(load_file(str(adapter))) // 2  # every layer of the file
    hooked = _loss(model)
    merged_model = load_tiny_fp32(ws, paths["diffusers"])
    apply_loras(merged_model, [(comfy_names_as_family(read_lora(adapter), merged_model), 1.0)])
    merged = _loss(merged_model)
    assert abs(hooked - without) > 0.01 * without, (hooked, without)
    torch.testing.assert_close(hooked, merged, rtol=1e-5, atol=1e-6)
    with adapter_off(model):  # what samples see
        torch.testing.assert_close(_loss(model), without, rtol=0, atol=0)
    torch.testing.assert_close(_loss(model), hooked, rtol=0, atol=0)


def test_a_run_with_the_adapter_saves_only_its_own_lora(zimage):
    ws, paths, adapter = zimage
    common = (f"model.path={paths['diffusers']}", "training.max_steps=2", "training.batch_size=2", "lora.rank=4",
              "lora.alpha=4", "training.learning_rate=0.01", "sampling.prompts=[]",
              f"data.concepts=[{{path: {DEMO_DATA}}}]")
    plain = load_file(str(next(train_quiet(ws, "plain", "demo-zimage", *common).glob("*.safetensors"))))
    with_adapter = load_file(str(next(train_quiet(ws, "adapter", "demo-zimage", *common,
                                                  f"model.training_adapter={adapter}").glob("*.safetensors"))))
    assert set(with_adapter) == set(plain)  # the same LoRA layers, nothing of the adapter's
    assert not set(load_file(str(adapter))) & set(with_adapter)
    ups = [k for k in plain if "lora_B" in k]
    # the adapter was in the loss: the trained halves differ from the run without it
    assert max(float((with_adapter[k] - plain[k]).abs().max()) for k in ups) > 1e-3


def test_an_adapter_of_another_family_or_layout_is_refused_naming_the_file(zimage, tmp_path):
    from trainer.errors import ConfigError
    from trainer.train.training_adapter import attach_training_adapter
    ws, paths, adapter = zimage
    model = load_tiny_fp32(ws, paths["diffusers"])
    sd_lora = tmp_path / "sd15_lora.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(32, 4)}, str(sd_lora))
    with pytest.raises(ConfigError) as err:
        attach_training_adapter(model, str(sd_lora), model)
    assert err.value.key == "model.training_adapter" and "sd15_lora.safetensors" in str(err.value)
    assert "another model family" in str(err.value) and "\n" not in str(err.value)
    lokr = tmp_path / "lokr_adapter.safetensors"  # LyCORIS LoKr, named as the family's LyCORIS files are
    q = model.transformer.layers[0].attention.to_q
    save_file({"lycoris_layers_0_attention_to_q.lokr_w1": torch.ones(2, 2),
               "lycoris_layers_0_attention_to_q.lokr_w2": torch.ones(q.out_features // 2, q.in_features // 2)},
              str(lokr))
    with pytest.raises(ConfigError) as err:
        attach_training_adapter(model, str(lokr), model)
    assert "lokr_adapter.safetensors" in str(err.value) and "plain LoRA" in str(err.value), str(err.value)


def test_validate_names_a_missing_adapter_and_takes_a_hub_file():
    from trainer.config.checks import cross_field_warnings, load_config
    cfg = load_config(None, ["model.path=builtin:tiny-zimage", "model.training_adapter=/no/such/adapter.safetensors"])
    keys = {i.key: i.message for i in cross_field_warnings(cfg) if i.level == "error"}
    assert "does not exist" in keys["model.training_adapter"]
    preset = load_config(preset="zimage-turbo-lora")
    assert "model.training_adapter" not in {i.key for i in cross_field_warnings(preset) if i.level == "error"}
