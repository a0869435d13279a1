"""SDXL embeddings (both text encoders, clip_l + clip_g files) and per-encoder caption dropout, on the
tiny SDXL model."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.__main__ import main as cli
from conftest import train_quiet
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"
WITH_TOKEN = "a <sks> on a white background"
WITHOUT_TOKEN = "a red square on a white background"
SAMPLE = "[{prompt: 'a <sks> on a white background', steps: 2, width: 64, height: 64}]"


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


def _train(ws: Path, run: str, *settings: str) -> Path:
    return train_quiet(ws, run, "demo-sdxl", *settings)


@pytest.fixture(scope="module")
def xl_embedding_run(tiny_workspace, sks_data) -> Path:
    return _train(tiny_workspace, "xlemb", "training.method=embedding", f"data.concepts.0.path={sks_data}",
                  "training.train_text_encoder=false", "training.train_text_encoder_2=false",
                  "embedding.placeholder=<sks>", "embedding.num_vectors=2", "embedding.initial_text=red square",
                  "training.embedding_learning_rate=0.05", "training.max_steps=3", "backup.every_n_steps=3",
                  f"sampling.prompts={SAMPLE}", "sampling.every_n_epochs=0")


_TEMPLATE: dict = {}


def _pipe(ws: Path):
    if ws not in _TEMPLATE:
        from diffusers import StableDiffusionXLPipeline
        pipe = StableDiffusionXLPipeline.from_pretrained(ws / "models" / "tiny-sdxl", local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        _TEMPLATE[ws] = pipe
    return copy.deepcopy(_TEMPLATE[ws])


def _image(pipe, prompt):
    return pipe(prompt, num_inference_steps=2, height=64, width=64, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images[0]


def _load_both(pipe, path: Path, token: str = "<sks>") -> None:
    """The documented diffusers recipe for SDXL embeddings: one call per encoder."""
    state = load_file(str(path))
    pipe.load_textual_inversion(state["clip_l"], token=token, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(state["clip_g"], token=token, text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)


def test_sdxl_embedding_run_trains_both_encoders_vectors(xl_embedding_run):
    run = xl_embedding_run
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished", events[-1]
    steps = [e for e in events if e["type"] == "step"]
    assert steps and all(set(s["lr"]) == {"embedding"} for s in steps)
    assert [e for e in events if e["type"] == "sample"]
    backup = next((run / "backups").iterdir())
    trained = load_file(str(backup / "trainable.safetensors"))
    assert set(trained) == {"embedding.clip_l.vectors", "embedding.clip_g.vectors"}
    with safe_open(str(run / "xlemb.safetensors"), "pt") as fh:
        assert set(fh.keys()) == {"clip_l", "clip_g"}
        assert fh.get_tensor("clip_l").shape == (2, 32) and fh.get_tensor("clip_g").shape == (2, 48)
        assert fh.metadata()["atelier_placeholder"] == "<sks>"
        for key in ("clip_l", "clip_g"):
            torch.testing.assert_close(fh.get_tensor(key), trained[f"embedding.{key}.vectors"], rtol=0, atol=0)
    # both sets of vectors moved away from their initial text ("red square")
    from trainer.methods.placeholder import DualPlaceholderEmbedding
    init = _pipe_model(run.parent.parent)
    emb = DualPlaceholderEmbedding(init, "<sks>", 2, "red square")
    for key, start in emb.vectors().items():
        assert (trained[f"embedding.{key}.vectors"] - start).abs().max() > 1e-4, key


def _pipe_model(ws: Path):
    pipe = _pipe(ws)
    return SimpleNamespace(tokenizer=pipe.tokenizer, tokenizer_2=pipe.tokenizer_2, text_encoder=pipe.text_encoder,
                           text_encoder_2=pipe.text_encoder_2, pipe=pipe)


def test_sdxl_embedding_loads_in_diffusers_and_changes_only_prompts_with_its_token(xl_embedding_run, tiny_workspace):
    ws = tiny_workspace
    base = _pipe(ws)
    loaded = _pipe(ws)
    _load_both(loaded, xl_embedding_run / "xlemb.safetensors")
    for tok in (loaded.tokenizer, loaded.tokenizer_2):  # the placeholder expands the same in both
        expanded = loaded.maybe_convert_prompt("<sks>", tok)
        assert tok.convert_ids_to_tokens(tok(expanded).input_ids[1:-1]) == ["<sks>", "<sks>_1"]
    assert abs(_image(loaded, WITHOUT_TOKEN) - _image(base, WITHOUT_TOKEN)).max() == 0
    assert abs(_image(loaded, WITH_TOKEN) - _image(base, WITH_TOKEN)).max() > 1e-4
    # the trained vectors sample the same image through diffusers as through our own expansion
    from trainer.methods.placeholder import DualPlaceholderEmbedding
    trained = load_file(str(xl_embedding_run / "xlemb.safetensors"))
    ours = _pipe_model(ws)
    emb = DualPlaceholderEmbedding(ours, "<sks>", 2, init_vectors=trained)
    torch.testing.assert_close(torch.from_numpy(_image(ours.pipe, emb.expand(WITH_TOKEN))),
                               torch.from_numpy(_image(loaded, WITH_TOKEN)), rtol=0, atol=1e-5)


def test_sdxl_embedding_alongside_lora_bundles_clip_l_and_clip_g(tiny_workspace, sks_data):
    run = _train(tiny_workspace, "xlemblora", f"data.concepts.0.path={sks_data}", "embedding.train_alongside=true",
                 "embedding.placeholder=<sks>", "embedding.bundle=true", "training.max_steps=2",
                 "training.train_text_encoder=false", "training.train_text_encoder_2=false", "sampling.prompts=[]")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished", events[-1]
    assert set(next(e for e in events if e["type"] == "step")["lr"]) == {"unet", "embedding"}
    lora = load_file(str(run / "xlemblora.safetensors"))
    separate = load_file(str(run / "xlemblora-sks.safetensors"))
    assert set(separate) == {"clip_l", "clip_g"}
    for key in ("clip_l", "clip_g"):
        torch.testing.assert_close(lora[f"bundle_emb.<sks>.{key}"], separate[key], rtol=0, atol=0)


def test_sdxl_init_weights_must_be_an_sdxl_embedding(tmp_path):
    from safetensors.torch import save_file

    from trainer.errors import ConfigError
    from trainer.methods.placeholder import load_embedding_sdxl
    save_file({"emb_params": torch.zeros(1, 32)}, str(tmp_path / "sd.safetensors"))
    with pytest.raises(ConfigError, match="not an SDXL embedding"):
        load_embedding_sdxl(tmp_path / "sd.safetensors")
    save_file({"clip_l": torch.ones(2, 32), "clip_g": torch.ones(2, 48)}, str(tmp_path / "xl.safetensors"))
    got = load_embedding_sdxl(tmp_path / "xl.safetensors")
    assert got["clip_l"].shape == (2, 32) and got["clip_g"].shape == (2, 48)


# ------------------------------------------------------------------------------------------
# per-encoder caption dropout
# ------------------------------------------------------------------------------------------

def test_per_encoder_caption_dropout_zeroes_each_encoder(tiny_workspace):
    from trainer.config.checks import load_config
    from trainer.families.sdxl.family import StableDiffusionXL
    cfg = load_config(preset="demo-sdxl", overrides=[f"general.workspace={tiny_workspace}"])
    model = StableDiffusionXL(cfg.model, str(tiny_workspace))
    batch = {"captions": ["a red square", "a blue circle"], "original_sizes": [(64, 64)] * 2,
             "crop_top_lefts": [(0, 0)] * 2, "target_sizes": [(64, 64)] * 2}
    with torch.no_grad():
        full = model.batch_condition(batch, lambda c: c, set())
        dropped = model.batch_condition(batch, lambda c: c, set(), drop_te1=[True, False], drop_te2=[False, True])
    w1 = model.text_encoder.config.hidden_size
    pe, fe = dropped.prompt_embeds, full.prompt_embeds
    assert not pe[0, :, :w1].any() and torch.equal(pe[0, :, w1:], fe[0, :, w1:])
    assert torch.equal(dropped.pooled_prompt_embeds[0], full.pooled_prompt_embeds[0])
    assert not pe[1, :, w1:].any() and not dropped.pooled_prompt_embeds[1].any()
    assert torch.equal(pe[1, :, :w1], fe[1, :, :w1])
    # cached text outputs drop the same way
    cached = dict(batch, **model.encode_captions(batch["captions"]))
    with torch.no_grad():
        from_cache = model.batch_condition(cached, lambda c: c, set(), drop_te1=[True, False], drop_te2=[False, True])
    torch.testing.assert_close(from_cache.prompt_embeds, pe)


def test_caption_dropout_per_encoder_run_is_deterministic(tiny_workspace):
    """Flags come from the step generator: two runs with the same seed give the same losses."""
    def losses(run):
        path = _train(tiny_workspace, run, "training.max_steps=3", "training.caption_dropout_te1=0.5",
                      "training.caption_dropout_te2=0.5", "sampling.prompts=[]")
        return [e["loss"] for e in read_events(path / "events.jsonl") if e["type"] == "step"]

    a, b = losses("xldrop-a"), losses("xldrop-b")
    assert len(a) == 3 and a == b and all(v == v for v in a)
