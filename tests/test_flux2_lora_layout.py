"""Flux.2 LoRA files in the original BFL layout: ComfyUI maps every key (and adds to each weight what was trained),
diffusers' Flux.2 pipeline loads the file with the trained effect, and ``lora.init_weights`` reads it back.

ComfyUI, as read at upstream commit 3cd7b32f (2026-01-07):
- comfy/lora.py ``model_lora_keys_unet``: for every weight ``diffusion_model.<m>.weight`` of the loaded model the
  LoRA key ``diffusion_model.<m>`` maps to it (any model); its Flux table ``flux_to_diffusers`` (comfy/utils.py) has
  no Flux.2 names, so the diffusers names ``ff.linear_in/out``, ``ff_context.*``, ``to_qkv_mlp_proj`` and the single
  blocks' ``to_out`` map to nothing there.
- comfy/ldm/flux/model.py and layers.py with Flux.2's detected config (comfy/model_detection.py:
  ``double_stream_modulation_img.lin.weight`` present → ``global_modulation``, ``mlp_silu_act``): the model's Linears
  are ``img_in``, ``txt_in``, ``time_in.in_layer/out_layer`` (``guidance_in.*`` for [dev]),
  ``double_stream_modulation_img/txt.lin``, ``single_stream_modulation.lin``, per double block
  ``img_attn/txt_attn.qkv`` (3h × h) and ``.proj`` (h × h), ``img_mlp/txt_mlp.0`` (2m × h, the gated MLP's input)
  and ``.2`` (h × m), per single block ``linear1`` (3h + 2m × h) and ``linear2`` (h × h + m), and
  ``final_layer.linear`` / ``final_layer.adaLN_modulation.1``; h the width, m = h · mlp_ratio.
- comfy/weight_adapter/lora.py: ``<key>.lora_B.weight`` / ``<key>.lora_A.weight`` read as up / down, no
  ``<key>.alpha`` → scale 1; the weight gains strength · up @ down.
The patterns and shapes below restate those (ComfyUI's code is not copied).
"""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

N = r"\d+"
COMFY_FLUX2 = "|".join([
    rf"double_blocks\.{N}\.((img|txt)_attn\.(qkv|proj)|(img|txt)_mlp\.[02])",
    rf"single_blocks\.{N}\.linear[12]",
    r"img_in|txt_in|(time_in|guidance_in)\.(in|out)_layer|final_layer\.(linear|adaLN_modulation\.1)",
    r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.lin"])


def comfy_shape(module: str, h: int, m: int):
    """(out, in) of ComfyUI's Flux.2 Linear ``module`` (block Linears only)."""
    tail = module.split(".", 2)[2]
    return {"img_attn.qkv": (3 * h, h), "txt_attn.qkv": (3 * h, h), "img_attn.proj": (h, h), "txt_attn.proj": (h, h),
            "img_mlp.0": (2 * m, h), "txt_mlp.0": (2 * m, h), "img_mlp.2": (h, m), "txt_mlp.2": (h, m),
            "linear1": (3 * h + 2 * m, h), "linear2": (h, h + m)}[tail]


ALL_LINEARS = ("lora.unet_targets=custom", "lora.custom_targets=[to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,"
               "add_v_proj,to_add_out,to_qkv_mlp_proj,single_transformer_blocks.*.attn.to_out,linear_in,linear_out,"
               "double_stream_modulation_img.linear,double_stream_modulation_txt.linear,"
               "single_stream_modulation.linear,x_embedder,context_embedder,norm_out.linear,proj_out]")
# every Linear but the final norm's, whose (shift, scale) halves diffusers' Flux.2 LoRA converter does not swap
# (diffusers 0.42.1; its single-file converter does): see the last test
DIFFUSERS_READS = (ALL_LINEARS[0], ALL_LINEARS[1].replace("norm_out.linear,", ""))


def _trained(tmp_path, *settings):
    """The tiny [klein] with a LoRA whose lora_B is random (as after training): (model, LoraMethod)."""
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    cfg = load_config(None, ["model.path=builtin:tiny-flux2-klein", f"general.workspace={tmp_path}", "lora.rank=4",
                             "lora.alpha=8", *settings])
    model = load_model(cfg, str(tmp_path), "cpu")
    method = LoraMethod(model, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return cfg, model, method


@pytest.mark.parametrize("settings", [("lora.unet_targets=all",), ALL_LINEARS], ids=["all", "every-linear"])
def test_every_key_is_one_comfyui_maps_and_adds_what_was_trained(settings, tmp_path):
    from trainer.formats.kohya import lora_layers
    _, model, method = _trained(tmp_path, *settings)
    state = method.adapter_state_dict()
    cfg = model.transformer.config
    h = cfg.num_attention_heads * cfg.attention_head_dim
    m = int(h * cfg.mlp_ratio)
    modules = {}
    for key, value in state.items():
        assert key.startswith("diffusion_model.") and key.endswith((".lora_A.weight", ".lora_B.weight")), key
        modules.setdefault(key[len("diffusion_model."):].rsplit(".lora_", 1)[0], {})[key[-8]] = value
    dropped = sorted(k for k in modules if not re.fullmatch(COMFY_FLUX2, k))
    assert not dropped, f"ComfyUI would drop these adapters: {dropped[:6]}"
    assert any(k.endswith("img_mlp.0") for k in modules) and any(k.endswith("linear1") for k in modules)

    # what ComfyUI adds to each of its weights (up @ down, scale 1) is what the adapters add to the diffusers Linears
    # the BFL weight is made of (diffusers' convert_flux2_transformer_checkpoint_to_diffusers: qkv = [q; k; v], the
    # final norm's halves swapped)
    deltas = {path: layer.get_delta_weight("default").detach() for path, layer in lora_layers(model.transformer,
                                                                                                "default")}
    for name, ab in modules.items():
        added = ab["B"] @ ab["A"]
        if name.startswith(("double_blocks.", "single_blocks.")):
            assert tuple(added.shape) == comfy_shape(name, h, m), name
        block = re.match(r"double_blocks\.(\d+)\.(img|txt)_attn\.qkv$", name)
        if block:
            i, side = block.groups()
            parts = ("to_q", "to_k", "to_v") if side == "img" else ("add_q_proj", "add_k_proj", "add_v_proj")
            expected = torch.cat([deltas[f"transformer_blocks.{i}.attn.{p}"] for p in parts])
        else:
            from trainer.families.flux2.lora_keys import bfl_module
            path = next(p for p in deltas if bfl_module(p)[0] == name)
            expected = deltas[path]
            if path == "norm_out.linear":
                expected = torch.cat(expected.chunk(2)[::-1])
        torch.testing.assert_close(added, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_the_file_loads_in_diffusers_flux2_pipeline_with_the_trained_effect(tmp_path):
    """Flux2KleinPipeline.load_lora_weights converts the BFL file (diffusers' Flux.2 converter) into adapters that give
    the transformer the trained model's output (every Linear but the final norm's: see the last test)."""
    from safetensors.torch import save_file

    from trainer.families.flux2.family import Flux2Conditioning
    from trainer.families.sources import load_model
    cfg, model, method = _trained(tmp_path, *DIFFUSERS_READS)
    path = tmp_path / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in method.adapter_state_dict().items()}, str(path))

    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 128, 2, 3, generator=gen)  # non-square
    embeds = Flux2Conditioning(torch.randn(1, 5, model.transformer.config.joint_attention_dim, generator=gen))
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        trained = model.predict(latents, sigma, embeds)
        fresh = load_model(cfg, str(tmp_path), "cpu")
        base = fresh.predict(latents, sigma, embeds)
        fresh.pipeline(None).load_lora_weights(str(path))
        loaded = fresh.predict(latents, sigma, embeds)
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)


def test_init_weights_reads_the_file_back_and_other_layouts(tmp_path):
    """The BFL file round-trips into fresh adapters; so do a file whose fused q/k/v LoRA shares one A (ai-toolkit's,
    which diffusers' converter also reads) and an earlier diffusers-layout file."""
    from trainer.families.common.peft_lora import peft_layout_state_dict
    from trainer.families.flux2 import lora_keys
    from trainer.formats.kohya import lora_layers
    _, model, method = _trained(tmp_path, "lora.unet_targets=all")
    modules = {"unet": model.transformer}
    bfl = method.adapter_state_dict()
    diffusers_layout = peft_layout_state_dict(modules, {"unet": "transformer"})
    assert model.load_lora_state_dict(bfl, modules) == len(diffusers_layout) // 2
    assert method.adapter_state_dict().keys() == bfl.keys()
    for k, v in method.adapter_state_dict().items():
        torch.testing.assert_close(v, bfl[k], rtol=0, atol=1e-7, msg=k)
    assert model.load_lora_state_dict(diffusers_layout, modules) == len(diffusers_layout) // 2

    shared = dict(bfl)
    a = torch.randn(4, 32)
    shared["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"] = a
    shared["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"] = torch.randn(96, 4)
    model.load_lora_state_dict(shared, modules)
    layers = dict(lora_layers(model.transformer, "default"))
    torch.testing.assert_close(layers["transformer_blocks.0.attn.to_k"].lora_A["default"].weight, a)
    ranks = {p: l.r["default"] for p, l in layers.items()}
    with pytest.raises(ValueError, match="rank"):
        lora_keys.from_bfl({**bfl, "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(5, 32)},
                           ranks)
    with pytest.raises(ValueError, match="match no LoRA layer"):
        model.load_lora_state_dict({**bfl, "diffusion_model.img_in.lora_A.weight": torch.zeros(4, 128),
                                    "diffusion_model.img_in.lora_B.weight": torch.zeros(32, 4)}, modules)


def test_diffusers_reads_the_final_norms_lora_with_its_halves_unswapped(tmp_path):
    """Known difference, pinned so that a diffusers fix shows: a LoRA on ``norm_out.linear`` is written as ComfyUI
    applies it to ``final_layer.adaLN_modulation.1`` (BFL order: shift, scale), and diffusers' Flux.2 LoRA converter
    maps that key to ``norm_out.linear`` without the swap its checkpoint converter makes, so in diffusers the
    adapter moves the scale where it was trained to move the shift. No target preset adapts this Linear."""
    from safetensors.torch import save_file

    from trainer.families.sources import load_model
    from trainer.formats.kohya import lora_layers
    cfg, model, method = _trained(tmp_path, "lora.unet_targets=custom", "lora.custom_targets=[norm_out.linear]")
    path = tmp_path / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in method.adapter_state_dict().items()}, str(path))
    trained = dict(lora_layers(model.transformer, "default"))["norm_out.linear"].get_delta_weight("default").detach()
    fresh = load_model(cfg, str(tmp_path), "cpu")
    fresh.pipeline(None).load_lora_weights(str(path))
    (name,) = fresh.transformer.peft_config
    loaded = dict(lora_layers(fresh.transformer, name))["norm_out.linear"].get_delta_weight(name).detach()
    torch.testing.assert_close(loaded, torch.cat(trained.chunk(2)[::-1]), rtol=1e-5, atol=1e-7)


def test_the_model_tools_apply_the_file_as_trained(tmp_path):
    """merge / sample with LoRAs read the BFL file: the fused q/k/v LoRA reaches q, k and v by rows, and the merged
    transformer holds the trained weights."""
    from safetensors.torch import save_file

    from trainer.families.sources import load_model
    from trainer.formats.kohya import lora_layers
    from trainer.tools.common import apply_loras, read_lora
    cfg, model, method = _trained(tmp_path, *DIFFUSERS_READS)
    path = tmp_path / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in method.adapter_state_dict().items()}, str(path))
    deltas = {p: layer.get_delta_weight("default").detach() for p, layer in lora_layers(model.transformer, "default")}
    fresh = load_model(cfg, str(tmp_path), "cpu")
    before = {k: v.clone() for k, v in fresh.transformer.state_dict().items()}
    assert apply_loras(fresh, [(read_lora(path), 1.0)]) == len(method.adapter_state_dict()) // 2
    after = fresh.transformer.state_dict()
    for p, delta in deltas.items():
        torch.testing.assert_close(after[f"{p}.weight"] - before[f"{p}.weight"], delta, rtol=1e-4, atol=1e-6, msg=p)
