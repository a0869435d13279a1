"""The dataset report in the UI is the trainer's own, computed without torch (checked in test_webui_app.py, in
the interpreter that checks the whole page leaves torch out).

The browser tests share one chromium and one served app (``chromium``, ``served``; each test opens its own
browser context on an emptied workspace, ``app``): starting them costs seconds of CPU each time."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from PIL import Image

from trainer.config.checks import load_config

from test_webui_e2e import app, chromium, served  # noqa: F401  (fixtures: one browser, one served app)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"


def test_dataset_report_names_images_that_would_never_train(tmp_path):
    from webui.tabs.tools import dataset_report
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        Image.new("RGB", (96, 96), (200, 10 * i, 10)).save(data / f"square{i}.png")
    Image.new("RGB", (256, 64), (10, 200, 10)).save(data / "wide.png")  # alone in a wide bucket
    (data / "broken.png").write_bytes(b"not an image")
    cfg = load_config(preset="demo", overrides=[f"data.concepts.0.path={data}", "training.batch_size=2",
                                                "data.aspect_buckets=true", "data.resolution=256"])
    text = dataset_report(cfg)
    assert text.startswith("Warning:")
    assert "never train" in text and "wide.png" in text
    assert "broken.png" in text
    ok = dataset_report(load_config(preset="demo"))
    assert ok.startswith("OK:") and "8 images" in ok


def test_a_pair_concept_set_up_on_the_page_shows_its_pairs_side_by_side_and_names_an_unpaired_control(
        app, chromium, tmp_path):
    """The demo's own concept checked on the Concepts tab first (its report, in the browser). Then path, role and a
    control folder (browsed) set in the row editor; the card shows the role and the folder; the dataset check
    shows the pairs side by side and names a control that has no target (one report for both); the caption
    editor shows an image beside its control. (The demo model takes no controls: the report is still made, under
    validate's refusal; a run on pairs needs an edit model.)"""
    from test_webui_e2e import open_fold, open_page, show
    url, ctx = app
    root = ctx.workspace / "pairs"
    for i, name in enumerate(("cat_01", "cat_02")):
        for folder, ext in (("targets", ".png"), ("control", ".jpg")):
            (root / folder).mkdir(parents=True, exist_ok=True)
            colour = (90 * i, 120, 200 if folder == "targets" else 20)
            Image.new("RGB", (64, 48), colour).save(root / folder / (name + ext))
        (root / "targets" / f"{name}.txt").write_text("make it blue\n")
    with open_page(url, height=1600, browser=chromium) as page:
        try:
            page.locator("#preset-select input").click()
            page.get_by_role("option", name="demo", exact=True).click()
            page.wait_for_function("document.querySelector('#form-messages').innerText.includes('demo')",
                                   timeout=30000)
            show(page, "Data", "Concepts")
            # the demo's own concept first: the report, in the browser
            page.locator("#concepts-dataset-btn").click()
            page.wait_for_function(
                "document.querySelector('#concepts-dataset-report').innerText.includes('Every image will train')",
                timeout=60000)
            text = page.locator("#concepts-dataset-report").inner_text()
            assert "8 used / 8 found" in text and "64x64" in text
            # the report's concept view is drawn a moment later (gr.render); a field typed into while it is drawn
            # can lose its text, as a user typing then would (Gradio's render replaces the page's components)
            page.locator("#concepts-pairs-0").first.wait_for(timeout=30000)

            open_fold(page, "Add or edit one concept")
            name_box = page.locator("#cfg-data-concepts-item-name textarea, #cfg-data-concepts-item-name input")
            name_box.first.fill("edits")
            page.locator("#cfg-data-concepts-item-path textarea, #cfg-data-concepts-item-path input").first.fill(
                str(root / "targets"))
            page.locator("#cfg-data-concepts-item-role input").click()
            page.get_by_role("option", name=re.compile("^validation — never trained on")).click()
            page.locator("#cfg-data-concepts-item-control-paths-new-browse").click()  # the page's file browser
            page.locator("#browser-entries").get_by_text("pairs/").click()
            page.locator("#browser-entries").get_by_text("control/").click()
            page.wait_for_function("document.querySelector('#browser-folder textarea, #browser-folder input')"
                                   ".value.endsWith('/pairs/control')", timeout=15000)
            page.locator("#browser-use-folder").click()  # Use adds it to the list at once
            controls = page.locator("#cfg-data-concepts-item-control-paths textarea").first
            page.wait_for_function("document.querySelector('#cfg-data-concepts-item-control-paths textarea')"
                                   ".value.endsWith('/pairs/control')", timeout=15000)
            assert controls.input_value() == str(root / "control")
            page.locator("#cfg-data-concepts-add").click()
            card = page.locator("#cfg-data-concepts-card-1").first
            card.wait_for(timeout=15000)
            page.wait_for_function("(document.querySelector('#cfg-data-concepts-card-1') || {innerText: ''})"
                                   ".innerText.includes('control folders')", timeout=15000)
            text = card.inner_text()
            assert "validation" in text and str(root / "control") in text and "(2 images)" in text
            assert card.locator(".atl-role-validation").count() == 1  # a badge: not mistaken for a subject

            started = time.time()
            Image.new("RGB", (64, 48)).save(root / "control" / "dog_01.png")  # a control with no target
            page.locator("#concepts-dataset-btn").click()  # one report: the pairs and the unpaired control
            page.locator("#concepts-pairs-1-gallery").first.wait_for(timeout=60000)
            gallery = page.locator("#concepts-pairs-1-gallery").first.inner_text()
            assert "target: cat_01.png" in gallery and "control 1: cat_01.jpg" in gallery and "cat_02.jpg" in gallery
            head = page.locator("#concepts-pairs-1-head").first.inner_text()
            assert "validation" in head and str(root / "control") in head
            assert "takes no control or reference images" in page.locator("#concepts-dataset-report").inner_text()
            page.wait_for_function("(document.querySelector('#concepts-pairs-1-unpaired') || {innerText: ''})"
                                   ".innerText.includes('dog_01.png')", timeout=60000)
            unpaired = page.locator("#concepts-pairs-1-unpaired").first.inner_text()
            assert "data.concepts.1.control_paths.0" in unpaired and "concept 1 ('edits')" in unpaired
            assert "Add the targets or remove those controls" in unpaired
            print(f"report round trip: {time.time() - started:.1f} s")

            # the caption editor shows the image being captioned beside its control
            show(page, "Captions and masks")
            open_fold(page, "Caption editor", exact=True)
            page.locator("#cap-folder textarea, #cap-folder input").first.fill(str(root / "targets"))
            page.locator("#cap-open").click()
            page.wait_for_function("(document.querySelector('#cap-control-note') || {innerText: ''})"
                                   ".innerText.includes(\"Concept 1 ('edits') pairs these images\")", timeout=30000)
            page.locator("#cap-gallery button img, #cap-gallery img").first.click()
            page.wait_for_function("(document.querySelector('#cap-pair') || {innerText: ''})"
                                   ".innerText.includes('control 1: cat_01.jpg')", timeout=30000)
            assert "image: cat_01.png" in page.locator("#cap-pair").first.inner_text()

            # a WD tagger run from the dataset tools adds its tags to the captions; they open in the caption editor
            from tiny_wd import write_tiny_wd_onnx
            tagger = write_tiny_wd_onnx(ctx.workspace / "tagger")
            open_fold(page, "Dataset tools: captions and masks", exact=True)
            page.locator("#tools-data-folder textarea, #tools-data-folder input").first.fill(str(root / "targets"))
            page.locator("#tools-data-model textarea, #tools-data-model input").first.fill(str(tagger))
            page.locator("#tools-data-append input").check()
            page.locator("#tools-data-run").click()
            page.wait_for_function("document.querySelector('#tools-data-msg').innerText.includes('Done')",
                                   timeout=60000)
            page.wait_for_function("(document.querySelector('#cap-gallery') || {innerText: ''})"
                                   ".innerText.includes('make it blue, 1girl, long hair')", timeout=30000)
            assert (root / "targets" / "cat_02.txt").read_text().startswith("make it blue, 1girl, long hair, ")
        except Exception:
            page.screenshot(path=str(tmp_path / "pairs-failure.png"), full_page=True)
            raise


def test_a_run_on_edit_pairs_starts_from_the_page_and_trains_on_them(app, chromium, tmp_path):
    """A config with a pair concept on the built-in tiny FLUX.1 Kontext (a file in the workspace) loaded into the
    page, started with Start: the run finishes its steps on the pairs and writes its LoRA."""
    import yaml

    from test_webui_e2e import open_page, wait_state
    from trainer.events import read_events
    url, ctx = app
    root = ctx.workspace / "pairs"
    for folder in ("targets", "control"):
        (root / folder).mkdir(parents=True)
    for name, (target, control) in {"00-red-square": ("00-red-square", "02-blue-square"),
                                    "03-blue-circle": ("03-blue-circle", "01-red-circle")}.items():
        Image.open(DEMO_DATA / f"{target}.png").save(root / "targets" / f"{name}.png")
        Image.open(DEMO_DATA / f"{control}.png").save(root / "control" / f"{name}.png")
        (root / "targets" / f"{name}.txt").write_text("swap the colour\n")
    config = ctx.workspace / "kontext-pairs.yaml"
    config.write_text(yaml.safe_dump({
        "base": "demo-flux", "model": {"path": "builtin:tiny-flux-kontext"},
        "data": {"concepts": [{"name": "edits", "path": str(root / "targets"), "control_paths": [str(root / "control")]}]},
        "training": {"max_steps": 2, "batch_size": 2}, "sampling": {"prompts": []}, "backup": {"every_n_epochs": 0}}))
    with open_page(url, browser=chromium) as page:
        try:
            page.locator("#config-path textarea, #config-path input").first.fill(str(config))
            page.locator("#load-file-btn").click()
            page.wait_for_function("document.querySelector('#form-messages').innerText.includes('kontext-pairs')",
                                   timeout=30000)
            page.locator("#start-btn").click()
            assert wait_state(page, ("finished", "failed", "died"), 240) == "finished", \
                page.locator("#run-problems").inner_text()
            status = page.locator("#run-status .atl-status")
            assert status.get_attribute("data-step") == status.get_attribute("data-total") == "2"
            run = ctx.workspace / "runs" / status.get_attribute("data-run")
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            raise
    started = next(e for e in read_events(run / "events.jsonl") if e["type"] == "started")
    assert started["steps_per_epoch"] == 1  # the two pairs make one batch of 2
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["concepts"][0]["control_paths"] == [str(root / "control")]
    assert (run / f"{run.name}.safetensors").is_file()
