"""PixArt-α/Σ specifics the contract test (tests/test_families.py) does not cover: the original single-file
key map, learned-σ output, the T5 attention mask, α/Σ detection, LoRA keys ComfyUI maps, refused options."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("pixart-ws")
    return ws, build_tiny("tiny-pixart", ws / "models")


def _model(ws, path, *settings):
    from trainer.config import load_config
    from trainer.models.base import load_model
    return load_model(load_config(None, [f"model.path={path}", *settings]).model, str(ws))


def test_original_single_file_is_the_same_transformer_and_fine_tunes_save_back_to_it(pixart, tmp_path):
    from safetensors.torch import load_file

    from trainer.families.pixart.keys import diffusers_to_original, original_to_diffusers
    ws, paths = pixart
    folder = _model(ws, paths["diffusers"])
    single = _model(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    assert folder.family == single.family == "pixart-sigma" and folder.prediction_type == "epsilon"
    a, b = folder.transformer.state_dict(), single.transformer.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    orig = load_file(str(paths["single_file"]))
    assert {"blocks.0.attn.qkv.weight", "blocks.0.cross_attn.kv_linear.weight", "x_embedder.proj.weight",
            "final_layer.scale_shift_table"} <= set(orig)
    back = diffusers_to_original(original_to_diffusers(orig))
    assert set(back) == set(orig) and all(torch.equal(back[k], orig[k]) for k in orig)
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn2.to_k.weight.add_(0.25)
    out = tmp_path / "ft.safetensors"
    folder.save_single_file(out, dtype="fp32")
    again = _model(ws, out, f"model.config_path={paths['diffusers']}")
    torch.testing.assert_close(again.transformer.transformer_blocks[0].attn2.to_k.weight,
                               folder.transformer.transformer_blocks[0].attn2.to_k.weight, rtol=0, atol=0)


def test_learned_sigma_is_cut_and_the_t5_mask_hides_padding(pixart):
    ws, paths = pixart
    m = _model(ws, paths["diffusers"])
    assert m.transformer.config.out_channels == 8  # ε ‖ variance
    cond = m.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    assert cond.prompt_attention_mask.sum().item() == 4  # 3 words + </s>; the rest is padding
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = m.predict(x, torch.tensor([500]), cond)
        # what sits in the padded positions does not reach the prediction: the mask is applied
        noisy = type(cond)(cond.prompt_embeds.clone(), cond.prompt_attention_mask)
        noisy.prompt_embeds[:, 10:] = 7.0
        again = m.predict(x, torch.tensor([500]), noisy)
    assert pred.shape == x.shape
    torch.testing.assert_close(pred, again)
    dropped = m.batch_condition({"captions": ["a red square", "a blue circle"]}, lambda c: c, set(),
                                drop_te1=[True, False])
    empty = m.batch_condition({"captions": [""]}, lambda c: c, set())
    torch.testing.assert_close(dropped.prompt_embeds[0], empty.prompt_embeds[0])
    assert not torch.equal(dropped.prompt_embeds[1], empty.prompt_embeds[0])


def test_lora_keys_are_the_ones_comfyui_maps_for_pixart(pixart):
    """comfy/lora.py model_lora_keys_unet (PixArt branch) maps ``transformer.{k}`` for every weight of the
    diffusers PixArt transformer (comfy/utils.py pixart_to_diffusers) and load_lora reads
    ``{x}.lora_A.weight``/``{x}.lora_B.weight``; model_lora_keys_clip maps T5 as ``lora_te1_<module>`` when no
    CLIP is present."""
    from trainer.config import load_config
    from trainer.methods.lora import LoraMethod
    ws, paths = pixart
    model = _model(ws, paths["diffusers"])
    weights = {k[:-len(".weight")] for k in model.transformer.state_dict() if k.endswith(".weight")}
    t5 = {k[:-len(".weight")].replace(".", "_") for k in model.text_encoder.state_dict() if k.endswith(".weight")}
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=all",
                             "training.train_text_encoder=true"])
    state = LoraMethod(model, cfg).adapter_state_dict()
    unet_keys = [k for k in state if k.startswith("transformer.")]
    te_keys = [k for k in state if k.startswith("lora_te1_")]
    assert unet_keys and te_keys and len(unet_keys) + len(te_keys) == len(state)
    for key in unet_keys:
        assert key.endswith((".lora_A.weight", ".lora_B.weight")) and key[len("transformer."):].rsplit(".lora_", 1)[0] \
            in weights, key
    for key in te_keys:
        assert key.split(".")[0][len("lora_te1_"):] in t5, key
    assert any(".attn2.to_k." in k for k in unet_keys) and any(".ff.net.2." in k for k in unet_keys)


def test_alpha_and_sigma_single_files_are_told_apart(tmp_path):
    from safetensors.torch import save_file

    from trainer.families import Evidence, claim
    from trainer.families.checks import read_safetensors_shapes
    base = {"blocks.0.attn.qkv.weight": torch.zeros(6, 2), "blocks.0.cross_attn.kv_linear.weight": torch.zeros(4, 2)}
    for tokens, variant in ((120, "pixart-alpha"), (300, "pixart-sigma")):
        path = tmp_path / f"{tokens}.safetensors"
        save_file({**base, "y_embedder.y_embedding": torch.zeros(tokens, 8)}, str(path))
        assert claim(Evidence("single_file", str(path), shapes=read_safetensors_shapes(path))) == variant


@pytest.mark.parametrize("setting, key", [("model.clip_skip=2", "model.clip_skip"),
                                          ("training.train_text_encoder_2=true", "parts.text_encoder_2.train"),
                                          ("loss.flow_shift=3", "loss.flow_shift")])
def test_validate_refuses_what_pixart_cannot_use(setting, key):
    from trainer.config import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-pixart", setting])
    assert err.value.key == key
