"""Textual-inversion embeddings on the tiny model: a run trains only the placeholder's vectors; the
A1111 file loads with diffusers' ``load_textual_inversion`` and changes images only for prompts
with its token; embeddings trained alongside a LoRA are saved beside it (and optionally bundled);
placeholder rules warn or fail before training."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.config.checks import cross_field_warnings, load_config
from trainer.errors import ConfigError
from conftest import train_quiet
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"
WITH_TOKEN = "a <sks> on a white background"
WITHOUT_TOKEN = "a red square on a white background"
SAMPLE = "[{prompt: 'a <sks> on a white background', steps: 2, width: 64, height: 64}]"


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


def _train(ws: Path, run: str, *settings: str) -> Path:
    return train_quiet(ws, run, "demo", *settings)


@pytest.fixture(scope="module")
def embedding_run(tiny_workspace, sks_data) -> Path:
    return _train(tiny_workspace, "emb", "training.method=embedding", f"data.concepts.0.path={sks_data}",
                  "embedding.placeholder=<sks>", "embedding.num_vectors=2", "embedding.initial_text=red square",
                  "embedding.save_pt=true", "training.embedding_learning_rate=0.05", "training.max_steps=4",
                  "backup.every_n_steps=4", f"sampling.prompts={SAMPLE}", "sampling.every_n_epochs=0")


_TEMPLATES: dict = {}


def _pipe(ws: Path):
    if ws not in _TEMPLATES:
        from diffusers import StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained(ws / "models" / "tiny-sd", local_files_only=True,
                                                       safety_checker=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        _TEMPLATES[ws] = pipe
    return copy.deepcopy(_TEMPLATES[ws])


def _image(pipe, prompt):
    return pipe(prompt, num_inference_steps=3, height=64, width=64, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images[0]


def _encode(pipe, prompt):
    """The text-encoder output as the pipeline computes it (diffusers first rewrites a multi-vector
    token into its tokens: ``<sks>`` → ``<sks> <sks>_1``)."""
    prompt = pipe.maybe_convert_prompt(prompt, pipe.tokenizer)
    ids = pipe.tokenizer([prompt], padding="max_length", max_length=77, truncation=True,
                         return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]


def test_embedding_run_trains_only_the_new_vectors(embedding_run):
    events = read_events(embedding_run / "events.jsonl")
    assert events[-1]["type"] == "finished"
    assert not [e for e in events if e["type"] == "warning" and "placeholder" in e["message"]]
    steps = [e for e in events if e["type"] == "step"]
    assert all(set(s["lr"]) == {"embedding"} and s["lr"]["embedding"] == 0.05 for s in steps)
    assert [e for e in events if e["type"] == "sample"]  # sample prompts are expanded before tokenizing
    backup = next((embedding_run / "backups").iterdir())
    trained = load_file(str(backup / "trainable.safetensors"))
    assert set(trained) == {"embedding.vectors"} and trained["embedding.vectors"].shape == (2, 32)
    with safe_open(str(embedding_run / "emb.safetensors"), "pt") as fh:
        assert set(fh.keys()) == {"emb_params"}
        saved = fh.get_tensor("emb_params")
        assert fh.metadata()["atelier_placeholder"] == "<sks>"
    torch.testing.assert_close(saved, trained["embedding.vectors"], rtol=0, atol=0)
    pt = torch.load(embedding_run / "emb.pt", weights_only=True)
    torch.testing.assert_close(pt["string_to_param"]["*"], saved, rtol=0, atol=0)


def test_embedding_loads_in_diffusers_and_changes_only_prompts_with_its_token(embedding_run, tiny_workspace):
    ws = tiny_workspace
    base = _pipe(ws)
    loaded = _pipe(ws)
    loaded.load_textual_inversion(str(embedding_run / "emb.safetensors"), token="<sks>")
    assert loaded.tokenizer.convert_ids_to_tokens(loaded.tokenizer("<sks>").input_ids[1:-1]) == ["<sks>"]
    # without the token: the very same image
    assert (abs(_image(loaded, WITHOUT_TOKEN) - _image(base, WITHOUT_TOKEN)).max() == 0)
    # with the token: a different image than before training (initial vectors = "red square")
    init = _pipe(ws)
    from trainer.methods.placeholder import PlaceholderEmbedding
    emb = PlaceholderEmbedding(init.tokenizer, init.text_encoder, "<sks>", 2, "red square")
    assert abs(_image(loaded, WITH_TOKEN) - _image(init, emb.expand(WITH_TOKEN))).max() > 1e-3
    # and the loaded token encodes exactly as the trained vectors did during training
    trained = load_file(str(next((embedding_run / "backups").iterdir()) / "trainable.safetensors"))
    ours = _pipe(ws)
    emb = PlaceholderEmbedding(ours.tokenizer, ours.text_encoder, "<sks>", 2,
                               init_vectors=trained["embedding.vectors"])
    torch.testing.assert_close(_encode(loaded, WITH_TOKEN), _encode(ours, emb.expand(WITH_TOKEN)),
                               rtol=0, atol=1e-6)
    # the A1111 .pt file loads to the same vectors
    from_pt = _pipe(ws)
    from_pt.load_textual_inversion(str(embedding_run / "emb.pt"), token="<sks>")
    torch.testing.assert_close(_encode(from_pt, WITH_TOKEN), _encode(loaded, WITH_TOKEN), rtol=0, atol=0)


def test_embedding_alongside_lora_saved_beside_and_bundled(tiny_workspace):
    """Demo captions lack the placeholder: the run warns (a training ``warning`` event)."""
    run = _train(tiny_workspace, "emb-lora", "embedding.train_alongside=true", "embedding.placeholder=<sks>",
                 "embedding.bundle=true", "training.max_steps=2", "sampling.prompts=[]")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished"
    assert any(e["type"] == "warning" and "No caption contains the embedding placeholder '<sks>'" in e["message"]
               for e in events)
    assert set(next(e for e in events if e["type"] == "step")["lr"]) == {"unet", "embedding"}
    lora = load_file(str(run / "emb-lora.safetensors"))
    separate = load_file(str(run / "emb-lora-sks.safetensors"))["emb_params"]
    torch.testing.assert_close(lora["bundle_emb.<sks>.string_to_param.*"], separate, rtol=0, atol=0)
    pipe = _pipe(tiny_workspace)
    pipe.load_textual_inversion(str(run / "emb-lora-sks.safetensors"), token="<sks>")
    # diffusers refuses bundle_emb keys; without them the LoRA part loads
    pipe.load_lora_weights({k: v for k, v in lora.items() if not k.startswith("bundle_emb.")})
    assert _image(pipe, WITH_TOKEN).shape == (64, 64, 3)


def test_placeholder_keeps_the_text_encoder_layout(tiny_workspace):
    """No resized embedding matrix: same state-dict keys and shapes (fine-tune export, backups);
    ``detached`` restores the original tokenizer and module for whole-model exports."""
    from types import SimpleNamespace

    from trainer.methods.placeholder import PlaceholderEmbedding
    pipe = _pipe(tiny_workspace)
    before = {k: v.shape for k, v in pipe.text_encoder.state_dict().items()}
    n_tokens = len(pipe.tokenizer)
    emb = PlaceholderEmbedding(pipe.tokenizer, pipe.text_encoder, "<SKS>", 3, "a")
    assert {k: v.shape for k, v in pipe.text_encoder.state_dict().items()} == before
    assert len(pipe.tokenizer) == n_tokens + 3
    assert emb.expand("a <sks> and <SKS>, <sks>_0") == "a <sks>_0 <sks>_1 <sks>_2 and <sks>_0 <sks>_1 <sks>_2, <sks>_0"
    assert emb.expand(emb.expand("x <sks>")) == emb.expand("x <sks>")
    assert [p for p in pipe.text_encoder.parameters() if p is emb.holder.vectors] == []
    model = SimpleNamespace(tokenizer=pipe.tokenizer)
    with emb.detached(model):
        assert len(model.tokenizer) == n_tokens
        assert type(pipe.text_encoder.get_input_embeddings()) is torch.nn.Embedding
    assert model.tokenizer is pipe.tokenizer and pipe.text_encoder.get_input_embeddings() is emb.module
    # a batch without the placeholder still backpropagates (zero gradient)
    ids = pipe.tokenizer(["a cat"], return_tensors="pt").input_ids
    pipe.text_encoder(ids)[0].sum().backward()
    assert emb.holder.vectors.grad is not None and not emb.holder.vectors.grad.any()


def test_placeholder_rules():
    def cfg(*overrides):
        return load_config(preset="demo", overrides=["training.method=embedding", *overrides])

    with pytest.raises(ConfigError, match="embedding.placeholder is empty"):
        cfg()
    with pytest.raises(ConfigError, match="spaces"):
        cfg("embedding.placeholder='my token'")
    with pytest.raises(ConfigError, match="dot"):
        load_config(preset="demo", overrides=["embedding.train_alongside=true", "embedding.placeholder=a.b",
                                              "embedding.bundle=true"])
    warned = {i.key: i.message for i in cross_field_warnings(cfg("embedding.placeholder=<sks>"))}
    assert "embedding.placeholder" in warned and "sample prompt" in warned["embedding.placeholder"]
    ok = cfg("embedding.placeholder=<sks>", "sampling.prompts.0.prompt='a <sks> dog'")
    assert "embedding.placeholder" not in {i.key for i in cross_field_warnings(ok)}
