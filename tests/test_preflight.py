"""``validate`` names every file or folder ``train`` would reject, before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from trainer.config.checks import config_from_dict, cross_field_warnings
from trainer.families.sources import classify_source
from trainer.errors import ModelLoadError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def good(tmp_path, monkeypatch):
    """A config whose every path exists, read from tmp_path (as the trainer reads relative paths)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cats").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "cats" / "a.png")
    (tmp_path / "caps.txt").write_text("a cat\n", encoding="utf-8")
    (tmp_path / "nested" / "deep").mkdir(parents=True)
    Image.new("RGB", (16, 16)).save(tmp_path / "nested" / "deep" / "b.png")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("hi", encoding="utf-8")
    return {"model": {"path": "builtin:tiny-sd"}, "general": {"workspace": str(tmp_path / "ws")},
            "data": {"concepts": [{"path": "cats"}]}}


def _errors(data: dict) -> dict:
    return {i.key: i.message for i in cross_field_warnings(config_from_dict(data)) if i.level == "error"}


def _with(base: dict, dotted: str, value) -> dict:
    data = json.loads(json.dumps(base))
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[int(parts[-1]) if parts[-1].isdigit() else parts[-1]] = value
    return data


BAD = [  # (field, value, words the message must hold)
    ("model.path", "", "empty"),
    ("model.path", "builtin:tiny-nothing", "unknown built-in"),
    ("model.path", "models/missing.safetensors", "does not exist"),
    ("model.path", "./missing-folder", "does not exist"),
    ("model.path", "C:\\models\\sd15.safetensors", "does not exist"),
    ("model.path", "notes.txt", "expected a .safetensors"),
    ("model.path", "cats", "not a diffusers model"),
    ("model.config_path", "no/such/folder/here", "not a folder"),
    ("data.concepts.0.path", "", "empty"),
    ("data.concepts.0.path", "dogs", "does not exist"),
    ("data.concepts.0.path", "caps.txt", "is a file"),
    ("data.concepts.0.path", "nested", "recursive"),
    ("data.concepts.0.caption_file", "nope.txt", "not found"),
    ("lora.init_weights", "old-lora.safetensors", "does not exist"),
    ("lora.init_weights", "notes.txt", "is not a LoRA .safetensors file"),  # train died on SafetensorError
    ("training.batch_size", 2, "more than the 1 images an epoch holds"),  # train refused after loading the model
    ("sampling.prompts", [{"prompt": "x", "image": "in.png"}], "does not exist"),
    ("general.workspace", "notes.txt", "is a file"),
    ("output.path", "notes.txt/out", "is a file"),
    ("data.cache_dir", "caps.txt", "is a file"),
]


def test_a_dataset_of_validation_concepts_only_is_refused_before_training(good):
    data = _with(good, "data.concepts.0.role", "validation")
    assert "nothing would train" in _errors(data)["data.concepts"]
    data["data"]["concepts"].append({"path": "cats", "role": "train"})
    assert _errors(data) == {}


def test_a_good_config_has_no_path_error(good):
    assert _errors(good) == {}
    assert _errors(_with(good, "model.path", "org/some-model")) == {}  # a hub id: checked when it loads
    assert _errors(_with(good, "model.path", "model.safetensors")) == {}


@pytest.mark.parametrize("key,value,words", BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD])
def test_validate_names_the_field_train_would_reject(good, key, value, words):
    data = _with(good, key, value)
    if key == "data.concepts.0.caption_file":
        data["data"]["concepts"][0]["caption_source"] = "concept_file"
    errors = _errors(data)
    want = "sampling.prompts.0.image" if key == "sampling.prompts" else key
    assert want in errors, errors
    assert words in errors[want], errors[want]


@pytest.mark.parametrize("settings,words", [
    ({"output": {"format": "diffusers"}}, "a LoRA is saved as a kohya .safetensors"),
    ({"training": {"method": "embedding"}, "embedding": {"placeholder": "<sks>"}, "output": {"format": "diffusers"}},
     "an embedding is saved as .safetensors"),
    ({"training": {"method": "embedding"}, "embedding": {"placeholder": "<sks>"}, "output": {"format": "ckpt"},
      "model": {"path": "builtin:tiny-sdxl"}}, "SDXL embeddings"),
])
def test_an_output_format_the_method_cannot_write_is_refused_before_training(good, settings, words):
    """Before, these trained to the end and failed when the result was saved."""
    from trainer.errors import ConfigError
    data = json.loads(json.dumps(good))
    for section, values in settings.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == "output.format" and words in str(info.value)


def test_the_loader_applies_the_same_rules(good):
    with pytest.raises(ModelLoadError) as info:
        classify_source("models/missing.safetensors", "ws")
    assert info.value.key == "model.path" and "does not exist" in str(info.value)
    assert classify_source("org/some-model", "ws").kind == "hub"
    assert classify_source("model.safetensors", "ws").kind == "single_file"


def test_an_unwritable_workspace_is_named(good, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    errors = _errors(_with(good, "general.workspace", str(locked / "ws")))
    assert "not writable" in errors["general.workspace"] and str(locked) in errors["general.workspace"]


def test_validate_command_fails_at_the_field_without_loading_a_model(good, tmp_path):
    cfg = tmp_path / "c.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump(_with(good, "data.concepts.0.path", "dogs")), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", str(cfg), "--json"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 1, out.stderr
    errors = {e["key"]: e["message"] for e in json.loads(out.stdout)["errors"]}
    assert "does not exist" in errors["data.concepts.0.path"]
