"""The dataset report in the UI is the trainer's own, computed without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from trainer.config.checks import load_config

from test_webui_e2e import page_url  # noqa: F401  (fixture: the app served on a free port)

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
    assert text.startswith("⚠️")
    assert "never train" in text and "wide.png" in text
    assert "broken.png" in text
    ok = dataset_report(load_config(preset="demo"))
    assert ok.startswith("✅") and "8 images" in ok


def test_dataset_report_does_not_import_torch():
    code = ("import sys; from trainer.config.checks import load_config; from webui.tabs.tools import dataset_report;"
            "dataset_report(load_config(preset='demo')); assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_concepts_tab_shows_the_report_in_the_browser(page_url, tmp_path):
    from test_webui_e2e import open_page
    url, _ctx = page_url
    with open_page(url, height=1400) as page:
        page.locator("#preset-select input").click()
        page.get_by_role("option", name="demo", exact=True).click()
        page.wait_for_function("document.querySelector('#form-messages').innerText.includes('demo')",
                               timeout=30000)
        page.get_by_role("tab", name="Concepts", exact=True).click()
        page.locator("#concepts-dataset-btn").click()
        page.wait_for_function(
            "document.querySelector('#concepts-dataset-report').innerText.includes('Every image will train')",
            timeout=60000)
        text = page.locator("#concepts-dataset-report").inner_text()
        assert "8 used / 8 found" in text and "64x64" in text
        page.screenshot(path=str(tmp_path / "concepts-report.png"), full_page=True)
