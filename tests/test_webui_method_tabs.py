"""LoRA and Embedding settings are shown only while training.method uses them, and per-part fields follow the
model's family, in a real browser."""

from __future__ import annotations

import pytest

from test_webui_e2e import page_url  # noqa: F401  (fixture: the app served on a free port)
from webui.form import method_tab_visibility

pytestmark = pytest.mark.slow


def choose(page, preset: str) -> None:
    """Pick a preset in the config bar and wait until the form says it loaded."""
    page.locator("#preset-select input").click()
    page.get_by_role("option", name=preset, exact=True).click()
    page.wait_for_function(f"document.querySelector('#form-messages').innerText.includes('{preset}')",
                           timeout=30000)


def test_visibility_rules():
    assert method_tab_visibility("lora", False) == {"lora": True, "embedding": False}
    assert method_tab_visibility("finetune", False) == {"lora": False, "embedding": False}
    assert method_tab_visibility("finetune", True) == {"lora": False, "embedding": True}
    assert method_tab_visibility("embedding", False) == {"lora": False, "embedding": True}


def set_model_path(page, path: str) -> None:
    """Type model.path on the Model tab, as a user would (the family follows on its change)."""
    page.locator("#cfg-model-path textarea, #cfg-model-path input").first.fill(path)


def test_method_tabs_and_family_parts_follow_the_form_in_the_browser(page_url):
    """LoRA settings follow training.method and keep their values while hidden; model.path → the family told
    from the registry (no model load) with its parts named, per-part fields hidden when the family lacks the
    part and carrying the part's name when it has it; a video family's clip fields shown for it alone. One browser
    session for all. Each click on this page costs the browser one to three seconds of CPU (a preset load as
    much), so the steps are ordered to need few: three preset loads, then model.path typed on the Model tab (all
    that demo-wan and demo-cascade change of the demo's model)."""
    from test_webui_e2e import open_fold, open_page, show
    url, ctx = page_url

    with open_page(url) as page:
        page.get_by_role("tab", name="LoRA", exact=True).click()
        choose(page, "demo-finetune")
        page.locator("#tab-note-lora").wait_for(state="visible", timeout=20000)
        assert not page.locator("#tab-body-lora").is_visible()
        choose(page, "demo-sdxl")  # a LoRA again
        page.locator("#tab-body-lora").wait_for(state="visible", timeout=20000)
        assert not page.locator("#tab-note-lora").is_visible()
        rank = page.locator("#tab-body-lora input[type=number]").first
        assert rank.input_value() == "4"  # the demo's lora.rank survived being hidden
        page.get_by_role("tab", name="Model", exact=True).click()
        page.wait_for_function("document.querySelector('#family-parts').innerText.includes('OpenCLIP-G')",
                               timeout=20000)
        assert "SDXL" in page.locator("#family-parts").inner_text()
        page.get_by_role("tab", name="Parts", exact=True).click()
        te2 = page.locator("#cfg-parts-text-encoder-2-train")
        te2.wait_for(state="visible", timeout=20000)
        assert "OpenCLIP-G" in te2.inner_text()
        choose(page, "demo")
        te2.wait_for(state="hidden", timeout=20000)
        assert "CLIP text encoder" in page.locator("#cfg-parts-text-encoder-1-train").inner_text()
        assert not page.locator("#cfg-parts-text-encoder-3-train").is_visible()  # no third encoder in SD
        page.get_by_role("tab", name="Model", exact=True).click()
        page.wait_for_function(
            "document.querySelector('#family-parts').innerText.includes('Stable Diffusion 1.x/2.x')", timeout=20000)
        effnet = page.locator("#cfg-model-effnet-path")
        assert not effnet.is_visible()  # a Stable Cascade setting: not shown for SD
        # a concept's clip settings (what a folder of clips is cut into) show for a video family alone
        show(page, "Data", "Concepts")
        open_fold(page, "Add or edit one concept")
        frames = page.locator("#cfg-data-concepts-item-target-frames")
        page.locator("#cfg-data-concepts-item-name").first.wait_for(state="visible", timeout=20000)
        assert not frames.is_visible()  # SD trains on images
        show(page, "Train")  # back on the Model tab
        set_model_path(page, "builtin:tiny-wan21")  # demo-wan's model
        page.wait_for_function("document.querySelector('#family-parts').innerText.includes('Wan')", timeout=20000)
        show(page, "Data")
        frames.wait_for(state="visible", timeout=20000)
        assert page.locator("#cfg-data-concepts-item-frame-extraction").is_visible()
        show(page, "Train")
        set_model_path(page, "builtin:tiny-cascade")  # demo-cascade's: from a video family to an image one
        page.wait_for_function("document.querySelector('#family-parts').innerText.includes('Stable Cascade')",
                               timeout=20000)
        effnet.wait_for(state="visible", timeout=20000)
        assert "Prior (stage C)" in page.locator("#family-parts").inner_text()
        assert "cosine" in page.locator("#family-parts").inner_text()
        show(page, "Data")
        frames.wait_for(state="hidden", timeout=20000)  # Stable Cascade trains on images
