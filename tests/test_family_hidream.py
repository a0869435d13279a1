"""HiDream-I1 beyond the family contract: the transformer call the pipeline makes (four encoders, CFG's negative
prompt, non-square latents padded to max_seq, the training-mode output still in patches), each encoder's dropout and
switch, the single file back and forth, detection of the three variants, and the LoRA file's keys as ComfyUI maps
them."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTION = "a red square on a white background"


@pytest.fixture(scope="module")
def hidream(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("hidream-ws")
    paths = build_tiny("tiny-hidream", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_predict_is_the_pipelines_transformer_call_with_cfg_and_a_non_square_image(hidream):
    """The pipeline's second step with CFG: its batch is [negative "", prompt]; caption dropout on all four encoders
    gives the negative row. 24×16 px at the tiny model's 32² px area: the latents are 6×8, padded to max_seq."""
    ws, paths, model = hidream
    pipe = model.pipeline(None)
    pipe.default_sample_size = 8  # 16² px: the pipeline rescales 24×16 to 16×12 (latents 6×8)
    latents = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe(CAPTION, height=16, width=24, latents=latents, num_inference_steps=2, guidance_scale=2.0,
                 output_type="latent", **model.sampling_kwargs())
            ref = calls[1]
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timesteps"], (sigma * 1000).expand(2))
            drop = [True, False]
            cond = model.batch_condition({"captions": [CAPTION, CAPTION]}, lambda c: c, set(), drop_te1=drop,
                                         drop_te2=drop, drop_te3=drop, drop_te4=drop)
            pred = model.predict(ref["kwargs"]["hidden_states"], sigma.expand(2), cond)
            model.transformer.train()  # the routed experts' training path, its output in patches
            try:
                trained = model.predict(ref["kwargs"]["hidden_states"], sigma.expand(2), cond)
            finally:
                model.transformer.eval()
    finally:
        remove()
    torch.testing.assert_close(pred, -ref["out"])
    torch.testing.assert_close(trained, -ref["out"])


def test_each_encoder_drops_alone_and_a_switched_off_one_reads_the_empty_caption(hidream):
    ws, paths, model = hidream
    full = model.batch_condition({"captions": [CAPTION]}, lambda c: c, set())
    empty = model.encode_captions([""])
    only_llama = model.batch_condition({"captions": [CAPTION]}, lambda c: c, set(), drop_te4=[True])
    torch.testing.assert_close(only_llama.llama, empty["llama"])
    assert torch.equal(only_llama.t5, full.t5) and torch.equal(only_llama.pooled, full.pooled)
    only_clip_g = model.batch_condition({"captions": [CAPTION]}, lambda c: c, set(), drop_te2=[True])
    width = model.text_encoder.config.projection_dim
    assert torch.equal(only_clip_g.pooled[:, :width], full.pooled[:, :width])
    torch.testing.assert_close(only_clip_g.pooled[:, width:], empty["clip_g_pooled"])
    # the released model's Llama: 19 of its 32 layers are read by some block, and only those are kept
    from trainer.families.hidream.keys import CONFIG
    assert len(set(CONFIG["llama_layers"])) == 19 and len(CONFIG["llama_layers"]) == 48
    assert full.llama.shape[1] == len(model.llama_used) == 2

    # T5 and Llama switched off: training drops them always, and the samples' pipeline encodes "" for them
    off = load_tiny(ws, paths["diffusers"], "parts.text_encoder_3.enabled=false", "parts.text_encoder_4.enabled=false")
    assert off.disabled == {"text_encoder_3", "text_encoder_4"}
    t5, _, llama, _, pooled, _ = off.pipeline(None).encode_prompt(CAPTION, do_classifier_free_guidance=True,
                                                                  device="cpu", max_sequence_length=128)
    torch.testing.assert_close(t5, empty["t5"])
    torch.testing.assert_close(llama[off.llama_used].transpose(0, 1), empty["llama"])
    torch.testing.assert_close(pooled, full.pooled)


def test_single_file_loads_and_fine_tunes_save_back_to_it(hidream, tmp_path):
    from safetensors.torch import load_file
    ws, paths, model = hidream
    single = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    assert single.family == "hidream-full"  # a file says nothing of its variant: full unless model.family says
    dev = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}", "model.family=hidream-dev")
    assert dev.family == "hidream-dev" and dev.sample_defaults().steps == 28
    for k, v in model.transformer.state_dict().items():
        torch.testing.assert_close(single.transformer.state_dict()[k], v, msg=k)
    out = tmp_path / "hidream-ft.safetensors"
    single.save_single_file(out, "fp32", {})
    saved = load_file(str(out))
    assert set(saved) == set(load_file(str(paths["single_file"])))
    assert "model.diffusion_model.double_stream_blocks.0.block.ff_i.gate.weight" in saved
    from diffusers import HiDreamImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_hidream_transformer_to_diffusers
    assert set(convert_hidream_transformer_to_diffusers(dict(saved))) == \
        set(HiDreamImageTransformer2DModel.from_config(model.transformer.config).state_dict())


def test_detection_names_the_variant_and_refuses_the_editing_model():
    from trainer.families import Evidence, claim
    from trainer.families.hidream.detect import variant_of

    def hub(where, index, scheduler=None):
        files = {"model_index.json": index, "scheduler/scheduler_config.json": scheduler}
        return Evidence("hub", where, read_json=lambda rel: files.get(rel))
    index = {"_class_name": "HiDreamImagePipeline"}
    assert claim(hub("HiDream-ai/HiDream-I1-Dev", index)) == "hidream-dev"
    assert claim(hub("HiDream-ai/HiDream-I1-Fast", index)) == "hidream-fast"
    assert claim(hub("HiDream-ai/HiDream-I1-Full", index)) == "hidream-full"
    euler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 6.0}
    assert claim(hub("me/my-hidream", index, euler)) == "hidream-dev"
    assert variant_of("me/x", {**euler, "shift": 3.0}) == "hidream-fast"
    assert variant_of("me/x", {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0}) == "hidream-full"
    with pytest.raises(ValueError, match="HiDream-E1"):
        claim(hub("HiDream-ai/HiDream-E1-Full", {"_class_name": "HiDreamImageEditingPipeline"}))


def test_the_lora_file_names_modules_comfyui_maps(hidream, tmp_path):
    """ComfyUI (comfy/lora.py, model_lora_keys_unet for its HiDream model) maps ``transformer.<module>`` to the
    original file's ``diffusion_model.<module>.weight``: every module the file adapts must be one of those."""
    from safetensors.torch import load_file
    from trainer.config.checks import load_config
    from trainer.families.sources import load_model
    from trainer.methods.lora import LoraMethod
    ws, paths, _ = hidream
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "lora.unet_targets=all", "lora.rank=2",
                             f"general.workspace={ws}"])
    method = LoraMethod(load_model(cfg, str(ws), "cpu"), cfg)
    state = method.model.lora_state_dict(method.modules)
    comfy = {k.removeprefix("model.diffusion_model.").removesuffix(".weight")
             for k in load_file(str(paths["single_file"])) if k.endswith(".weight")}
    modules = {k.rsplit(".lora_", 1)[0] for k in state}
    assert modules and all(m.startswith("transformer.") for m in modules)
    assert {m.removeprefix("transformer.") for m in modules} <= comfy
    assert any(".ff_i.experts.3.w2" in m for m in modules) and any(".adaLN_modulation.1" in m for m in modules)


def test_the_cache_keeps_llama_and_t5_in_the_dtype_they_come_out_in(hidream):
    """Llama's 19 layers (~40 MB a caption in fp32) from a bf16 encoder stay bf16 in the cache; the step casts them to
    its compute dtype, so the prediction is the one of the same features widened to fp32."""
    ws, paths, _ = hidream
    model = load_tiny(ws, paths["diffusers"], "parts.text_encoder_4.dtype=bf16", "parts.text_encoder_3.dtype=bf16")
    entry = model.encode_captions([CAPTION])
    assert entry["llama"].dtype == entry["t5"].dtype == torch.bfloat16
    assert entry["clip_l_pooled"].dtype == torch.float32
    widened = {k: v.float() for k, v in entry.items()}
    x, sigma = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5])
    with torch.no_grad():
        preds = [model.predict(x, sigma, model.batch_condition(dict(e), lambda c: c, set())) for e in (entry, widened)]
    assert torch.equal(preds[0], preds[1])


def test_the_routed_experts_train_as_diffusers_with_one_device_read_per_feed_forward(hidream):
    """The routed feed-forwards' training path with the rows sorted by expert: the output and every gradient equal
    diffusers' boolean-index path bit for bit (bf16 autocast, as training runs), and the row counts are read from the
    device once (diffusers' path reads twice per expert, 8 for HiDream's four, inside torch's boolean indexing: the
    step's tally in tests/test_step_syncs.py counts those)."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from trainer.families.hidream.moe import SortedMoE

    ws, paths, model = hidream
    moes = [m for m in model.transformer.modules() if isinstance(m, MOEFeedForwardSwiGLU)]
    assert moes and all(type(m) is SortedMoE for m in moes)
    moe = moes[0]
    x = torch.randn(2, 40, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    reads = {"sorted": 0, "diffusers": 0}  # host reads through Tensor.tolist
    results = {}
    frozen = [p for p in moe.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    for name, forward in (("sorted", SortedMoE.forward), ("diffusers", MOEFeedForwardSwiGLU.forward)):
        moe.train()
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        original = torch.Tensor.tolist

        def counted(t, name=name):
            reads[name] += 1
            return original(t)

        with torch.autocast("cpu", dtype=torch.bfloat16):
            try:
                torch.Tensor.tolist = counted
                y = forward(moe, xi)
            finally:
                torch.Tensor.tolist = original
                moe.eval()
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        results[name] = (y.detach(), xi.grad, {n: p.grad for n, p in moe.named_parameters() if p.grad is not None})
    for p in frozen:
        p.requires_grad_(False)
        p.grad = None
    (ys, xs, gs), (yd, xd, gd) = results["sorted"], results["diffusers"]
    assert torch.equal(ys, yd) and torch.equal(xs, xd)
    assert gs.keys() == gd.keys() and any(n.startswith("experts.") for n in gs)
    assert all(torch.equal(gs[n], gd[n]) for n in gs)
    assert reads == {"sorted": 1, "diffusers": 0}  # the experts' row counts, once
