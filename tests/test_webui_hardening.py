"""The page's file handlers under a careless or hostile user: the shipped presets are read, never written; a broken
image is named and skipped, not the end of its folder; a link never leads the page outside its folders; names from
disk show whole; logins lock out one address at a time; no streaming route answers without a login."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from trainer.config.load import PRESETS_DIR
from webui.app import build_app

DEMO_DATA = PRESETS_DIR / "demo-data"


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    """A page on ``tmp_path/ws`` whose home is ``tmp_path/home``: ``tmp_path/outer`` is outside every folder it
    may use."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return build_app(tmp_path / "ws", start_scheduler=False).atelier


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- the shipped presets are read-only ----------------------------------------------------------------------------

def test_the_caption_editor_reads_the_shipped_demo_data_but_never_writes_it(ctx):
    before = _snapshot(DEMO_DATA)
    try:
        note = ctx.handlers["captions_show"](str(DEMO_DATA))[0]
        assert note.startswith(f"{sum(1 for n in before if n.endswith('.png'))} images"), note  # reading works
        assert "shipped presets" in note
        image = sorted(n for n in before if n.endswith(".png") and not n.endswith("-masklabel.png"))[0]
        for out in (ctx.handlers["captions_store"](str(DEMO_DATA), image, "changed"),
                    ctx.handlers["captions_replace"](str(DEMO_DATA), "a", "b", False),
                    [ctx.handlers["mask_store"](str(DEMO_DATA), image, {"layers": []})]):
            assert "shipped presets" in out[0] and "Copy the folder into the workspace" in out[0], out[0]
            assert str(ctx.workspace) in out[0]
        assert _snapshot(DEMO_DATA) == before
    finally:  # without the refusal the handlers above wrote into the presets: put them back
        for name, data in before.items():
            if (DEMO_DATA / name).read_bytes() != data:
                (DEMO_DATA / name).write_bytes(data)
        for extra in set(p.name for p in DEMO_DATA.iterdir()) - set(before):
            (DEMO_DATA / extra).unlink()
