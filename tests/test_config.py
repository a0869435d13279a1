"""The schema: merging, checks, messages, and the CLI paths that must not import torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config.load import _apply_overrides
from trainer.config.checks import config_from_dict, cross_field_warnings, load_config
from trainer.config.load import preset_names, save_config, to_yaml
from trainer.config.fields import all_keys, iter_fields
from trainer.config.schema import CONFIG_VERSION
from trainer.errors import ConfigError

from tests.conftest import preset_family

ROOT = Path(__file__).resolve().parent.parent


def test_every_field_has_help_and_a_check():
    for key, fld, tp in iter_fields():
        assert fld.metadata.get("help"), f"{key} has no help text"
        if tp in (int, float):
            assert "min" in fld.metadata and "max" in fld.metadata, f"{key} has no range"


def test_preset_user_file_and_overrides_merge_in_order(tmp_path):
    user = tmp_path / "run.yaml"
    user.write_text("base: demo\ntraining:\n  epochs: 3\n  batch_size: 1\n")
    cfg = load_config(user, ["training.epochs=5"])
    assert cfg.training.epochs == 5            # --set wins over the file
    assert cfg.training.batch_size == 1        # the file wins over the preset
    assert cfg.model.path == "builtin:tiny-sd"  # the preset fills the rest
    assert cfg.version == CONFIG_VERSION
    assert Path(cfg.data.concepts[0].path).is_dir()  # ${atelier_root:} resolves to the project


def test_a_choice_yaml_reads_as_a_boolean_is_the_word_written(tmp_path):
    """YAML 1.1 reads `no` as False: `--set training.mixed_precision=no`, `mixed_precision: no` in a file and the
    page's form were refused as 'False' (one of no, fp16, bf16); they are the choice 'no', and a saved config says so.
    A boolean word no choice is spelled as stays refused."""
    user = tmp_path / "run.yaml"
    user.write_text("base: demo\ntraining:\n  mixed_precision: no\n")
    for cfg in (load_config(preset="demo", overrides=["training.mixed_precision=no"]), load_config(user),
                config_from_dict({"base": "demo", "training": {"mixed_precision": False}})):
        assert cfg.training.mixed_precision == "no"
    save_config(cfg, tmp_path / "saved.yaml")
    assert "mixed_precision: 'no'" in (tmp_path / "saved.yaml").read_text()
    with pytest.raises(ConfigError, match="one of no, fp16, bf16"):
        load_config(preset="demo", overrides=["training.mixed_precision=yes"])


def test_a_text_setting_on_the_command_line_is_what_was_typed():
    """YAML 1.1 reads 0755 as octal, 1e3 as a float and on as a boolean: `--set general.run_name=0755` named the run
    folder 493. A text setting takes the typed text; numbers, booleans, quoted text and null are as YAML reads them."""
    for typed in ("0755", "1e3", "on", "2024-01-01"):
        cfg = load_config(preset="demo", overrides=[f"general.run_name={typed}", "training.epochs=0x10",
                                                    "training.compile=on", "data.concepts.0.caption_extension=1e3"])
        assert cfg.general.run_name == typed and cfg.data.concepts[0].caption_extension == "1e3"
        assert cfg.training.epochs == 16 and cfg.training.compile is True
    assert load_config(preset="demo", overrides=["general.run_name='0755'"]).general.run_name == "0755"
    with pytest.raises(ConfigError, match="general.run_name"):  # base 60 (750) before: now the name as typed
        load_config(preset="demo", overrides=["general.run_name=12:30"])


def test_saved_config_round_trips_exactly(tmp_path):
    cfg = load_config(preset="demo", overrides=["lora.rank=8"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert to_yaml(again) == to_yaml(cfg)


def test_overrides_applied_together_equal_overrides_applied_one_by_one():
    # runs of plain keys are merged in one step; the result must be what one merge per --set gives
    overrides = ["training.epochs=4", "training.optimizer={name: adamw, weight_decay: 0.05}",
                 "lora.custom_targets=[to_q, to_k]", "training.optimizer={eps: 1.0e-7}",
                 "data.concepts.0.repeats=3", "lora.rank=8", "lora.rank=16",
                 "sampling.prompts=[{prompt: a}, {prompt: b}]", "sampling.prompts=[{prompt: c}]",
                 "data.concepts.0.path=/x", "training.epochs=6"]
    together = load_config(preset="demo", overrides=overrides)
    one_by_one = load_config(preset="demo")
    for ov in overrides:
        one_by_one = _apply_overrides(one_by_one, [ov])
    assert to_yaml(together) == to_yaml(one_by_one)
    assert together.training.epochs == 6 and together.lora.rank == 16
    assert together.training.optimizer.weight_decay == 0.05 and together.training.optimizer.eps == 1.0e-7
    assert list(together.lora.custom_targets) == ["to_q", "to_k"]
    assert [p.prompt for p in together.sampling.prompts] == ["c"]
    assert together.data.concepts[0].repeats == 3 and together.data.concepts[0].path == "/x"


@pytest.mark.parametrize("override, words", [
    (["training.epoch=3"], ["unknown setting 'training.epoch'", "training.epochs"]),
    (["training.epochs=abc"], ["training.epochs", "'abc'", "whole number"]),
    (["training.epochs=0"], ["training.epochs", "out of range", "1"]),
    (["training.lr_scheduler=cosinus"], ["training.lr_scheduler", "cosinus", "cosine_with_restarts"]),
    (["lora.dropout=1.5"], ["lora.dropout", "out of range"]),
    (["sampling.prompts=[{prompt: x, width: 65}]"], ["sampling.prompts.0.width", "multiple of 8"]),
    # found by the fuzzed configs (tests/config_fuzz.py): these passed validate and failed in train
    (["general.gpu_ids=ünïcødé"], ["general.gpu_ids", "'ünïcødé' is not a GPU number"]),
    (["model.family=sd3.5-large"], ["model.family is sd3.5-large", "'builtin:tiny-sd' holds", "Set model.family to sd15"]),
])
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(preset="demo", overrides=override)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    newer = tmp_path / "newer.yaml"
    newer.write_text(f"version: {CONFIG_VERSION + 1}\n")
    with pytest.raises(ConfigError, match="newer than this Atelier"):
        load_config(newer)
    typo = tmp_path / "typo.yaml"
    typo.write_text("base: demo\ndata:\n  concepts:\n    - path: x\n      repeat: 3\n")
    with pytest.raises(ConfigError, match="repeat.*Did you mean 'data.concepts.repeats'"):
        load_config(typo)
    with pytest.raises(ConfigError, match="Unknown preset 'nope'"):
        load_config(preset="nope")



@pytest.mark.parametrize("text, key, words", [
    ("base: demo\ntraining: [1, 2]\n", "training", "training"),
    ("base: demo\ndata:\n  concepts: {a: 1}\n", "data.concepts", "concepts"),
    ("base: [demo, demo-flux]\n", "base", "names one preset"),
    ("data: x\n", "data", "data"),
])
def test_a_file_of_the_wrong_shape_is_named_with_its_setting(tmp_path, text, key, words):
    """A section written as a list, a list as a mapping, two bases: one message naming the file and setting, over a
    preset (base:) as well as alone."""
    path = tmp_path / "shape.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as err:
        load_config(path)
    assert err.value.key == key and str(path) in str(err.value) and "Traceback" not in str(err.value)


def test_a_file_nested_hundreds_of_levels_deep_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("training:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(400)) + "  " * 401 + "1\n")
    with pytest.raises(ConfigError) as err:
        load_config(deep)
    assert str(deep) in str(err.value) and len(str(err.value).splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", str(deep)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr and "deep" in out.stdout + out.stderr

def test_cross_field_warnings():
    cfg = config_from_dict({"base": "demo", "lora": {"rank": 4, "alpha": 8},
                            "sampling": {"prompts": [{"prompt": "x", "width": 512, "height": 512}]}})
    keys = {i.key for i in cross_field_warnings(cfg)}
    assert "lora.alpha" in keys and "sampling.prompts.0.width" in keys
    assert not cross_field_warnings(load_config(preset="demo"))


def test_cli_validate_and_help_do_not_import_torch(tmp_path):
    """validate stays torch-free, also where it asks every family to detect a model folder none of them claims
    (a family's detect.py importing torch cost every such validate seconds)."""
    (tmp_path / "unknown-model").mkdir()
    code = ("import sys, io, contextlib; sys.argv=['trainer','validate','--preset','demo','--json'];"
            "import trainer.__main__ as m; rc=m.main(sys.argv[1:]);\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    m.main(['validate', '--preset', 'demo', '--set', 'model.path={tmp_path / 'unknown-model'}'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"errors": [], "warnings": []}
    r = subprocess.run([sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "train" in r.stdout


def test_the_config_schema_imports_without_torch():
    """The schema is read by the web UI's first paint and ``validate``: its choices come from torch-free registries."""
    code = "import sys, trainer.config.schema; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_cli_config_typo_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer", "train", "--preset", "demo", "--set",
                        "training.learning_rat=1"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "training.learning_rat" in r.stderr and "training.learning_rate" in r.stderr
    assert "Traceback" not in r.stderr


def test_all_keys_cover_list_items():
    keys = all_keys()
    assert "data.concepts.path" in keys and "sampling.prompts.prompt" in keys


# --- version 2: per-part settings (parts.*); version-1 files, presets and --set keys migrate without loss ---

V1_PRESETS = Path(__file__).resolve().parent / "data" / "v1-presets"


def _tier_issues(cfg) -> dict:
    """The warnings of ``general.sized_for`` (a memory tier preset's settings undone), by field."""
    return {i.key: i.message for i in cross_field_warnings(cfg)
            if i.key == "general.sized_for" or "sized for" in i.message}


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_is_its_version_1_form_migrated(name):
    """tests/data/v1-presets holds the presets as they were in version 1 (base: names point at the copies).
    Each preset's other checks run on the config this test loads anyway (loading every preset again elsewhere cost
    seconds): its family offers a Quick start choice, and a memory tier preset (*-<N>gb) names itself in
    general.sized_for and, as shipped, undoes none of its tier's settings."""
    import yaml
    from omegaconf import OmegaConf

    from trainer.config.load import RENAMED_V1
    from trainer.families import infos
    old_file = V1_PRESETS / f"{name}.yaml"
    cfg = load_config(preset=name)
    offered = {info.name for info in infos().values() if info.quick_start}
    assert preset_family(name, cfg) in offered, f"{name} ships, but its family offers nothing in the Quick start"
    if name.endswith("gb"):
        assert cfg.general.sized_for == name and not _tier_issues(cfg), name
    new = OmegaConf.to_container(cfg, resolve=True)
    migrated = OmegaConf.to_container(load_config(old_file), resolve=True)
    assert migrated == new
    assert migrated["version"] == CONFIG_VERSION == 3
    raw = yaml.safe_load(old_file.read_text(encoding="utf-8"))
    for old_key, new_keys in RENAMED_V1.items():  # every old setting the file had is at its new place
        section, leaf = old_key.split(".")
        if leaf in (raw.get(section) or {}):
            for key in new_keys:
                assert OmegaConf.select(OmegaConf.create(migrated), key) == raw[section][leaf], (old_key, key)


def test_old_keys_still_work_on_the_command_line_and_in_a_version_1_file(tmp_path):
    cfg = load_config(None, ["training.train_text_encoder=true", "training.text_encoder_learning_rate=5e-5",
                             "model.text_encoder_dtype=bf16", "lora.unet_targets=all", "precision.fp8_unet=true",
                             "training.caption_dropout_te2=0.1"], preset="sdxl-lora")
    p = cfg.parts
    assert p.text_encoder_1.train and p.text_encoder_1.learning_rate == 5e-5
    assert p.text_encoder_1.dtype == p.text_encoder_2.dtype == "bf16" and p.text_encoder_3.dtype == "fp32"
    assert p.denoiser.lora_targets == "all" and p.denoiser.fp8 and p.text_encoder_2.caption_dropout == 0.1
    old_run = tmp_path / "config.yaml"  # what a version-1 run folder holds
    old_run.write_text("version: 1\nmodel:\n  path: builtin:tiny-sd\n  unet_dtype: bf16\ntraining:\n"
                       "  train_unet: false\n  train_text_encoder: true\n  text_encoder_stop_after_steps: 5\n"
                       "data:\n  concepts: []\n", encoding="utf-8")
    cfg = load_config(old_run)
    assert cfg.version == 3 and cfg.parts.denoiser.dtype == "bf16" and not cfg.parts.denoiser.train
    assert cfg.parts.text_encoder_1.train and cfg.parts.text_encoder_1.stop_after_steps == 5
    newer = tmp_path / "newer.yaml"
    newer.write_text("version: 4\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="newer than this Atelier"):
        load_config(newer)


def test_settings_of_a_part_the_family_lacks_are_named_as_ignored():
    issues = {i.key: i.message for i in cross_field_warnings(load_config(
        None, ["training.caption_dropout_te2=0.2", "parts.text_encoder_3.learning_rate=1e-5"], preset="demo"))}
    assert "Stable Diffusion 1.x/2.x has no text encoder 2: ignored" in issues["parts.text_encoder_2.caption_dropout"]
    assert "no text encoder 3" in issues["parts.text_encoder_3.learning_rate"]
    sdxl = {i.key for i in cross_field_warnings(load_config(None, ["training.caption_dropout_te2=0.2"],
                                                            preset="demo-sdxl"))}
    assert "parts.text_encoder_2.caption_dropout" not in sdxl


def test_a_memory_tier_presets_settings_undone_are_named_at_their_fields():
    """general.sized_for (set by every *-<N>gb preset): each memory setting changed to need more than the tier preset's
    is a warning at its field naming the card; unchanged or cheaper settings are not; an unknown preset is named.
    (Each tier preset as shipped: in test_every_shipped_preset_is_its_version_1_form_migrated.)"""
    def tier(preset, *overrides):
        return _tier_issues(load_config(preset=preset, overrides=list(overrides)))
    got = tier("flux-lora-16gb", "parts.denoiser.nf4=false", "training.batch_size=4", "data.resolution=1536",
               "data.offload_text_encoders=false", "training.optimizer.name=adamw", "lora.rank=8")
    assert set(got) == {"parts.denoiser.nf4", "training.batch_size", "data.resolution", "data.offload_text_encoders",
                        "training.optimizer.name"}
    assert "16 GB card" in got["parts.denoiser.nf4"] and "--card-gib 16" in got["training.batch_size"]
    assert set(tier("sdxl-lora-8gb", "training.gradient_checkpointing=false", "training.optimizer.name=adamw8bit")) == \
        {"training.gradient_checkpointing", "training.optimizer.name"}  # Adafactor → 8-bit states: more
    assert set(tier("flux-lora-24gb", "training.gradient_checkpointing_interval=2",
                    "training.checkpoint_keep_attention=true")) == \
        {"training.gradient_checkpointing_interval", "training.checkpoint_keep_attention"}
    assert set(tier("qwen-image-lora-16gb", "parts.denoiser.blocks_to_swap=40", "parts.text_encoder_1.fp8=false")) == \
        {"parts.text_encoder_1.fp8"}  # more swapped blocks need less
    assert not tier("sd15-lora", "training.batch_size=8")  # no tier: no check
    assert "no such preset" in tier("sd15-lora", "general.sized_for=sd15-lora-4gb")["general.sized_for"]


@pytest.mark.parametrize("preset", ["demo-flux", "demo-flux2-klein", "demo-chroma", "demo-sd3", "demo-zimage",
                                    "demo-qwen-image"])
def test_dora_on_a_family_whose_lora_layout_cannot_hold_it_is_refused_by_validate(preset):
    """It passed validate, trained every step and failed at save ("not written in the diffusers/peft layout")."""
    with pytest.raises(ConfigError) as err:
        load_config(preset=preset, overrides=["lora.type=dora"])
    assert err.value.key == "lora.type" and "fail at save" in str(err.value)
    load_config(preset=preset, overrides=["lora.type=dora", "training.method=finetune"])  # no adapter: no refusal


def test_validate_names_every_mistake_of_a_config_in_one_run_each_field_once(tmp_path):
    """Three different mistakes (an unknown key, a wrong type, a missing folder): three error lines, each naming
    its field once, and a non-zero exit. Before, validate stopped at the first and named the folder's field twice."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: demo\ntraining:\n  learning_rat: 0.001\n  max_steps: lots\ndata:\n  concepts:\n"
                   f"    - path: {tmp_path / 'no-such-folder'}\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "trainer", "validate", str(bad)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, r.stdout
    for line, key in zip(errors, ["training.learning_rat", "training.max_steps", "data.concepts.0.path"]):
        assert len(re.findall(rf"{re.escape(key)}(?!\w)", line)) == 1, line
    assert "Did you mean 'training.learning_rate'" in errors[0] and "'lots'" in errors[1]
    assert "does not exist" in errors[2] and r.stdout.rstrip().endswith("config has errors")


def test_load_config_raises_every_problem_and_one_problem_as_before():
    """Composing and the rules each collect: the error carries every problem with its own key (a key inside a
    list item by its full path); a single problem is raised as it always was."""
    from trainer.errors import ConfigErrors, every_error
    with pytest.raises(ConfigErrors) as err:
        load_config(preset="demo", overrides=["training.epoch=3", "data.concepts.0.repeats=many", "lora.dropout=1.5",
                                              "training.epochs=0", "sampling.prompts=[{prompt: x, width: 65}]"])
    keys = [e.key for e in every_error(err.value)]
    assert keys == ["training.epoch", "data.concepts.0.repeats", "training.epochs", "lora.dropout",
                    "sampling.prompts.0.width"], keys
    assert len(str(err.value).splitlines()) == 5
    with pytest.raises(ConfigError) as one:
        load_config(preset="demo", overrides=["training.epochs=0"])
    assert type(one.value) is ConfigError and one.value.key == "training.epochs"
    form = {"base": "demo", "training": {"learning_rat": 1, "batch_size": "two"}}
    with pytest.raises(ConfigErrors) as err:
        config_from_dict(form)
    assert [e.key for e in every_error(err.value)] == ["training.learning_rat", "training.batch_size"]
    assert form["training"] == {"learning_rat": 1, "batch_size": "two"}  # the caller's data is left as it was
    # the page's Check settings (webui/context.py) asks check_config: every problem, warnings included, no config
    from trainer.config.checks import check_config
    form["data"] = {"concepts": [{"path": "/no/such/folder"}]}
    form["lora"] = {"alpha": 64}
    cfg, issues = check_config(data=form)
    assert cfg is None
    assert [i.key for i in issues if i.level == "error"] == ["training.learning_rat", "training.batch_size",
                                                             "data.concepts.0.path"]
    assert "lora.alpha" in [i.key for i in issues if i.level == "warning"]


def test_resolution_shift_on_a_model_with_a_fixed_shift_is_named_as_ignored():
    """loss.resolution_shift only changes the draw where the scheduler shifts by the image size
    (use_dynamic_shifting: Flux.1 dev/Kontext, Chroma, Qwen-Image); elsewhere, or under a fixed loss.flow_shift,
    the objective keeps its fixed shift (trainer.objectives.FlowMatchingObjective._shifted), and validate says so."""
    def warned(preset, *overrides):
        issues = cross_field_warnings(load_config(preset=preset, overrides=["loss.resolution_shift=true", *overrides]))
        return [i.message for i in issues if i.key == "loss.resolution_shift"]
    for preset in ("demo-sd3", "demo-zimage", "demo-flux2-klein"):
        [line] = warned(preset)
        assert "is ignored" in line and "fixed shift" in line and "\n" not in line, line
    assert not warned("demo-flux") and not warned("demo-chroma") and not warned("demo-qwen-image")
    [line] = warned("demo-flux", "loss.flow_shift=3")
    assert "loss.flow_shift = 3" in line
    assert not any(i.key == "loss.resolution_shift" for i in cross_field_warnings(load_config(preset="demo-sd3")))
