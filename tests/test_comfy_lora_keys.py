"""The transformer families' LoRA files load in ComfyUI: every module a LoRA adapts (with lora.unet_targets = all, the
widest choice) is one ComfyUI's LoRA key map has for that model, so no adapter is dropped there.

ComfyUI reads ``transformer.<diffusers module>.lora_A.weight`` / ``.lora_B.weight`` (comfy/weight_adapter/lora.py, the
"diffusers2" names; no ``.alpha``: scale 1, α/r is in lora_B) and maps ``transformer.<diffusers module>`` through a
per-model table (comfy/lora.py ``model_lora_keys_unet``), read for this test in ComfyUI's current source:
- Flux.1 and Chroma, whose ComfyUI model classes subclass Flux: comfy/utils.py ``flux_to_diffusers`` —
  the double blocks' attention (q/k/v into the fused qkv), out projections, MLPs (``ff.net``), modulation
  (``norm1.linear``), the single blocks' q/k/v/``proj_mlp``/``proj_out``/``norm.linear``, and the embedders / final
  layer;
- Flux.2 (checked in comfyanonymous/ComfyUI 3cd7b32f, 2026-01-07): ``flux_to_diffusers`` has no Flux.2 names
  (``ff.linear_in/out``, ``ff_context.*``, ``to_qkv_mlp_proj``, the single blocks' ``to_out`` map to nothing), so
  Flux.2 files are in the original BFL layout, ``diffusion_model.<module>``, which ``model_lora_keys_unet`` maps for
  every weight of the model: the BFL Linears of ComfyUI's Flux.2 model (comfy/ldm/flux, ``global_modulation`` and
  ``mlp_silu_act``); tests/test_flux2_lora_layout.py checks the shapes and what each key adds;
- SD 3/3.5: ``mmdit_to_diffusers`` — attention (also 3.5 medium's ``attn2``), MLPs, ``norm1(_context).linear``,
  the embedders, ``norm_out``, ``proj_out``;
- Z-Image (ComfyUI's Lumina2 branch): ``z_image_to_diffusers`` — the layers' and refiners' attention and
  ``feed_forward.w1/w2/w3``, ``adaLN_modulation.0``;
- Qwen-Image: its ComfyUI weights keep diffusers' names, every weight is mapped;
- FLUX.1 Kontext [dev] (checked in comfyanonymous/ComfyUI 3cd7b32f, 2026-01-07): ``comfy/model_detection.py`` reads
  a Kontext file as Flux.1 dev (the same keys; ``image_model: flux``, ``guidance_embed``), so it is a
  ``model_base.Flux`` and ``comfy/lora.py`` maps its LoRA keys through the same ``flux_to_diffusers`` table.
- Wan 2.1 (checked in Comfy-Org/ComfyUI 17358c8f): no Wan branch; ``model_lora_keys_unet`` maps
  ``diffusion_model.<module>`` for every weight of the model, whose keys are the original Wan layout (comfy/ldm/wan:
  ``blocks.N.self_attn|cross_attn.q|k|v|o``, ``blocks.N.ffn.0|2``, ``text_embedding.0|2``, ``time_embedding.0|2``,
  ``time_projection.1``, ``head.head``), so Wan files name the original modules under ``diffusion_model.``.
The tables below restate those maps as module-path patterns (ComfyUI's code is not copied)."""

from __future__ import annotations

import re

import pytest

N = r"\d+"
ATTN = r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)"
FLUX = "|".join([
    rf"transformer_blocks\.{N}\.({ATTN}|norm1\.linear|norm1_context\.linear|ff\.net\.0\.proj|ff\.net\.2|"
    r"ff_context\.net\.0\.proj|ff_context\.net\.2)",
    rf"single_transformer_blocks\.{N}\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out|norm\.linear)",
    r"proj_out|x_embedder|context_embedder|norm_out\.linear",
    r"time_text_embed\.(timestep_embedder|text_embedder|guidance_embedder)\.linear_[12]"])
SD3 = "|".join([
    rf"transformer_blocks\.{N}\.({ATTN}|attn2\.(to_q|to_k|to_v|to_out\.0)|norm1\.linear|norm1_context\.linear|"
    r"ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|ff_context\.net\.2)",
    r"context_embedder|pos_embed\.proj|norm_out\.linear|proj_out",
    r"time_text_embed\.(timestep_embedder|text_embedder)\.linear_[12]"])
ZIMAGE = "|".join([
    rf"(layers|context_refiner|noise_refiner)\.{N}\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|"
    r"adaLN_modulation\.0)",
    r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)|all_x_embedder\.2-1|cap_embedder\.1|t_embedder\.mlp\.[02]"])
QWEN = r".+"
FLUX2_BFL = "|".join([
    rf"double_blocks\.{N}\.((img|txt)_attn\.(qkv|proj)|(img|txt)_mlp\.[02])", rf"single_blocks\.{N}\.linear[12]",
    r"img_in|txt_in|(time_in|guidance_in)\.(in|out)_layer|final_layer\.(linear|adaLN_modulation\.1)",
    r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.lin"])

WAN21 = "|".join([rf"blocks\.{N}\.((self_attn|cross_attn)\.(q|k|v|o)|ffn\.[02])",
                  r"(text_embedding|time_embedding)\.[02]|time_projection\.1|head\.head"])

ROWS = [("builtin:tiny-flux", FLUX), ("builtin:tiny-flux-kontext", FLUX), ("builtin:tiny-chroma", FLUX),
        ("builtin:tiny-flux2-klein", FLUX2_BFL), ("builtin:tiny-sd3", SD3), ("builtin:tiny-zimage", ZIMAGE),
        ("builtin:tiny-qwen-image", QWEN), ("builtin:tiny-wan21", WAN21)]
# the file's key prefix where it is not "transformer."
PREFIX = {"builtin:tiny-flux2-klein": "diffusion_model.", "builtin:tiny-wan21": "diffusion_model."}


@pytest.mark.parametrize("path, mapped", ROWS, ids=[r[0].split("tiny-")[1] for r in ROWS])
def test_every_adapted_module_is_one_comfyui_maps(path, mapped, tmp_path):
    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    from trainer.families.sources import load_model
    cfg = load_config(None, [f"model.path={path}", "lora.unet_targets=all", f"general.workspace={tmp_path}"])
    keys = LoraMethod(load_model(cfg, str(tmp_path), "cpu"), cfg).adapter_state_dict()
    modules = set()
    prefix = PREFIX.get(path, "transformer.")
    for key in keys:
        assert key.startswith(prefix) and key.endswith((".lora_A.weight", ".lora_B.weight")), key
        modules.add(key[len(prefix):].rsplit(".lora_", 1)[0])
    assert len(modules) > 8
    dropped = sorted(m for m in modules if not re.fullmatch(mapped, m))
    assert not dropped, f"ComfyUI would drop these adapters: {dropped[:6]}"


def test_a_kontext_lora_has_the_keys_of_a_flux_dev_lora(tmp_path):
    """ComfyUI loads a Kontext LoRA with its Flux.1 map only if the file names the modules a Flux.1 dev LoRA names: the
    Kontext transformer is dev's, and the same targets give the same keys and shapes."""
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod

    def keys(path):
        cfg = load_config(None, [f"model.path={path}", "lora.unet_targets=all", f"general.workspace={tmp_path}"])
        return {k: tuple(v.shape) for k, v in LoraMethod(load_model(cfg, str(tmp_path), "cpu"), cfg)
                .adapter_state_dict().items()}
    assert keys("builtin:tiny-flux-kontext") == keys("builtin:tiny-flux")


def test_a_wan_lora_names_weights_of_the_original_file_and_diffusers_reads_it_back(tmp_path):
    """ComfyUI's generic map: ``diffusion_model.<module>`` + ``.weight`` must be a weight of the model as ComfyUI holds
    it (the original single file's keys); diffusers' Wan converter turns the file back into the trained modules."""
    from safetensors.torch import load_file

    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers
    from trainer.config.checks import load_config
    from trainer.families import build_tiny
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    cfg = load_config(None, ["model.path=builtin:tiny-wan21", "lora.unet_targets=all", f"general.workspace={tmp_path}"])
    method = LoraMethod(load_model(cfg, str(tmp_path), "cpu"), cfg)
    keys = method.adapter_state_dict()
    original = set(load_file(str(build_tiny("tiny-wan21", tmp_path / "models")["single_file"])))
    modules = {k.rsplit(".lora_", 1)[0] for k in keys}
    assert all(m.removeprefix("diffusion_model.") + ".weight" in original for m in modules), sorted(modules)[:4]
    converted = _convert_non_diffusers_wan_lora_to_diffusers(dict(keys))
    trained = {name for name, module in method.model.transformer.named_modules() if hasattr(module, "lora_A")}
    assert {k.rsplit(".lora_", 1)[0].removeprefix("transformer.") for k in converted} == trained
