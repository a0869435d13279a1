"""What an example is, on the page: a concept's role and control folders on its card, the dataset report's pairs
side by side with every unpaired target or control named, the caption editor's image beside its controls, and the
add / browse / remove of control folders and sample control images. Handlers are called directly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest
from omegaconf import OmegaConf
from PIL import Image

from trainer.config.checks import load_config
from trainer.config.schema import AtelierConfig, ConceptConfig
from trainer.data.report import concept_pairs
from webui import pairs
from webui.pathlist import add_path, remove_path

ROOT = Path(__file__).resolve().parent.parent


def make_pairs(root: Path, names=("cat_01", "cat_02", "cat_03"), stray=()) -> Path:
    """targets/<name>.png with its caption, control/<name>.jpg beside; ``stray``: controls with no target."""
    for i, name in enumerate(names):
        (root / "targets").mkdir(parents=True, exist_ok=True)
        (root / "control").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 24), (40 * i, 90, 200)).save(root / "targets" / f"{name}.png")
        (root / "targets" / f"{name}.txt").write_text(f"make {name} blue\n")
        Image.new("RGB", (32, 24), (200, 40 * i, 90)).save(root / "control" / f"{name}.jpg")
    for name in stray:
        Image.new("RGB", (32, 24)).save(root / "control" / f"{name}.png")
    return root


def data_cfg(*concepts: dict):
    """A composed config (no rules run: the demo model takes no controls, the data is what is checked here)."""
    node = OmegaConf.structured(AtelierConfig)
    return OmegaConf.merge(node, {"data": {"concepts": list(concepts)}})


def demo_with(**concept):
    """The demo preset with one more concept (appended as the schema's own item)."""
    cfg = load_config(preset="demo")
    cfg.data.concepts.append(OmegaConf.structured(ConceptConfig(**concept)))
    return cfg


# --------------------------------------------------------------------------------------------------
# the report's pairs (trainer side, torch-free)
# --------------------------------------------------------------------------------------------------

def test_the_report_lists_each_concepts_role_controls_and_pairs_and_names_every_unpaired_file(tmp_path):
    root = make_pairs(tmp_path, stray=("dog_01",))
    (root / "targets" / "cat_04.png").write_bytes((root / "targets" / "cat_01.png").read_bytes())  # no control
    cfg = data_cfg({"name": "edits", "path": str(root / "targets"), "control_paths": [str(root / "control")],
                    "role": "validation"},
                   {"name": "reg", "path": str(root / "control"), "role": "regularisation"},
                   {"name": "gone", "path": str(root / "targets"), "control_paths": [str(root / "nowhere")]})
    edits, reg, gone = concept_pairs(cfg)
    assert (edits["role"], edits["controls"]) == ("validation", [str(root / "control")])
    assert [Path(p["target"]).name for p in edits["pairs"]] == ["cat_01.png", "cat_02.png", "cat_03.png"]
    assert [Path(c).name for c in edits["pairs"][0]["controls"]] == ["cat_01.jpg"]
    assert edits["unpaired_targets"] == [{"file": "cat_04.png", "folder": str(root / "control")}]
    assert edits["unpaired_controls"] == [{"file": "dog_01.png", "folder": str(root / "control")}]
    # the line validate gives: the field, the concept, the file, what to do
    assert edits["error"].startswith("data.concepts.0.control_paths.0:") and "cat_04.png" in edits["error"]
    assert "concept 0 ('edits')" in edits["error"] and "Add them there" in edits["error"]
    assert (reg["role"], reg["controls"], reg["pairs"], reg["error"]) == ("regularisation", [], [], "")
    assert gone["missing_folders"] == [str(root / "nowhere")] and "does not exist" in gone["error"]
    assert gone["pairs"] == [] and gone["unpaired_targets"] == []  # the folder is the problem, not each image


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_the_pairs_listing_stays_torch_free(tmp_path):
    root = make_pairs(tmp_path)
    code = ("import sys; from omegaconf import OmegaConf; from trainer.config.schema import AtelierConfig;"
            "from trainer.data.report import concept_pairs; from webui import pairs;"
            f"cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig), {{'data': {{'concepts': [{{'path': "
            f"{str(root / 'targets')!r}, 'control_paths': [{str(root / 'control')!r}]}}]}}}});"
            "e = concept_pairs(cfg)[0]; assert len(e['pairs']) == 3; pairs.pair_gallery(e);"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------------------------------
# what the page shows of them
# --------------------------------------------------------------------------------------------------

def test_the_report_view_shows_roles_pairs_side_by_side_and_the_unpaired(tmp_path):
    root = make_pairs(tmp_path, stray=("dog_01",))
    edits, reg = concept_pairs(data_cfg(
        {"name": "edits", "path": str(root / "targets"), "control_paths": [str(root / "control")]},
        {"name": "faces", "path": str(root / "control"), "role": "regularisation"}))
    head = pairs.concept_head(edits)
    assert "concept 0" in head and "edits" in head and str(root / "control") in head and "atl-role" not in head
    reg_head = pairs.concept_head(reg)
    assert 'class="atl-role atl-role-regularisation"' in reg_head and "class images beside a subject" in reg_head
    assert "no control folders" in reg_head
    items = pairs.pair_gallery(edits, rows=2)  # row by row: target | control
    assert [caption for _, caption in items] == ["target: cat_01.png", "control 1: cat_01.jpg",
                                                 "target: cat_02.png", "control 1: cat_02.jpg"]
    assert max(items[0][0].size) <= pairs.THUMB
    assert pairs.pairs_caption(edits, rows=2) == "3 pairs (target | control 1), showing 2"
    text = pairs.unpaired_md(edits)
    assert text.startswith("Error: data.concepts.0.control_paths.0: 1 control image(s)") and "`dog_01.png`" in text
    assert "would not train" in text
    whole = concept_pairs(data_cfg({"path": str(make_pairs(tmp_path / "ok") / "targets"),
                                    "control_paths": [str(tmp_path / "ok" / "control")]}))[0]
    assert pairs.unpaired_md(whole).startswith("OK: All 3 images")
    assert pairs.role_badge("train") == "" and "never trained on" in pairs.role_badge("validation")


def test_the_dataset_check_on_the_page_shows_pairs_even_when_the_model_takes_no_controls(ui_app):
    ws, ctx = ui_app
    root = make_pairs(ws / "pairs", stray=("dog_01",))
    cfg = demo_with(name="edits", path=str(root / "targets"), role="validation",
                    control_paths=[str(root / "control")])
    text, entries = ctx.handlers["concepts_dataset_pairs"](*ctx.form.values_for(cfg))
    assert "takes no control or reference images" in text  # validate's refusal comes first …
    assert "The report below is of the images as they are" in text
    assert "dog_01.png" in text  # … then the data report's own line naming the stray control
    shapes, edits = entries
    assert shapes["role"] == "train" and not shapes["controls"]
    assert edits["role"] == "validation" and len(edits["pairs"]) == 3
    assert edits["unpaired_controls"] == [{"file": "dog_01.png", "folder": str(root / "control")}]
    ok, _ = ctx.handlers["concepts_dataset_pairs"](*ctx.form.values_for(load_config(preset="demo")))
    assert ok.startswith("OK:")


def test_the_concept_role_dropdown_explains_each_role(ui_app):
    _, ctx = ui_app
    editor = ctx.form.editors["data.concepts"]
    role = editor.items[[c.key for c in editor.spec.items].index("role")]
    labels = dict((value, label) for label, value in role.choices)
    assert list(labels) == ["train", "validation", "regularisation", "prior_prediction"]
    assert labels["validation"].startswith("validation — never trained on")
    assert labels["regularisation"].startswith("regularisation — class images beside a subject")
    assert labels["prior_prediction"].startswith("prior_prediction — LoRA: the target is the base model's")


# --------------------------------------------------------------------------------------------------
# control folders and sample control images: add, browse, remove
# --------------------------------------------------------------------------------------------------

def test_control_paths_are_added_and_removed_within_the_allowed_folders(ui_app, tmp_path):
    ws, ctx = ui_app
    root = make_pairs(ws / "lists")
    allowed = ctx.roots.allowed
    text, note = add_path("", str(root / "control"), "folder", allowed)
    assert text == str(root / "control") and note.startswith("Added")
    assert "in the list already" in add_path(text, str(root / "control"), "folder", allowed)[1]
    assert "outside the folders" in add_path(text, str(tmp_path), "folder", allowed)[1]
    assert "does not exist" in add_path(text, str(ws / "nope"), "folder", allowed)[1]
    assert "is a file" in add_path(text, str(root / "control" / "cat_01.jpg"), "folder", allowed)[1]
    assert "is a folder" in add_path("", str(root / "control"), "file", allowed)[1]
    assert add_path("", str(root / "control" / "cat_01.jpg"), "file", allowed)[0].endswith("cat_01.jpg")
    assert remove_path(text, str(root / "control")) == ("", f"Removed `{root / 'control'}`.")

    editor = ctx.form.editors["data.concepts"]
    plist = editor.path_lists["control_paths"]
    assert plist.new in ctx.browser.targets  # browsable like every path field
    table = ctx.form.values_for(load_config(preset="demo"))[[s.key for s in ctx.form.specs].index("data.concepts")]
    box, new_table, note, cleared = plist.on_add("", str(root / "control"), table, 0)  # row 0 being edited
    assert box == str(root / "control") and cleared == "" and "Saved into row 0" in note
    col = [c.key for c in editor.spec.items].index("control_paths")
    assert new_table[0][col] == str(root / "control")
    box, skipped, note, _ = plist.on_add("", str(root / "control"), table, None)  # a new row: kept in the box
    assert box == str(root / "control") and skipped == gr.skip() and "Add as new row" in note
    box, new_table, note = plist.on_remove(box, str(root / "control"), new_table, 0)
    assert box == "" and new_table[0][col] == "" and note.startswith("Removed")
    prompts = ctx.form.editors["sampling.prompts"].path_lists["control_images"]
    assert prompts.kind == "file" and prompts.new in ctx.browser.targets


# --------------------------------------------------------------------------------------------------
# the caption editor
# --------------------------------------------------------------------------------------------------

def test_the_caption_editor_shows_an_images_controls_and_names_one_without(ui_app):
    ws, ctx = ui_app
    root = make_pairs(ws / "captions")
    Image.new("RGB", (32, 24)).save(root / "targets" / "cat_09.png")  # no control: would not train
    cfg = demo_with(name="edits", path=str(root / "targets"), control_paths=[str(root / "control")])
    table = ctx.form.values_for(cfg)[[s.key for s in ctx.form.specs].index("data.concepts")]
    controls, line = ctx.handlers["captions_controls"](str(root / "targets"), table)
    assert controls == str(root / "control")
    assert line.startswith("Concept 1 ('edits') pairs these images with 1 control folder(s): 3 of 4")
    assert "`cat_09.png`" in line and "would not train" in line
    assert ctx.handlers["captions_controls"](str(root / "control"), table) == ["", ""]  # not a concept's folder
    gallery, note = ctx.handlers["captions_pair"](str(root / "targets"), controls, "cat_02.png")
    assert [c for _, c in gallery["value"]] == ["image: cat_02.png", "control 1: cat_02.jpg"]
    assert gallery["visible"] and "instruction" in note
    gallery, note = ctx.handlers["captions_pair"](str(root / "targets"), controls, "cat_09.png")
    assert note.startswith("Error: `cat_09.png` has no control image") and "it would not train" in note
    assert "outside the folders" in ctx.handlers["captions_pair"](str(root / "targets"), "/etc", "cat_02.png")[1]


def test_the_dataset_check_runs_on_a_thread_of_its_own_and_ends_with_the_report(ui_app):
    _, ctx = ui_app
    values = ctx.form.values_for(load_config(preset="demo"))
    steps = list(ctx.handlers["concepts_dataset_checking"](*values))
    assert all(text.startswith("Checking the dataset") for text, _ in steps[:-1])
    assert steps[-1] == ctx.handlers["concepts_dataset_pairs"](*values) and steps[-1][0].startswith("OK:")
