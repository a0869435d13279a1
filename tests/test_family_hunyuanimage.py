"""HunyuanImage 2.1 beyond the family contract: the pipeline's own text features (Qwen2.5-VL and the ByT5 glyph path)
and their dropout, the transformer call the pipeline makes, the original single file back and forth, detection of the
base and refusal of the distilled model and the refiner, and cfg_scale reaching the guider."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import denoiser_calls, load_tiny, transformer_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("hunyuan-ws")
    paths = build_tiny("tiny-hunyuan-image", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_glyphs_and_dropout_are_the_pipelines(hunyuan):
    ws, paths, model = hunyuan
    caption = 'a sign that says "HI" on a white background'
    pipe = model.pipeline(None)
    e, m, e2, m2 = pipe.encode_prompt(caption, device="cpu")
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    torch.testing.assert_close(cond.embeds, e)
    assert torch.equal(cond.mask, m.bool()) and not bool(m.all())  # padded to the tokenizer's length
    torch.testing.assert_close(cond.embeds_2, e2)
    assert torch.equal(cond.mask_2, m2.bool()) and bool(m2.any())  # the quoted text went through ByT5
    # dropping both gives the empty caption's features and no glyphs (the pipeline's negative prompt "")
    ne, nm, ne2, nm2 = pipe.encode_prompt("", device="cpu")
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te1=[True], drop_te2=[True])
    assert torch.equal(dropped.mask, nm.bool())  # its real tokens (the padding the masks leave out is not kept)
    torch.testing.assert_close(dropped.embeds[dropped.mask], ne[nm.bool()])
    assert not bool(dropped.embeds_2.any()) and not bool(dropped.mask_2.any()) and not bool(nm2.any())


def test_predict_is_the_pipelines_transformer_call_and_cfg_scale_is_the_guiders(hunyuan):
    ws, paths, model = hunyuan
    pipe = model.pipeline(None)
    h, w = 4, 6  # non-square: a swapped axis would show
    latents = torch.randn(1, 8, h, w, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    caption = 'a red square "OK"'
    try:
        with torch.no_grad():
            pipe(caption, height=h * 4, width=w * 4, latents=latents, num_inference_steps=2, guidance_scale=2.0,
                 output_type="latent")
            assert pipe.guider.guidance_scale == 2.0
            ref = calls[2]  # the second step's conditional call (the guider runs cond, then uncond)
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["kwargs"]["timestep"], sigma * 1000)
            cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
            pred = model.predict(ref["kwargs"]["hidden_states"], sigma, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
    # the same prediction from the captions' real tokens alone: the pipeline pads to 1000 and 128 tokens
    seen = transformer_inputs(model, ref["kwargs"]["hidden_states"], sigma, cond)["encoder_hidden_states"]
    for ours, key, mask in ((seen.embeds, "encoder_hidden_states", cond.mask),
                            (seen.embeds_2, "encoder_hidden_states_2", cond.mask_2)):
        assert ours.shape[1] == int(mask.sum()) < ref["kwargs"][key].shape[1]
        torch.testing.assert_close(ours, ref["kwargs"][key][:, :int(mask.sum())])
    # gradient checkpointing (diffusers' own function refuses the blocks' keyword arguments): same output, gradients
    model.transformer.enable_gradient_checkpointing()
    try:
        x = ref["kwargs"]["hidden_states"].clone().requires_grad_(True)
        with torch.enable_grad():
            again = model.predict(x, sigma, cond)
            again.sum().backward()
    finally:
        model.transformer.disable_gradient_checkpointing()
    torch.testing.assert_close(again.detach(), ref["out"])
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


def test_the_original_single_file_round_trips_and_bad_bases_are_refused(hunyuan, tmp_path):
    from safetensors.torch import load_file

    from trainer.families import Evidence, claim
    from trainer.families.hunyuanimage.keys import diffusers_to_original, original_to_diffusers
    ws, paths, model = hunyuan
    single = load_file(str(paths["single_file"]))
    assert "double_blocks.0.img_attn_qkv.weight" in single and "single_blocks.0.linear1.weight" in single
    state = model.transformer.state_dict()
    back = original_to_diffusers(diffusers_to_original(state))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    loaded = load_tiny(ws, paths["single_file"], f"model.config_path={paths['diffusers']}")
    for k, v in loaded.transformer.state_dict().items():
        torch.testing.assert_close(v, state[k])
    shapes = {f"model.diffusion_model.{k}": tuple(v.shape) for k, v in single.items()}
    assert claim(Evidence("single_file", "h.safetensors", shapes=shapes)) == "hunyuan-image"
    with pytest.raises(ValueError, match="Distilled"):
        claim(Evidence("single_file", "d.safetensors", shapes={**shapes, "time_r_in.mlp.0.weight": (4, 4)}))
    index = json.loads((paths["diffusers"] / "model_index.json").read_text())
    tcfg = json.loads((paths["diffusers"] / "transformer" / "config.json").read_text())

    def folder(idx, tc):
        files = {"model_index.json": idx, "transformer/config.json": tc}
        return Evidence("hub", "someone/model", read_json=lambda rel: files.get(rel))
    assert claim(folder(index, tcfg)) == "hunyuan-image"
    with pytest.raises(ValueError, match="Distilled"):
        claim(folder(index, dict(tcfg, guidance_embeds=True, use_meanflow=True)))
    with pytest.raises(ValueError, match="refiner"):
        claim(folder(dict(index, _class_name="HunyuanImageRefinerPipeline"), tcfg))


@pytest.mark.parametrize("targets", ["all", "attn"])
def test_the_lora_file_is_the_original_layout_comfyui_adds_as_the_trained_layers_compute(hunyuan, targets):
    """ComfyUI adds B·A of each ``diffusion_model.<original module>`` to that weight of Tencent's file (no ``.alpha``:
    scale 1); on the stacked q/k/v and ``linear1`` that gives every part exactly its trained LoRA. With the ``attn``
    targets (the default) a single block's ``linear1`` has LoRAs of q, k and v but not of the MLP input: its rows of
    the stacked B are zero, and the file loads back into the same adapters."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    from trainer.families.common.peft_lora import target_regex
    from trainer.families.hunyuanimage.family import TARGETS
    from trainer.families.hunyuanimage.keys import diffusers_to_original, original_to_diffusers
    ws, paths, model = hunyuan
    config = LoraConfig(r=2, lora_alpha=4, target_modules=target_regex(TARGETS[targets]))
    t = inject_adapter_in_model(config, copy.deepcopy(model.transformer))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    file = model.lora_state_dict({"unet": t})
    assert "diffusion_model.double_blocks.0.txt_attn_qkv.lora_A.weight" in file
    linear1 = "diffusion_model.single_blocks.0.linear1"
    base = diffusers_to_original(model.transformer.state_dict())
    # q, k, v (and mlp): 4 (3) × rank 2; B has the stacked Linear's rows either way
    assert file[f"{linear1}.lora_A.weight"].shape[0] == (8 if targets == "all" else 6)
    assert file[f"{linear1}.lora_B.weight"].shape[0] == base["single_blocks.0.linear1.weight"].shape[0]
    fresh = inject_adapter_in_model(config, copy.deepcopy(model.transformer))
    assert model.load_lora_state_dict(file, {"unet": fresh}) > 0
    trained = {k: v for k, v in t.state_dict().items() if "lora_" in k}
    loaded = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
    assert trained.keys() == loaded.keys()
    for k in trained:  # the products each layer adds (the file bakes α/r into B; loading takes it out again)
        if "lora_A" in k:
            kb = k.replace("lora_A", "lora_B")
            torch.testing.assert_close(loaded[kb] @ loaded[k], trained[kb] @ trained[k], msg=k)
    for key in [k for k in file if k.endswith(".lora_A.weight")]:  # ComfyUI's weight patch
        target = key[len("diffusion_model."):-len(".lora_A.weight")] + ".weight"
        base[target] = base[target] + file[key.replace("lora_A", "lora_B")] @ file[key]
    for m in t.modules():  # the trained layers, merged as peft computes them (scale α/r = 2)
        if isinstance(m, LoraLayer):
            m.merge()
    merged = {k.replace(".base_layer", ""): v for k, v in t.state_dict().items() if "lora_" not in k}
    comfy = original_to_diffusers(base)
    assert set(comfy) == set(merged)
    for k in merged:
        torch.testing.assert_close(comfy[k], merged[k], msg=k)


def test_cached_captions_are_as_long_as_their_text_and_dropout_meets_them(hunyuan):
    """A cached entry keeps each stream's real tokens only (the pipeline pads to 1000 and 128); a cached batch of
    two lengths carries each row's real tokens of both streams on the host, dropout keeps them (the empty caption's
    for a dropped Qwen row, none for a dropped glyph row), so the step cuts the padding without reading the masks,
    and predicts what the whole padded features predict."""
    from trainer.data.text_rows import stack_texts
    ws, paths, model = hunyuan
    captions = ('a sign that says "HI" on a wall', 'x "A"')
    rows = [model.encode_captions([c]) for c in captions]
    for r in rows:
        assert r["prompt_mask"].shape[1] == int(r["prompt_mask"].sum())
        assert r["glyph_mask"].shape[1] == max(int(r["glyph_mask"].sum()), 1)
    batch = stack_texts([{k: v[0] for k, v in r.items()} for r in rows])
    real = [[int(r[k].sum()) for r in rows] for k in ("prompt_mask", "glyph_mask")]
    assert (batch["prompt_lengths"], batch["glyph_lengths"]) == tuple(real) and real[0][0] != real[0][1]
    empty = int(model.encode_captions([""])["prompt_mask"].sum())
    x, sigma = torch.randn(2, 8, 4, 6, generator=torch.Generator().manual_seed(3)), torch.tensor([0.3, 0.7])
    for drop_te1, drop_te2 in (([False, True], None), ([True, False], [False, True])):
        cond = model.batch_condition(batch, lambda c: c, set(), drop_te1=drop_te1, drop_te2=drop_te2)
        full = model._encode(["" if d else c for c, d in zip(captions, drop_te1)])  # as the pipeline pads
        glyphs = model._encode(list(captions))  # the glyph stream's own dropout, apart
        full.embeds_2, full.mask_2 = glyphs.embeds_2, glyphs.mask_2
        for i, d in enumerate(drop_te2 or []):  # a dropped glyph row: the pipeline's zeros and empty mask
            if d:
                full.embeds_2[i], full.mask_2[i] = 0, False
        qwen = [empty if d else n for n, d in zip(real[0], drop_te1)]
        glyph = [0 if d else n for n, d in zip(real[1], drop_te2 or [False, False])]
        assert cond.lengths == (qwen, glyph)
        assert [int(n) for n in cond.mask.sum(1)] == qwen and [int(n) for n in cond.mask_2.sum(1)] == glyph
        with torch.no_grad():
            torch.testing.assert_close(model.predict(x, sigma, cond), model.predict(x, sigma, full),
                                       atol=1e-5, rtol=1e-5)


def test_the_two_text_streams_are_joined_as_diffusers_joins_them_without_reading_the_masks(hunyuan):
    """diffusers' forward joins the refined Qwen tokens and the glyph tokens per row with boolean indexes (eight
    device reads a row); the step hands them over joined by a sort on the device (joined_text.py): the output and
    every gradient are diffusers' bit for bit, for rows of different lengths and a mask with a hole."""
    from trainer.families.hunyuanimage.joined_text import join
    ws, paths, model = hunyuan
    t = model.transformer
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 4, 6, generator=g)
    e, e2 = torch.randn(2, 7, t.config.text_embed_dim, generator=g), torch.randn(2, 5, t.config.text_embed_2_dim,
                                                                                 generator=g)
    m = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0]], dtype=torch.bool)  # a hole in the second row
    m2 = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)  # no glyphs in the second row
    step = torch.tensor([300.0, 700.0])

    def run(joined: bool):
        inputs = [v.clone().requires_grad_(True) for v in (x, e, e2)]
        if joined:
            text, mask = join(inputs[1], m, inputs[2], m2)
            kwargs = dict(encoder_hidden_states=text, encoder_attention_mask=mask)
        else:
            kwargs = dict(encoder_hidden_states=inputs[1], encoder_attention_mask=m,
                          encoder_hidden_states_2=inputs[2], encoder_attention_mask_2=m2)
        out = t(hidden_states=inputs[0], timestep=step, return_dict=False, **kwargs)[0]
        out.square().sum().backward()
        grads = [p.grad.clone() for p in t.parameters() if p.grad is not None]
        t.zero_grad(set_to_none=True)
        return out.detach(), [v.grad for v in inputs], grads

    frozen = {n for n, p in t.named_parameters() if not p.requires_grad}
    t.requires_grad_(True)  # the weights' gradients too (the refiner's, the glyph projection's, the blocks')
    try:
        theirs, ours = run(False), run(True)
    finally:
        for n, p in t.named_parameters():
            p.requires_grad_(n not in frozen)
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    assert len(ours[2]) == len(theirs[2]) > 0 and all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
