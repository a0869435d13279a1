"""Malformed configs: every one is refused with one line naming the setting, never a traceback — in
`validate`, `train` and the UI's Load file."""

from __future__ import annotations

import pytest

from trainer.__main__ import main as cli

SECTIONS = ["general", "model", "data", "training", "loss", "ema", "precision", "lora", "embedding", "sampling",
            "backup", "output"]
BAD_VALUES = ["[1, 2]", "5", "'text'", "true", "{a: 1}", "null_value", "${missing.key}", "${no_such_resolver:}"]
CASES = (
    [f"{s}: {v}" for s in SECTIONS for v in ("[1, 2]", "'text'")]
    + [f"data:\n  concepts: {v}" for v in ("{a: 1}", "5", "'x'", "[1, 2]", "[{path: 3, repeats: many}]")]
    + [f"sampling:\n  prompts: {v}" for v in ("{a: 1}", "a cat", "[{prompt: x, width: big}]")]
    + [f"training:\n  {k}: {v}" for k in ("epochs", "learning_rate", "batch_size", "optimizer", "method")
       for v in ("[1, 2]", "{a: 1}", "${missing.key}")]
    + [f"model:\n  path: {v}" for v in ("${missing.key}", "${no_such_resolver:}", "[a, b]", "{x: 1}")]
    + ["[1, 2, 3]", "just a string", "{", "training:\n  epochs: 1\n   bad_indent: 2", "base: no-such-preset",
       "version: 99", "version: many", "nonsense_section:\n  x: 1", "training:\n  no_such_key: 1",
       "lora:\n  rank: -3", "data:\n  resolution: 'abc'", "general:\n  device: toaster"]
)


def test_there_are_at_least_fifty_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("text", CASES)
def test_validate_refuses_with_one_line_and_no_traceback(text, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    rc = cli(["validate", str(path), "--set", f"general.workspace={tmp_path}"])
    out = capsys.readouterr()
    both = out.out + out.err
    assert rc != 0, both
    assert "Traceback" not in both and "Error:" in both or "error" in both.lower(), both
    errors = [line for line in both.splitlines() if "rror" in line]
    assert errors and all(len(line) < 600 for line in errors), both


def test_train_and_the_ui_refuse_the_same_shapes_cleanly(tmp_path, capsys):
    from webui.app import build_app
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    ctx = demo.atelier
    try:
        shapes = [c for c in CASES if any(m in c for m in ("[1, 2]", "{a: 1}", "${", "'text'"))]
        for i, text in enumerate(shapes[::3]):
            path = tmp_path / "ws" / f"bad{i}.yaml"
            path.write_text(text + "\n")
            assert cli(["train", str(path), "--no-progress", "--set", f"general.workspace={tmp_path / 'ws'}"]) != 0
            err = capsys.readouterr().err
            assert "Traceback" not in err, (text, err)
            message = ctx.handlers["load_file"](str(path))[-1]
            assert message.startswith("⛔") and "Traceback" not in message, (text, message)
    finally:
        demo.close()
