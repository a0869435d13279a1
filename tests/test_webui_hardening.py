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


# -- a broken image is named and skipped, the folder keeps working -------------------------------------------------

def _folder_with_bad_images(folder: Path) -> None:
    """Two good images with captions, and next to them: bytes that are no image, a cut-off JPEG, and two images
    over Pillow's pixel limit (the test lowers it to 1000): one it refuses (over twice the limit), one it would
    only warn about (between once and twice)."""
    folder.mkdir(parents=True)
    for name in ("a", "b"):
        Image.new("RGB", (24, 24), (200, 30, 30)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"photo {name}", encoding="utf-8")
    (folder / "garbage.png").write_bytes(b"this is not an image" * 10)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "cut.jpg", quality=95)
    (folder / "cut.jpg").write_bytes((folder / "cut.jpg").read_bytes()[:300])
    Image.new("RGB", (64, 64)).save(folder / "bomb.png")     # 4096 pixels: Pillow refuses
    Image.new("RGB", (40, 40)).save(folder / "nearbomb.png")  # 1600 pixels: Pillow warns; Atelier refuses


BAD = ("bomb.png", "cut.jpg", "garbage.png", "nearbomb.png")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # as the trainer's probe does for the page
def test_a_broken_image_is_named_and_skipped_in_the_caption_editor_preview_and_mask_painter(ctx, monkeypatch,
                                                                                          capsys):
    folder = ctx.workspace / "mixed"
    _folder_with_bad_images(folder)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    note, items, _, _, tags = ctx.handlers["captions_show"](str(folder))
    assert note.startswith("6 images") and len(items) == 6, note
    for name in BAD:
        assert f"`{name}` — " in note, note
    assert "too large to open safely" in note and "not an image Pillow can read" in note, note
    assert [label for _, label in items if not label.startswith("Error:")] == ["photo a", "photo b"]
    assert ("photo a", 1) in tags
    assert ctx.handlers["captions_store"](str(folder), "garbage.png", "still captionable")[0] == "Saved `garbage.txt`."

    note, thumbs = ctx.handlers["concept_preview"](str(folder), False, "txt_file", ".txt", "")
    assert [caption for _, caption in thumbs] == ["photo a", "photo b"] and "6 images" in note
    for name in BAD:
        assert f"`{name}` — " in note, note

    choices = ctx.handlers["mask_list"](str(folder))[0]
    assert "garbage.png" in [c[0] if isinstance(c, tuple) else c for c in choices.choices]
    for name in BAD:
        editor, message = ctx.handlers["mask_open"](str(folder), name)
        assert editor is None and message.startswith(f"Error: `{name}` cannot be opened: "), message
        assert "\n" not in message and "Traceback" not in message and "PIL." not in message, message
        stored = ctx.handlers["mask_store"](str(folder), name, {"layers": []})
        assert stored.startswith(f"Error: `{name}` cannot be opened: "), stored
    assert not any(folder.glob("*-masklabel.png"))
    editor, message = ctx.handlers["mask_open"](str(folder), "a.png")  # the good ones still open
    assert editor["background"].size == (24, 24) and "(no mask yet)" in message
    (folder / "a-masklabel.png").write_bytes(b"broken mask")
    editor, message = ctx.handlers["mask_open"](str(folder), "a.png")
    assert editor is not None and "`a-masklabel.png` cannot be read" in message, message
    assert "Traceback" not in capsys.readouterr().err


# -- a link never leads the page outside its folders -----------------------------------------------------------------

def _outer(tmp_path: Path) -> Path:
    outer = tmp_path / "outer"
    outer.mkdir()
    Image.new("RGB", (16, 16), (255, 0, 0)).save(outer / "secret.png")
    Image.new("L", (16, 16), 255).save(outer / "secret-mask.png")
    (outer / "secret.txt").write_text("SECRET CAPTION", encoding="utf-8")
    return outer


def test_links_leading_outside_are_left_out_and_named_in_the_caption_editor_preview_and_mask_painter(ctx, tmp_path):
    outer = _outer(tmp_path)
    data = ctx.workspace / "data"
    data.mkdir(parents=True)
    for name in ("a", "b", "c"):
        Image.new("RGB", (16, 16), (0, 90, 0)).save(data / f"{name}.png")
    (data / "a.txt").write_text("a green square", encoding="utf-8")
    (data / "linked.png").symlink_to(outer / "secret.png")
    (data / "b.txt").symlink_to(outer / "secret.txt")             # the image is here, its caption is not
    (data / "c-masklabel.png").symlink_to(outer / "secret-mask.png")  # nor is this mask
    (data / "dangling.png").symlink_to(tmp_path / "gone.png")
    (data / "loop.png").symlink_to(data / "loop.png")
    (data / "folder.png").mkdir()
    (data / "sub").symlink_to(outer, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in outer.iterdir()}

    note, items, _, _, tags = ctx.handlers["captions_show"](str(data))
    assert note.startswith("1 images") and [label for _, label in items] == ["a green square"], note
    for name, why in (("linked.png", "a link that leads outside"), ("b.png", "its caption file `b.txt` is a link"),
                      ("c.png", "its mask `c-masklabel.png` is a link"), ("dangling.png", "does not exist"),
                      ("loop.png", "loops"), ("folder.png", "a folder named like an image")):
        assert f"`{name}` — " in note and why in note, (name, note)
    assert "SECRET" not in str(tags)
    for name in ("linked.png", "b.png", "../outer/secret.png"):
        assert "not an image of this folder" in ctx.handlers["captions_store"](str(data), name, "x")[0]
        assert "not an image of this folder" in ctx.handlers["mask_open"](str(data), name)[1]
        assert "not an image of this folder" in ctx.handlers["mask_store"](str(data), name, {"layers": []})
    assert "not a usable path" in ctx.handlers["captions_show"](str(data / "loop.png"))[0]  # a looping folder
    out = ctx.handlers["captions_replace"](str(data), "SECRET", "x", False)
    assert out[0] == "Replaced in 0 caption(s)."
    dropdown, mask_note = ctx.handlers["mask_list"](str(data))
    assert [c[0] if isinstance(c, tuple) else c for c in dropdown.choices] == ["a.png"]
    assert "`linked.png` — " in mask_note

    preview = ctx.handlers["concept_preview"]
    note, thumbs = preview(str(data), True, "txt", ".txt", "")  # recursive: the linked folder is named, not entered
    assert [caption for _, caption in thumbs] == ["a green square"] and "`sub/` — a link that leads outside" in note
    assert "secret" not in note  # nothing of the outside folder is listed
    assert preview(str(data / "loop.png"), False, "txt", ".txt", "")[1] == []
    note, thumbs = preview(str(data), False, "concept_file", ".txt", str(outer / "secret.txt"))
    assert "outside the folders this page may show" in note and "SECRET" not in str(thumbs), note

    controls = ctx.workspace / "controls"
    controls.mkdir()
    (controls / "a.png").symlink_to(outer / "secret.png")
    pair, line = ctx.handlers["captions_pair"](str(data), str(controls), "a.png")
    assert [label for _, label in pair["value"]] == ["image: a.png", "control 1: a.png"]
    assert "a link that leads outside" in line, line
    assert {p.name: p.read_bytes() for p in outer.iterdir()} == before


def test_zip_this_run_leaves_out_links_leading_outside_the_run_and_says_so(ctx, tmp_path):
    import zipfile
    outer = _outer(tmp_path)
    run_dir = ctx.workspace / "runs" / "r1"
    (run_dir / "samples").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("a: 1\n")
    Image.new("RGB", (8, 8)).save(run_dir / "samples" / "s1.png")
    (run_dir / "samples" / "latest.png").symlink_to(run_dir / "samples" / "s1.png")  # inside: packed
    (run_dir / "samples" / "s2.png").symlink_to(outer / "secret.png")
    (run_dir / "notes").symlink_to(outer, target_is_directory=True)
    for handler in ("zip_picked", "zip_run"):  # the Runs tab's button and the Run tab's
        message, button = ctx.handlers[handler]("r1")
        assert message.startswith("Zipped **r1**"), message
        assert "`samples/s2.png` — a link leading outside the run folder" in message, message
        assert "`notes` — a link leading outside the run folder" in message, message
        with zipfile.ZipFile(ctx.workspace / "downloads" / "r1.zip") as z:
            assert sorted(z.namelist()) == ["config.yaml", "samples/latest.png", "samples/s1.png"]
    # a result the run's events name outside the page's folders (a run started elsewhere) stays out too
    from webui.downloads import zip_for_page
    _, message = zip_for_page(ctx.workspace, run_dir, [str(outer / "secret.png")], ctx.roots.allowed)
    assert "`results/secret.png` — outside the folders this page may use" in message, message


# -- names from disk show whole in the Run tab's problem list ------------------------------------------------------

def _shown_text(markdown: str) -> str:
    """What a reader sees of ``markdown``: rendered as CommonMark (as the page does), tags removed."""
    from html.parser import HTMLParser
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark").render(markdown)

    class Text(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.parts: list = []

        def handle_data(self, data: str) -> None:
            self.parts.append(data)
    parser = Text()
    parser.feed(rendered)
    return "".join(parser.parts)


def test_the_run_tabs_problem_list_shows_file_names_and_messages_whole(tmp_path):
    from webui.monitor import RunView
    from webui.tabs.run import problems_md
    names = ["photo <1>.png", "cat <b>tabby</b>.jpg", "*star*_and_[link](x).png", r"C:\data\a_b_.png",
             "back`tick.png"]
    view = RunView(name="r", path=tmp_path, state="failed",
                   message=f"could not read '{names[0]}': damaged <script>alert(1)</script>\n# not a heading",
                   traceback="Traceback\n```\n</details><b>bold</b>", advice="lower training.batch_size",
                   warnings=[f"skipped '{n}': not an image" for n in names[1:]] + ["you ran `kill -9` on it"])
    md = problems_md(view)
    shown = _shown_text(md)
    for text in names + ["<script>alert(1)</script>", "# not a heading", "training.batch_size", "```",
                         "</details><b>bold</b>"]:
        assert text in shown, (text, md, shown)
    assert "<script>" not in md and "<b>" not in md.split("<details>")[0]
    assert "`kill -9`" in md  # the trainer's own code spans stay code


def test_a_skipped_file_note_shows_names_whole():
    from webui.imagefiles import skipped_md
    note = skipped_md([("a <b>.png", "damaged <x>"), ("`odd`.png", "fine")])
    shown = _shown_text(note)
    assert "a <b>.png — damaged <x>" in shown and "`odd`.png — fine" in shown, shown


# -- logins: one address locked out, not the owner; many addresses slow everyone down, never lock ------------------

def test_wrong_passwords_lock_out_their_address_only_and_many_addresses_only_slow_logins():
    import asyncio

    from webui.login import RateLimitedAuth, as_client
    now = [1000.0]
    auth = RateLimitedAuth([("ada", "s3cret")], limit=5, window=60, cooldown=30, crowd=10, step=0.01,
                           max_delay=0.05, clock=lambda: now[0])
    with as_client("6.6.6.6"):
        for _ in range(5):
            assert not auth("ada", "guess")
        assert not auth("ada", "s3cret")  # that address is locked out, the right password too
    with as_client("1.2.3.4"):
        assert auth("ada", "s3cret")  # the owner is not
    assert auth.delay() == 0  # one failing address slows nobody
    for k in range(9):  # ten addresses failed within the window: everyone waits, more the more addresses fail
        with as_client(f"10.0.0.{k}"):
            assert not auth("ada", "guess")
    assert auth.delay() == pytest.approx(0.01)
    for k in range(9, 40):
        with as_client(f"10.0.0.{k}"):
            assert not auth("ada", "guess")
    assert auth.delay() == pytest.approx(0.05)  # at most max_delay
    with as_client("1.2.3.4"):
        assert asyncio.run(auth.login("ada", "s3cret"))  # slowed, never locked
    now[0] += 61
    assert auth.delay() == 0 and not auth.locked_until and not auth.failures  # the window forgets them
    with as_client("6.6.6.6"):
        assert auth("ada", "s3cret")


def test_the_client_address_is_the_peer_or_with_a_share_link_what_the_share_proxy_added():
    from webui.login import client_address

    def scope(peer, forwarded=None):
        return {"client": (peer, 5000), "headers": [(b"x-forwarded-for", forwarded.encode())] if forwarded else []}
    assert client_address(scope("203.0.113.5")) == "203.0.113.5"
    assert client_address(scope("127.0.0.1", "1.1.1.1")) == "127.0.0.1"  # no share link: nobody forwards
    assert client_address(scope("127.0.0.1", "1.1.1.1, 198.51.100.7"), share=True) == "198.51.100.7"
    assert client_address(scope("203.0.113.5", "198.51.100.7"), share=True) == "203.0.113.5"  # not the proxy
    assert client_address(scope("127.0.0.1"), share=True) == "127.0.0.1"  # the owner on this machine


def test_the_served_page_locks_out_the_address_that_guessed_not_the_owner(tmp_path):
    import httpx

    from webui.app import serve
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    _, url, _ = serve(demo, port=None, auth=[("ada", "s3cret")], prevent_thread_lock=True, quiet=True)
    login = url.rstrip("/") + "/login"
    try:
        # a second loopback address stands for another machine (Linux routes all of 127/8 to this one)
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as other:
            for _ in range(5):
                assert other.post(login, data={"username": "ada", "password": "guess"}).status_code == 400
            assert other.post(login, data={"username": "ada", "password": "s3cret"}).status_code == 400
        with httpx.Client(timeout=30) as owner:
            assert owner.post(login, data={"username": "ada", "password": "s3cret"}).status_code == 200
    finally:
        demo.close()
