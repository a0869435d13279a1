"""The caption editor's opened folder (``webui.captions.FolderView``): saving one caption and Replace-in-all keep
the tag table what a full recount of the files gives, without listing the folder or reading the other captions
again; only the captions that change are written. (The page's handlers around it: tests/test_webui_app.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from webui import captions
from webui.captions import FolderView, tag_counts


def _folder(tmp_path: Path) -> Path:
    data = tmp_path / "cats"
    data.mkdir()
    for k, (name, caption) in enumerate((("a", "cat, sofa, red"), ("b", "cat, window"), ("c", None),
                                         ("d", "dog, red, red"))):
        Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(data / f"{name}.png")
        if caption:
            (data / f"{name}.txt").write_text(caption + "\n", encoding="utf-8")
    return data


def _view(data: Path) -> FolderView:
    return FolderView(data, lambda p: True)


def _recount(view: FolderView) -> list:
    return tag_counts(view.images)  # read from the files, as opening the folder again would


def _watch(monkeypatch) -> dict:
    """From here on: fail on a listing of the folder, record every caption read and written."""
    calls: dict = {"read": [], "write": []}
    real_read, real_write = captions.read_caption, captions.write_caption

    def listing(*a, **k):
        raise AssertionError("the folder was listed again")

    monkeypatch.setattr(captions, "page_images", listing)
    monkeypatch.setattr(captions, "read_caption", lambda image: calls["read"].append(image.name) or real_read(image))
    monkeypatch.setattr(captions, "write_caption",
                        lambda image, text: calls["write"].append(image.name) or real_write(image, text))
    return calls


def test_saving_one_caption_updates_its_file_tile_and_the_tag_counts(tmp_path, monkeypatch):
    data = _folder(tmp_path)
    view = _view(data)
    assert view.tag_table() == _recount(view) and view.tag_table()[0] == ("cat", 2)
    assert view.note().startswith("4 images") and "1 without a caption" in view.note()
    calls = _watch(monkeypatch)
    view.save(data / "a.png", "  dog, garden ")
    assert calls == {"read": [], "write": ["a.png"]}  # that file only: nothing listed or re-read
    monkeypatch.undo()
    assert (data / "a.txt").read_text(encoding="utf-8") == "dog, garden\n"
    assert view.tag_table() == _recount(view)
    assert ("cat", 1) in view.tag_table() and ("red", 1) in view.tag_table()
    assert "sofa" not in dict(view.tag_table())
    assert [label for _, label in view.gallery()] == ["dog, garden", "cat, window", "(no caption)", "dog, red, red"]
    before = [tile for tile, _ in view.gallery()]
    view.save(data / "c.png", "cat")  # a caption file that did not exist
    after = [tile for tile, _ in view.gallery()]  # tiles are files the page sends again as they are: only c's is new
    assert [a == b for a, b in zip(before, after)] == [True, True, False, True]
    assert Image.open(after[2]).size == Image.open(before[2]).size and all(Path(t).is_file() for t in after)
    assert view.tag_table() == _recount(view) and "0 without a caption" in view.note()
    assert not view.stale()  # its own writes do not make it stale
    Image.new("RGB", (8, 8)).save(data / "e.png")
    assert view.stale()  # a file added elsewhere does


def test_replace_in_all_rewrites_only_the_captions_that_change_and_recounts_from_them(tmp_path, monkeypatch):
    data = _folder(tmp_path)
    view = _view(data)
    calls = _watch(monkeypatch)
    assert [p.name for p in view.replace("red", "crimson")] == ["a.png", "d.png"]
    assert calls == {"read": [], "write": ["a.png", "d.png"]}
    assert (data / "d.txt").read_text() == "dog, crimson, crimson\n" and (data / "b.txt").read_text() == "cat, window\n"
    assert view.tag_table() == _recount(view) and ("crimson", 2) in view.tag_table()
    calls["write"].clear()
    calls["read"].clear()  # the recount's own reads
    (data / "b.txt").write_text("cat, red window\n", encoding="utf-8")  # edited elsewhere after the folder opened
    os.utime(data / "b.txt", ns=(1, 1))
    assert [p.name for p in view.replace(r"\bcat\b", "kitten", regex=True)] == ["a.png", "b.png"]
    assert (data / "b.txt").read_text() == "kitten, red window\n"  # the edit made elsewhere is kept
    assert calls == {"read": ["b.png"], "write": ["a.png", "b.png"]}
    assert view.replace("absent", "x") == [] and view.replace("", "x") == []
    monkeypatch.undo()
    assert view.tag_table() == _recount(view) and ("kitten", 2) in view.tag_table()


def test_opening_reads_each_caption_as_read_caption_does(tmp_path):
    data = _folder(tmp_path)
    Image.new("RGB", (8, 8)).save(data / "e.png")
    (data / "e.txt").mkdir()                                     # a folder named like its caption: no text
    Image.new("RGB", (8, 8)).save(data / "f.png")
    (data / "f.txt").write_bytes("caf\xe9, \xa0 sofa \n\n".encode("cp1252"))  # not UTF-8
    Image.new("L", (8, 8), 255).save(data / "f-masklabel.png")
    view = _view(data)
    assert view.captions == {image: captions.read_caption(image) for image in view.images}
    assert view.tag_table() == _recount(view)
    assert view.note().startswith("6 images") and "1 without a caption, 1 with a mask" in view.note()
    assert view.refresh() == 0  # the stamps taken at opening are those of the files read
