"""Flux.1 specifics the contract test (tests/test_families.py) does not cover: the BFL key map both ways,
the fine-tune single file, detection of Flux variants that cannot train, options Flux refuses, LoRA
keys ComfyUI maps, and FLUX.1 Kontext [dev]: the transformer's inputs as FluxKontextPipeline builds them,
samples from a control image, a LoRA trained on pairs in the Kontext pipeline, and what it refuses."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import load_tiny, load_tiny_fp32, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("flux-ws")
    return ws, build_tiny("tiny-flux", ws / "models")


def test_bfl_single_file_is_the_same_transformer_and_fine_tunes_save_back_to_it(flux, tmp_path):
    from safetensors.torch import load_file

    from trainer.families.flux.keys import bfl_to_diffusers, diffusers_to_bfl
    ws, paths = flux
    folder = load_tiny_fp32(ws, paths["diffusers"])
    single = load_tiny_fp32(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    assert single.family == folder.family == "flux-dev"
    a, b = folder.transformer.state_dict(), single.transformer.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    bfl = load_file(str(paths["single_file"]))
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.linear1.weight" in bfl
    back = diffusers_to_bfl(bfl_to_diffusers(bfl))
    assert set(back) == set(bfl) and all(torch.equal(back[k], bfl[k]) for k in bfl)
    # a fine-tune is saved as the BFL file: its weights load back as the same transformer
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "ft.safetensors"
    folder.save_single_file(out, dtype="fp32", metadata={"x": "y"})
    import os
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # readable by others as the umask says (not 0600)
    again = load_tiny_fp32(ws, out, f"model.config_path={paths['diffusers']}")
    torch.testing.assert_close(again.transformer.transformer_blocks[0].attn.to_k.weight,
                               folder.transformer.transformer_blocks[0].attn.to_k.weight, rtol=0, atol=0)


def test_predict_packs_and_unpacks_and_the_shift_follows_the_resolution(flux):
    """(The shift follows the resolution under loss.resolution_shift; the default draw is unshifted, see below.)"""
    ws, paths = flux
    m = load_tiny_fp32(ws, paths["diffusers"])
    cond = m.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    x = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = m.predict(x, torch.tensor([0.5]), cond)
    assert pred.shape == x.shape
    lc = type("L", (), {"timestep_distribution": "uniform", "resolution_shift": True})()
    small = m.objective.sample_timesteps(512, lc, torch.Generator().manual_seed(1), torch.zeros(1, 16, 16, 16).expand(512, -1, -1, -1))
    large = m.objective.sample_timesteps(512, lc, torch.Generator().manual_seed(1), torch.zeros(1, 16, 128, 128).expand(512, -1, -1, -1))
    assert large.mean() > small.mean()
    with pytest.raises(ValueError, match="must be even"):
        m.predict(torch.zeros(1, 16, 7, 8), torch.tensor([0.5]), cond)


def test_the_cache_keeps_t5_in_the_dtype_it_comes_out_in(flux):
    """T5's 512 tokens from a bf16 T5 stay bf16 in the text cache (half the 8 MB a caption of fp32); the step casts
    them to its compute dtype, so the prediction is the one of the same features widened to fp32, dropout included."""
    ws, paths = flux
    m = load_tiny(ws, paths["diffusers"], "parts.text_encoder_2.dtype=bf16")
    entry = m.encode_captions(["a red square"])
    assert entry["prompt_embeds"].dtype == torch.bfloat16 and entry["pooled_prompt_embeds"].dtype == torch.float32
    x = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(2))
    preds = []
    for e in (entry, {k: v.float() for k, v in entry.items()}):
        batch = {k: torch.cat([v, v]) for k, v in e.items()}
        cond = m.batch_condition(batch, lambda c: c, set(), drop_te2=[False, True])
        with torch.no_grad():
            preds.append(m.predict(x, torch.tensor([0.3, 0.6]), cond))
    assert torch.equal(preds[0], preds[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_patch_ids_made_on_the_device_are_the_pipeline_ones(dtype):
    """The ids Flux, Chroma and Kontext steps give the transformer are made where the step runs (diffusers' helper makes
    them on the CPU and copies them: a blocking copy every step) and are the same numbers."""
    from diffusers import FluxPipeline

    from trainer.families.common.packed_ids import latent_image_ids
    for h, w in ((1, 1), (4, 6), (64, 64), (128, 96)):
        ids = latent_image_ids(h, w, "cpu", dtype)
        assert ids.dtype == dtype and torch.equal(ids, FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", dtype))


def test_flux2_position_ids_made_on_the_device_are_the_pipeline_ones():
    """Flux.2's latent, text and reference ids, likewise (int64 (t, y, x, l) rows)."""
    from diffusers import Flux2KleinPipeline

    from trainer.families.common.packed_ids import flux2_latent_ids, flux2_reference_ids, flux2_text_ids
    for b, h, w in ((1, 1, 1), (2, 4, 6), (3, 32, 24)):
        latents, embeds = torch.zeros(b, 8, h, w), torch.zeros(b, h * 3, 5)
        for mine, theirs in ((flux2_latent_ids(latents), Flux2KleinPipeline._prepare_latent_ids(latents)),
                             (flux2_text_ids(embeds), Flux2KleinPipeline._prepare_text_ids(embeds))):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    # reference images (Flux.2's multi-reference editing): one row of each, the k-th on time 10 + 10·k
    refs = [torch.zeros(2, 8, 4, 6), torch.zeros(2, 8, 3, 3), torch.zeros(2, 8, 1, 5)]
    mine, theirs = flux2_reference_ids(refs), Flux2KleinPipeline._prepare_image_ids([r[:1] for r in refs])
    assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_lora_keys_are_the_ones_comfyui_maps_for_flux(flux, tmp_path):
    """ComfyUI (comfy/lora.py model_lora_keys_unet, Flux branch) maps ``transformer.{k}`` for every weight
    ``k`` of the diffusers Flux transformer (comfy/utils.py flux_to_diffusers) and reads ``{x}.lora_A.weight``/
    ``{x}.lora_B.weight`` (load_lora, "diffusers2" naming); CLIP-L LoRA as ``text_encoder.text_model.…``
    (model_lora_keys_clip's diffusers keys). Without ``.alpha`` keys the scale is 1: α/r is in lora_B."""
    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    ws, paths = flux
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=attn_mlp", "lora.rank=4",
                             "lora.alpha=2", "training.train_text_encoder=true"])
    model = load_tiny_fp32(ws, paths["diffusers"])
    weights = {k[:-len(".weight")] for k in model.transformer.state_dict() if k.endswith(".weight")}
    te_weights = {k[:-len(".weight")] for k in model.text_encoder.state_dict() if k.endswith(".weight")}
    method = LoraMethod(model, cfg)
    for m in method.modules.values():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(3))
    state = method.adapter_state_dict()
    for key in state:
        assert key.endswith((".lora_A.weight", ".lora_B.weight")), key
        x = key.rsplit(".lora_", 1)[0]
        if x.startswith("transformer."):
            assert x[len("transformer."):] in weights, key
        else:
            assert x.startswith("text_encoder.text_model.") and x[len("text_encoder."):].removeprefix("text_model.") \
                in te_weights, key
    assert any(".single_transformer_blocks.0.proj_mlp." in k for k in state)
    # the scale is baked in: lora_B in the file = trained lora_B × α/r
    layer = model.transformer.transformer_blocks[0].attn.to_q
    torch.testing.assert_close(state["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"],
                               layer.lora_B["default"].weight.detach() * 0.5)


def test_flux_variants_that_cannot_train_are_refused_and_chroma_is_named(flux, tmp_path):
    from safetensors.torch import load_file, save_file

    from trainer.config.checks import load_config
    from trainer.errors import ModelLoadError
    from trainer.families.sources import load_model
    ws, paths = flux
    bfl = load_file(str(paths["single_file"]))

    def error(path, *settings):
        with pytest.raises(ModelLoadError) as err:
            load_model(load_config(None, [f"model.path={path}", *settings]).model, str(ws))
        return str(err.value)
    fill = dict(bfl)
    fill["img_in.weight"] = torch.zeros(bfl["img_in.weight"].shape[0], 384)
    save_file(fill, str(tmp_path / "fill.safetensors"))
    assert "Flux.1 Fill" in error(tmp_path / "fill.safetensors")
    inpaint = tmp_path / "kontext-inpaint"  # Kontext itself trains (flux-kontext); its inpainting pipeline not
    shutil.copytree(paths["diffusers"], inpaint)
    index = json.loads((inpaint / "model_index.json").read_text())
    (inpaint / "model_index.json").write_text(json.dumps(dict(index, _class_name="FluxKontextInpaintPipeline")))
    assert "Kontext inpainting" in error(inpaint)
    chroma = dict(bfl, **{"distilled_guidance_layer.in_proj.weight": torch.zeros(2, 2)})
    save_file(chroma, str(tmp_path / "chroma.safetensors"))
    assert "Chroma" in error(tmp_path / "chroma.safetensors")
    schnell = {k: v for k, v in bfl.items() if not k.startswith("guidance_in.")}
    save_file(schnell, str(tmp_path / "schnell.safetensors"))
    m = load_tiny_fp32(ws, tmp_path / "schnell.safetensors", f"model.config_path={paths['diffusers']}")
    assert m.family == "flux-schnell" and m.objective.dynamic_shift is None


@pytest.mark.parametrize("setting, key", [("loss.min_snr_gamma=5", "loss.min_snr_gamma"),
                                          ("model.clip_skip=1", "model.clip_skip"),
                                          ("training.method=embedding", "training.method"),
                                          ("model.prediction_type=epsilon", "model.prediction_type")])
def test_validate_refuses_sd_settings_for_flux(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-flux", setting])
    assert err.value.key == key


def test_fp8_storage_trains_a_flux_lora(flux, tmp_path):
    """The 24 GB preset's memory setting: frozen transformer weights stored in fp8 (the family's fp8_skip
    keeps norms and embedders out), the LoRA trains and is saved."""
    from tests.conftest import train_quiet
    from trainer.events import read_events
    ws, _ = flux
    run = train_quiet(ws, "fp8", "demo-flux", "precision.fp8_unet=true", "training.max_steps=2", "sampling.prompts=[]")
    assert any(e["type"] == "finished" for e in read_events(run / "events.jsonl"))
    assert (run / "fp8.safetensors").is_file()
    import re
    layers = re.search(r"fp8 storage: (\d+) denoiser layers", (run / "train.log").read_text())
    assert layers and int(layers.group(1)) > 0


def test_nf4_base_trains_nearly_the_lora_of_the_full_precision_base(flux):
    """QLoRA-style: the frozen transformer's Linear weights stored as 4-bit NF4 (bitsandbytes on the CPU) and
    dequantized per layer; the same 16 steps give a LoRA close to the one trained on the fp32 base (NF4 rounds each
    weight by ~13 %), and the stored weights really are packed 4-bit."""
    import re

    from safetensors.torch import load_file

    from tests.conftest import train_quiet
    ws, _ = flux
    common = ("lora.unet_targets=attn_mlp", "training.max_steps=16", "sampling.prompts=[]")
    full = load_file(str(train_quiet(ws, "full", "demo-flux", *common) / "full.safetensors"))
    run = train_quiet(ws, "nf4", "demo-flux", "parts.denoiser.nf4=true", *common)
    nf4 = load_file(str(run / "nf4.safetensors"))
    layers = re.search(r"NF4 storage: (\d+) denoiser layers", (run / "train.log").read_text())
    assert layers and int(layers.group(1)) >= 10
    ups = [k for k in full if "lora_B" in k]
    moved = sum(float((full[k] ** 2).sum()) for k in ups) ** 0.5
    apart = sum(float(((full[k] - nf4[k]) ** 2).sum()) for k in ups) ** 0.5
    assert moved > 0.05 and apart < 0.35 * moved, (moved, apart)
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.memory.precision import enable_nf4_storage
    model = load_model(load_config(None, ["model.path=builtin:tiny-flux"]), str(ws))
    count = enable_nf4_storage(model.transformer, torch.float32, model.fp8_skip)
    packed = [m for m in model.transformer.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.uint8]
    assert len(packed) == count >= 10
    for m in packed:  # two 4-bit weights a byte: an eighth of the fp32 bytes (the block statistics aside)
        assert m.weight.numel() * 2 == m.in_features * m.out_features
    t = model.transformer  # the blocks' modulation Linears are packed (6 GiB in bf16 at full size); the final one not
    assert t.transformer_blocks[0].norm1.linear.weight.dtype == torch.uint8
    assert t.single_transformer_blocks[0].norm.linear.weight.dtype == torch.uint8
    assert t.norm_out.linear.weight.dtype != torch.uint8


@pytest.mark.parametrize("setting, words, key", [("training.method=finetune", "fine-tune", "parts.denoiser.nf4"),
                                                 ("parts.denoiser.fp8=true", "both on", "parts.denoiser.nf4"),
                                                 # DoRA is refused on Flux whatever the storage (its LoRA layout)
                                                 ("lora.type=dora", "DoRA", "lora.type")])
def test_nf4_is_refused_where_it_cannot_work(setting, words, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, ["model.path=builtin:tiny-flux", "parts.denoiser.nf4=true", setting])
    assert err.value.key == key


@pytest.mark.parametrize("settings, key, words", [
    (["parts.text_encoder_1.enabled=false"], "parts.text_encoder_1.enabled", "cannot do without its CLIP-L"),
    (["parts.text_encoder_2.enabled=false", "parts.text_encoder_2.train=true"], "parts.text_encoder_2.enabled",
     "cannot train"),
])
def test_only_t5_can_be_switched_off(settings, key, words):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-flux", *settings])
    assert err.value.key == key and words in str(err.value)
    with pytest.raises(ConfigError, match="cannot do without its CLIP text encoder"):
        load_config(None, ["model.path=builtin:tiny-sd", "parts.text_encoder_1.enabled=false"])


def test_t5_off_trains_and_samples_on_clip_alone_and_refuses_captions_clip_would_cut(flux, tmp_path):
    """parts.text_encoder_2.enabled = false: T5 sees only the empty caption (training and samples, through the
    pipeline's prompt_2); a caption longer than CLIP's 77 tokens is refused, naming the file."""
    from tests.conftest import DEMO_DATA, train_quiet
    from trainer.__main__ import main as cli
    from trainer.config.checks import load_config
    from trainer.families.sources import ModelSettings
    from trainer.events import read_events
    from trainer.families.sources import load_model
    ws, paths = flux
    off = "parts.text_encoder_2.enabled=false"
    m = load_model(load_config(None, [f"model.path={paths['diffusers']}", off]), str(ws))
    assert m.sampling_kwargs()["prompt_2"] == ""
    assert "prompt_2" not in load_tiny_fp32(ws, paths["diffusers"]).sampling_kwargs()
    assert ModelSettings(load_config(None, [off])).disabled == {"text_encoder_2"}
    run = train_quiet(ws, "t5off", "demo-flux", off, "training.max_steps=2")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished" and any(e["type"] == "sample" for e in events)
    data = tmp_path / "long"
    shutil.copytree(DEMO_DATA, data)
    first = sorted(data.glob("*.txt"))[0]
    first.write_text(" ".join(["a red square on a blue ground"] * 20), encoding="utf-8")
    rc = cli(["train", "--preset", "demo-flux", "--no-progress", "--set", f"general.workspace={ws}",
              "--set", "general.run_name=t5long", "--set", off, "--set", f"data.concepts.0.path={data}"])
    assert rc == 1
    failed = read_events(ws / "runs" / "t5long" / "events.jsonl")[-1]
    assert failed["type"] == "failed" and "parts.text_encoder_2.enabled" in failed["message"]
    assert first.with_suffix(".png").name in failed["message"] and "77 tokens" in failed["message"]


def test_lora_blocks_put_adapters_only_in_the_chosen_blocks(flux):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    from trainer.methods.lora import LoraMethod
    from trainer.families.sources import load_model
    ws, _ = flux

    def adapted(spec):
        cfg = load_config(None, ["model.path=builtin:tiny-flux", "lora.unet_targets=attn_mlp",
                                 f"parts.denoiser.lora_blocks={spec}"])
        return {k.split(".lora_", 1)[0] for k in LoraMethod(load_model(cfg, str(ws)), cfg).adapter_state_dict()}

    single = adapted("single_transformer_blocks:0")
    assert single and all(k.startswith("transformer.single_transformer_blocks.0.") for k in single)
    both = adapted("0")
    assert {k.split(".")[1] for k in both} == {"transformer_blocks", "single_transformer_blocks"}
    with pytest.raises(ConfigError, match=r"block lists: transformer_blocks \(0-0\)") as err:
        adapted("5-9")
    assert err.value.key == "parts.denoiser.lora_blocks"
    with pytest.raises(ConfigError, match="ends before it starts"):
        load_config(None, ["model.path=builtin:tiny-flux", "parts.denoiser.lora_blocks=3-1"])


# --- FLUX.1 Kontext [dev]: edit pairs ---------------------------------------------------------------------

def _edit_pair(root, name="cat", size=(96, 64), caption="make it blue"):
    """targets/<name>.png (the edited image, its caption the instruction) and control/<name>.png (its source)."""
    from PIL import Image, ImageDraw
    for folder, colour in (("targets", (20, 40, 220)), ("control", (220, 40, 20))):
        img = Image.new("RGB", size, (250, 250, 250))
        draw = ImageDraw.Draw(img)
        draw.rectangle([4, 4, size[0] // 2, size[1] // 2], fill=colour)  # off-centre: a swapped axis shows
        draw.ellipse([size[0] - 24, size[1] - 20, size[0] - 4, size[1] - 4], fill=(10, 160, 30))
        (root / folder).mkdir(parents=True, exist_ok=True)
        img.save(root / folder / f"{name}.png")
    (root / "targets" / f"{name}.txt").write_text(caption)
    return root / "targets", root / "control"


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("kontext-ws")
    return ws, build_tiny("tiny-flux-kontext", ws / "models")


def _transformer_calls(model):
    """Record every call's keyword inputs and output of ``model.transformer``; returns (calls, remove)."""
    calls = []

    def pre(module, args, kwargs):
        calls.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})

    def post(module, args, kwargs, out):
        calls[-1]["out"] = out[0].detach().clone()

    handles = [model.transformer.register_forward_pre_hook(pre, with_kwargs=True),
               model.transformer.register_forward_hook(post, with_kwargs=True)]
    return calls, lambda: [h.remove() for h in handles]


def test_kontext_transformer_inputs_are_those_flux_kontext_pipeline_builds(kontext, tmp_path):
    """One pair through the data pipeline (the control cached as its VAE posterior) and the family, against
    FluxKontextPipeline given the same control image, latents and instruction: the same packed sequence (target
    tokens, then the control's), the same ids (the control's first coordinate 1), text, guidance and timestep, and
    the same prediction once cut back to the target's tokens. A 96×64 pair, so a swapped axis would show."""
    from omegaconf import OmegaConf
    from PIL import Image

    from trainer.config.schema import AtelierConfig
    from trainer.data.pipeline import DataPipeline
    ws, paths = kontext
    model = load_tiny_fp32(ws, paths["diffusers"])
    assert model.family == "flux-kontext" and type(model.pipeline(None).pipe).__name__ == "FluxKontextPipeline"
    targets, control = _edit_pair(tmp_path)
    cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig), {
        "general": {"workspace": str(tmp_path), "seed": 1, "dataloader_workers": 0},
        "data": {"resolution": "96x64", "bucket_step": 16, "random_flip": False, "cache_dir": str(tmp_path / "c"),
                 "concepts": [{"path": str(targets), "control_paths": [str(control)]}]}})
    data = DataPipeline(cfg, warn=lambda m: None)
    data.prepare(model.encode_pixels, model.fingerprint(), "fp32")
    _, batch = next(data.iter_batches(0, 0, 1))
    assert batch["control_latents"][0]["mean"].shape[-2:] == (32, 48)  # the tiny VAE halves: 96×64 → 48×32

    pipe = model.pipeline(None)
    noise = torch.randn(1, 16, 32, 48, generator=torch.Generator().manual_seed(0))
    calls, remove = _transformer_calls(model)
    with torch.no_grad():
        pipe(prompt="make it blue", image=Image.open(control / "cat.png").convert("RGB"), width=96, height=64,
             max_area=96 * 64, _auto_resize=False, latents=pipe._pack_latents(noise, 1, 16, 32, 48),
             num_inference_steps=3, guidance_scale=model.guidance, max_sequence_length=model.max_sequence_length,
             output_type="latent")
    ref = calls[1]  # the second step: latents the sampler moved, a shifted σ below 1
    tokens = 16 * 24
    assert ref["hidden_states"].shape[1] == 2 * tokens and 0 < float(ref["timestep"][0]) < 1
    noisy = pipe._unpack_latents(ref["hidden_states"][:, :tokens], 64, 96, model.vae_scale_factor)
    calls.clear()
    with torch.no_grad():
        cond = model.batch_condition(batch, lambda c: c, set())
        pred = model.predict(noisy, ref["timestep"], cond)
    remove()
    ours = calls[0]
    torch.testing.assert_close(ours["hidden_states"][:, :tokens], ref["hidden_states"][:, :tokens])
    # the control tokens: the same pixels (torch.equal), but the pipeline's preprocessed image is channels-last,
    # so the VAE's convolutions take another kernel: ~1e-4 apart
    torch.testing.assert_close(ours["hidden_states"][:, tokens:], ref["hidden_states"][:, tokens:],
                               rtol=1e-3, atol=5e-4)
    torch.testing.assert_close(ours["img_ids"], ref["img_ids"], rtol=0, atol=0)
    assert ours["img_ids"][:tokens, 0].eq(0).all() and ours["img_ids"][tokens:, 0].eq(1).all()
    assert ours["img_ids"][tokens:, 1:].max(0).values.tolist() == [15, 23]  # the control's own 16×24 grid
    for key in ("txt_ids", "encoder_hidden_states", "pooled_projections", "guidance", "timestep"):
        torch.testing.assert_close(ours[key], ref[key].to(ours[key].dtype), msg=key)
    expected = pipe._unpack_latents(ref["out"][:, :tokens], 64, 96, model.vae_scale_factor)
    torch.testing.assert_close(pred, expected, rtol=1e-3, atol=5e-4)


def test_kontext_samples_edit_their_control_image_at_the_sample_size(kontext, tmp_path):
    """prompt_kwargs gives the pipeline the sample's control image fitted to width × height (as training's controls
    had their target's size), that area as max_area and no resize to Kontext's ~1 MP sizes: the sample comes out at
    the size asked (the pipeline's default max_area would draw it at 1024²)."""
    from types import SimpleNamespace
    ws, paths = kontext
    model = load_tiny_fp32(ws, paths["diffusers"])
    _, control = _edit_pair(tmp_path, size=(90, 70))
    prompt = SimpleNamespace(prompt="make it blue", width=96, height=64, control_images=[str(control / "cat.png")])
    kw = model.prompt_kwargs(prompt)
    assert kw["image"].size == (96, 64) and kw["max_area"] == 96 * 64 and kw["_auto_resize"] is False
    image = model.pipeline(None)("make it blue", width=96, height=64, num_inference_steps=1,
                                 generator=torch.Generator().manual_seed(0), **kw).images[0]
    assert image.size == (96, 64)
    assert load_tiny_fp32(*flux_paths(ws)).prompt_kwargs(prompt) == {}  # text-to-image Flux takes no image
    with pytest.raises(ValueError, match="control_paths"):  # a batch without its control image is named
        model.batch_condition({"captions": ["make it blue"]}, lambda c: c, set())


def flux_paths(ws):
    from trainer.families import build_tiny
    return ws, build_tiny("tiny-flux", ws / "models")["diffusers"]


def test_kontext_is_told_by_its_pipeline_and_a_single_file_needs_model_family(kontext, tmp_path):
    """A FluxKontextPipeline folder is flux-kontext; its single file has dev's keys (ComfyUI cannot tell them apart
    either) and loads as Kontext only with model.family: flux-kontext, and validate says so when control folders meet
    a file read as dev. A file that is not a Flux.1 [dev] transformer is refused under flux-kontext, naming what it
    is; so is a Kontext folder under model.family: flux-dev."""
    from safetensors.torch import load_file, save_file

    from trainer.config.checks import load_config
    from trainer.config.load import compose
    from trainer.errors import ConfigError, ModelLoadError
    from trainer.families import build_tiny
    from trainer.families.checks import family_without_loading
    from trainer.families.sources import load_model
    ws, paths = kontext
    rest = f"model.config_path={paths['diffusers']}"
    assert family_without_loading(load_config(None, ["model.path=builtin:tiny-flux-kontext"]).model) == "flux-kontext"
    assert family_without_loading(load_config(None, [f"model.path={paths['diffusers']}"]).model) == "flux-kontext"
    assert load_tiny_fp32(ws, paths["single_file"], rest).family == "flux-dev"
    assert load_tiny_fp32(ws, paths["single_file"], rest, "model.family=flux-kontext").family == "flux-kontext"
    dev_keys = set(load_file(str(build_tiny("tiny-flux", ws / "models")["single_file"])))
    assert set(load_file(str(paths["single_file"]))) == dev_keys

    targets, control = _edit_pair(tmp_path / "pairs")
    pairs = f"data.concepts=[{{path: {targets}, control_paths: [{control}]}}]"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={paths['single_file']}", rest, pairs])
    assert err.value.key == "data.concepts.0.control_paths" and "model.family: flux-kontext" in str(err.value)

    def error(path, *settings):  # the loader's own check (validate's is tried below)
        with pytest.raises(ModelLoadError) as err:
            load_model(compose(None, [f"model.path={path}", *settings]).model, str(ws))
        return err.value
    sd = build_tiny("tiny-sd", ws / "models")["single_file"]
    assert "Stable Diffusion" in str(error(sd, "model.family=flux-kontext"))
    with pytest.raises(ConfigError, match="holds a Stable Diffusion 1.x/2.x model") as told:  # before any load
        load_config(None, [f"model.path={sd}", "model.family=flux-kontext"])
    assert told.value.key == "model.family"
    bfl = load_file(str(paths["single_file"]))
    schnell = tmp_path / "schnell.safetensors"
    save_file({k: v for k, v in bfl.items() if not k.startswith("guidance_in.")}, str(schnell))
    assert "not FLUX.1 Kontext [dev]" in str(error(schnell, rest, "model.family=flux-kontext"))
    garbage = tmp_path / "garbage.safetensors"
    save_file({"encoder.down.0.weight": torch.zeros(2, 2)}, str(garbage))
    assert error(garbage, "model.family=flux-kontext").key == "model.path"
    wrong = error(paths["diffusers"], "model.family=flux-dev")
    assert wrong.key == "model.family" and "flux-kontext" in str(wrong)


@pytest.mark.parametrize("settings, key, words", [
    (["data.concepts=[{path: presets/demo-data}]"], "data.concepts.0.control_paths", "learns from pairs"),
    (["sampling.prompts=[{prompt: make it blue}]"], "sampling.prompts.0.control_images", "give the sample 1 image"),
    (["data.concepts=[{path: presets/demo-data, control_paths: [a, b]}]"], "data.concepts.0.control_paths",
     "at most 1"),
])
def test_validate_refuses_a_kontext_run_without_its_control_images(settings, key, words):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-flux-kontext", "sampling.prompts=[]", *settings])
    assert err.value.key == key and words in str(err.value), str(err.value)


@pytest.mark.slow
def test_a_lora_trained_on_pairs_loads_in_flux_kontext_pipeline_and_changes_its_edit(kontext, tmp_path, peft_strict):
    """A few steps on pairs through the CLI, with a sample that edits a control image: the run samples, and its
    LoRA loads in diffusers' FluxKontextPipeline (every key) and changes the edit it draws."""
    from PIL import Image

    from tests.conftest import train_quiet
    from trainer.events import read_events
    ws, paths = kontext
    targets, control = _edit_pair(tmp_path / "pairs")
    _edit_pair(tmp_path / "pairs", name="dog", caption="make the square blue")
    sample = f"{{prompt: make it blue, control_images: [{control / 'cat.png'}], steps: 2, width: 96, height: 64}}"
    run = train_quiet(ws, "pairs", "demo-flux", "model.path=builtin:tiny-flux-kontext", "training.max_steps=4",
                      "training.learning_rate=0.01", "data.resolution=96x64", "data.bucket_step=16",
                      f"data.concepts=[{{path: {targets}, control_paths: [{control}]}}]",
                      f"sampling.prompts=[{sample}]")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished" and any(e["type"] == "sample" for e in events)
    pipe = load_tiny_fp32(ws, paths["diffusers"]).pipeline(None)

    def edit():
        return pipe("make it blue", image=Image.open(control / "cat.png").convert("RGB"), width=96, height=64,
                    max_area=96 * 64, _auto_resize=False, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]
    before = edit()
    pipe.load_lora_weights(str(run / "pairs.safetensors"))
    assert abs(edit() - before).max() > 1e-3


@pytest.mark.parametrize("fixture", ["flux", "kontext"])
def test_the_transformer_sees_sigma_and_guidance_in_fp32_as_diffusers_flux_trainer_passes_them(fixture, request):
    """diffusers' train_dreambooth_lora_flux.py passes ``timesteps / 1000`` of its fp32 schedule and an fp32 guidance
    (FluxPipeline: the guidance in fp32); a bf16 σ would be 0.9375 for 0.93796 before the model saw it."""
    ws, paths = request.getfixturevalue(fixture)
    model = load_tiny(ws, paths["diffusers"], "parts.denoiser.dtype=bf16")
    assert next(model.transformer.parameters()).dtype == torch.bfloat16
    batch = {"captions": ["a red square"]}
    if fixture == "kontext":
        batch["control_latents"] = [{"mean": torch.zeros(1, 16, 8, 12)}]
    cond = model.batch_condition(batch, lambda c: c, set())
    seen = transformer_inputs(model, torch.zeros(1, 16, 8, 12, dtype=torch.bfloat16), torch.tensor([0.93796]), cond)
    assert seen["timestep"].dtype == torch.float32 and seen["timestep"].item() == pytest.approx(0.93796, abs=1e-7)
    assert seen["guidance"].dtype == torch.float32


def test_flux_dev_trains_at_model_guidance_scale_as_flux_pipeline_feeds_it(flux):
    """FluxPipeline's second denoising call at ``guidance_scale`` g and ``predict`` on the same noisy latents and σ,
    with ``model.guidance_scale`` = g: the same guidance (fp32), packed tokens, ids, text and timestep, and the same
    prediction; a 96×64 image (latents 32×48), so a swapped axis would show. The default is 3.5, diffusers' and
    kohya's ``--guidance_scale`` default."""
    ws, paths = flux
    assert load_tiny_fp32(ws, paths["diffusers"]).guidance == 3.5
    model = load_tiny_fp32(ws, paths["diffusers"], "model.guidance_scale=2.5")
    assert model.family == "flux-dev" and model.guidance == 2.5
    pipe = model.pipeline(None)
    noise = torch.randn(1, 16, 32, 48, generator=torch.Generator().manual_seed(0))
    calls, remove = _transformer_calls(model)
    with torch.no_grad():
        pipe(prompt="a red square", width=96, height=64, latents=pipe._pack_latents(noise, 1, 16, 32, 48),
             num_inference_steps=2, guidance_scale=2.5, max_sequence_length=model.max_sequence_length,
             output_type="latent")
    ref = calls[1]  # the second step: a shifted σ below 1
    assert ref["guidance"].tolist() == [2.5] and 0 < float(ref["timestep"][0]) < 1
    noisy = pipe._unpack_latents(ref["hidden_states"], 64, 96, model.vae_scale_factor)
    calls.clear()
    with torch.no_grad():
        cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
        pred = model.predict(noisy, ref["timestep"], cond)
    remove()
    ours = calls[0]
    assert ours["guidance"].dtype == torch.float32 and ours["guidance"].tolist() == [2.5]
    for key in ("hidden_states", "img_ids", "txt_ids", "encoder_hidden_states", "pooled_projections", "timestep"):
        torch.testing.assert_close(ours[key], ref[key].to(ours[key].dtype), msg=key)
    torch.testing.assert_close(pred, pipe._unpack_latents(ref["out"], 64, 96, model.vae_scale_factor))


def test_validate_says_guidance_scale_is_ignored_without_a_guidance_embedding():
    from trainer.config.checks import cross_field_warnings, load_config

    def warned(path, *settings):
        cfg = load_config(None, [f"model.path={path}", *settings])
        return [i.message for i in cross_field_warnings(cfg) if i.key == "model.guidance_scale"]

    for path in ("builtin:tiny-flux-schnell", "builtin:tiny-chroma", "builtin:tiny-flux2-klein", "builtin:tiny-sd"):
        assert warned(path) == []  # the default is no one's concern
        (message,) = warned(path, "model.guidance_scale=1")
        assert "no guidance embedding" in message and "ignores it" in message
    for path in ("builtin:tiny-flux", "builtin:tiny-flux-kontext", "builtin:tiny-flux2-dev"):
        assert warned(path, "model.guidance_scale=1") == []


def _loss(**settings):
    """The default ``loss`` section with ``settings``, as the loop hands it to the objective."""
    from omegaconf import OmegaConf

    from trainer.config.schema import AtelierConfig
    lc = OmegaConf.structured(AtelierConfig).loss
    for k, v in settings.items():
        OmegaConf.update(lc, k, v)
    return lc


def _quantiles_match(ours, anchor, tol=0.015):
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(float(ours.quantile(q)) - float(anchor.quantile(q))) < tol, q


def test_training_sigma_is_drawn_as_diffusers_flux_trainer_draws_it_and_kohyas_on_request(flux):
    """Default: train_dreambooth_lora_flux.py (huggingface/diffusers 58eb52c0, ``--weighting_scheme none``):
    ``u = compute_density_for_timestep_sampling("none")`` (uniform), ``indices = (u · 1000).long()``,
    ``timesteps = noise_scheduler_copy.timesteps[indices]``, σ = the scheduler's σ at those indices — the scheduler
    from the model's config, which leaves σ unshifted under ``use_dynamic_shifting`` (dev): median 0.50 at every size.
    kohya's sd-scripts (library/flux_train_utils.py at 48d368fa) on request: its default ``--timestep_sampling sigma``
    draws the same uniform u over its scheduler built with ``--discrete_flow_shift`` 3.0 (loss.flow_shift=3), and its
    documented ``flux_shift``, ``sigmoid(N(0, 1))`` shifted by μ = lin(256 → 0.5, 4096 → 1.15) of (h/2)·(w/2)
    tokens, ``e^μ / (e^μ + 1/σ − 1)`` (loss.timestep_distribution=logit_normal, loss.resolution_shift=true)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    ws, paths = flux
    model = load_tiny_fp32(ws, paths["diffusers"])
    assert model.family == "flux-dev" and model._sched_config["use_dynamic_shifting"]
    n = 20000
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=gen)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(model._sched_config)
    diffusers_draw = scheduler.sigmas[(u * 1000).long()]
    kohya_default = 3 * (1 - (u * 1000).long() / 1000) / (1 + 2 * (1 - (u * 1000).long() / 1000))
    logits = torch.sigmoid(torch.randn(n, generator=gen))
    for side in (128, 32):  # 1024² px and 256² px for the released VAE
        latents = torch.zeros(1, 16, side, side).expand(n, -1, -1, -1)

        def ours(**settings):
            return model.objective.sample_timesteps(n, _loss(**settings), torch.Generator().manual_seed(1), latents)
        _quantiles_match(ours(), diffusers_draw)
        _quantiles_match(ours(**{"flow_shift": 3.0}), kohya_default)
        mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * ((side // 2) * (side // 2) - 256)
        flux_shift = math.exp(mu) / (math.exp(mu) + (1 / logits - 1))
        _quantiles_match(ours(**{"timestep_distribution": "logit_normal", "resolution_shift": True}), flux_shift)
    assert float(diffusers_draw.median()) == pytest.approx(0.5, abs=0.01)
