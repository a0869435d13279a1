"""Sana beyond the family contract: Gemma features with the pipeline's instruction preamble and token selection, the
transformer call the pipeline makes (the 0-1000 clock, the flow target), DC-AE latents as the pipeline decodes them,
the single file back and forth (Sana 1.5's q/k norms included), detection and refusals, and the LoRA file
``SanaPipeline.load_lora_weights`` reads giving peft's merged weights."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sana(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("sana-ws")
    paths = build_tiny("tiny-sana", ws / "models")
    return ws, paths, load_tiny(ws, paths["diffusers"])


def test_text_features_are_the_pipelines_with_its_instruction_preamble(sana):
    ws, paths, model = sana
    caption = "A Red square on a white background"  # upper case: the pipeline lower-cases it
    pipe = model.pipeline(None)
    embeds, mask, neg, neg_mask = pipe.encode_prompt(caption, do_classifier_free_guidance=True, device="cpu",
                                                     max_sequence_length=model.max_sequence_length,
                                                     complex_human_instruction=pipe_default_instruction())
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    assert cond.prompt_embeds.shape[1] == model.max_sequence_length == 300
    torch.testing.assert_close(cond.prompt_embeds, embeds)
    assert torch.equal(cond.prompt_mask, mask.bool())
    # caption dropout gives the unconditional features the pipeline samples with: "" without the preamble
    dropped = model.batch_condition({"captions": [caption]}, lambda c: c, set(), drop_te1=[True])
    torch.testing.assert_close(dropped.prompt_embeds, neg)
    assert torch.equal(dropped.prompt_mask, neg_mask.bool())
    # the preamble changes the features (the test above would pass without it if the pipeline dropped it too)
    plain, _, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu",
                                        complex_human_instruction=None)
    assert not torch.allclose(plain, embeds)


def pipe_default_instruction():
    import inspect
    from diffusers import SanaPipeline
    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


def test_predict_is_the_pipelines_transformer_call(sana):
    ws, paths, model = sana
    pipe = model.pipeline(None)
    h, w = 8, 16  # non-square: a swapped axis would show (the pipeline takes sides in multiples of 32 px)
    latents = torch.randn(1, 32, h, w, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 4, width=w * 4, latents=latents, num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent", **model.sampling_kwargs())
            ref = calls[1]  # the second step: a σ below 1
            t = ref["kwargs"]["timestep"]
            assert 0 < float(t) < 1000
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            hidden = ref["args"][0] if ref["args"] else ref["kwargs"]["hidden_states"]
            pred = model.predict(hidden, t.float() / 1000, cond)
    finally:
        remove()
    torch.testing.assert_close(pred, ref["out"])
    # the flow target the loop trains against is what the pipeline's scheduler steps with (flow_prediction)
    assert pipe.scheduler.config.prediction_type == "flow_prediction"
    assert model.objective.shift == pipe.scheduler.config.flow_shift == 3.0
