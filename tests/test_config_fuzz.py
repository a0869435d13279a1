"""Generated configs (tests/config_fuzz.py): validate answers every one with a message or a pass, never a traceback.
That every config validate passes also trains is bench/fuzz_configs.py --train's (a generated config may train for
hours: max_steps = 80 million is a valid setting)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from config_fuzz import corpus
from trainer.__main__ import main as cli

N = 48  # bench/fuzz_configs.py runs hundreds; each validate composes the schema (~0.3 s)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz")
    paths = []
    for i, text in enumerate(corpus(N, 0, out / "files")):
        path = out / f"{i:03d}.yaml"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def _validate(path: Path) -> tuple:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli(["validate", str(path), "--json"])
    return rc, out.getvalue()


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_validate_answers_every_generated_config_without_a_traceback(configs):
    verdicts = {}
    for path in configs:
        try:
            rc, text = _validate(path)
        except SystemExit as exc:  # argparse-level refusals are answers too
            rc, text = exc.code, ""
        except BaseException as exc:  # noqa: B902 - any escape is the finding
            pytest.fail(f"validate raised on {path.name} ({path.read_text()!r}): {exc!r}")
        verdicts[path.name] = rc
        if rc:  # a refusal says what is wrong: at least one error with its message
            errors = json.loads(text)["errors"]
            assert errors and all(e["message"] for e in errors), (path.name, text)
    refused = sum(1 for rc in verdicts.values() if rc)
    assert 0 < refused < N  # the corpus holds both (a generator that only breaks, or never, tests nothing)
