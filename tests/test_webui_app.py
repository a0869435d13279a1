"""The UI process: no torch, login required when asked, --share refused without a password,
and the page's live poll reattaching to a run it did not start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from webui.app import SHARE_NO_AUTH_FLAG, auth_pairs, build_app, main, parse_args, serve

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_the_ui_process_imports_neither_torch_nor_diffusers_and_python_dash_m_webui_helps(tmp_path):
    """One interpreter for all three checks (each start imports Gradio, seconds of CPU): the built page and the
    dataset report (the trainer's own, on the demo's concept) leave torch, diffusers and transformers out, then
    ``python -m webui --help`` (run as ``-m`` runs it) lists its flags."""
    code = ("import runpy, sys; from webui.app import build_app; build_app(sys.argv[1], start_scheduler=False); "
            "from trainer.config.checks import load_config; from webui.tabs.tools import dataset_report; "
            "dataset_report(load_config(preset='demo')); "
            "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; print('ok', flush=True); "
            "sys.argv = ['webui', '--help']; runpy.run_module('webui', run_name='__main__', alter_sys=True)")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.startswith("ok\n"), out.stderr[-2000:]
    assert "--share" in out.stdout and "--auth" in out.stdout


SERVED_APPS: dict = {}  # url -> the served app, for the tests that walk its routes


@pytest.fixture
def served(tmp_path):
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    _, url, _ = serve(demo, port=None, auth=[("ada", "s3cret")], prevent_thread_lock=True, quiet=True)
    SERVED_APPS[url] = demo.server_app
    yield url
    SERVED_APPS.pop(url, None)
    demo.close()


def _served_routes(routes, prefix: str = ""):
    """(path, method) of every route of a served app, routers included under their prefix."""
    for route in routes:
        original = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        if original is not None:
            yield from _served_routes(original.routes, prefix + getattr(route.include_context, "prefix", ""))
        elif hasattr(route, "path"):
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                yield prefix + route.path, method


def test_with_auth_a_request_without_credentials_is_refused(served, tmp_path):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(served.rstrip("/") + "/config", timeout=30)
    assert err.value.code in (401, 403)
    from gradio_client import Client
    with pytest.raises(Exception):
        Client(served, verbose=False)
    with pytest.raises(Exception):
        Client(served, auth=("ada", "wrong"), verbose=False)
    client = Client(served, auth=("ada", "s3cret"), verbose=False)  # the right password gets in
    assert client.view_api(print_info=False, return_format="dict") is not None
    # before login the page is the login form: no description of the endpoints, no server paths
    page = urllib.request.urlopen(served, timeout=30).read().decode()
    assert '"auth_required":true' in page.replace(" ", "") and len(page) < 200_000
    assert "named_endpoints\":{}" in page.replace(" ", "") or "named_endpoints" not in page
    assert "/_go" not in page and str(tmp_path) not in page  # the workspace (a server path) is not named
    # every route but the login form's refuses without a login, the streams Gradio itself leaves open included
    import httpx

    from webui.login import is_public
    base = served.rstrip("/")
    with httpx.Client(timeout=10) as anonymous:
        with anonymous.stream("GET", f"{base}/gradio_api/heartbeat/anyone") as beat:  # would stay open
            assert beat.status_code == 401
        leaks = []
        routes = sorted(set(_served_routes(SERVED_APPS[served].router.routes)))
        for path, method in routes:
            if is_public(path) or method not in ("GET", "POST"):
                continue
            url = base + re.sub(r"\{[^}]*\}", "x", path)
            with anonymous.stream(method, url) as answer:
                if answer.status_code not in (401, 403):
                    leaks.append((method, path, answer.status_code))
        assert len(routes) >= 40 and not leaks, (len(routes), leaks)


def test_share_without_auth_refuses_to_start(tmp_path, capsys):
    assert main(["--share", "--workspace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "refusing to --share without a password" in err and SHARE_NO_AUTH_FLAG in err
    assert not (tmp_path / "runs").exists()  # nothing was built or served


def test_auth_from_flags_and_file(tmp_path):
    f = tmp_path / "users.txt"
    f.write_text("# team\nbob:pw2\n\ncarol:pa:ss\n")
    assert auth_pairs(["ada:pw1"], str(f)) == [("ada", "pw1"), ("bob", "pw2"), ("carol", "pa:ss")]
    with pytest.raises(ValueError):
        auth_pairs(["nopassword"], None)
    assert main(["--auth", "broken", "--workspace", str(tmp_path)]) == 2


def test_command_line_flags():
    args = parse_args(["--listen", "--port", "9000", "--share", "--auth", "a:b", "--auth", "c:d",
                       "--root-path", "/atelier", "--inbrowser", "--workspace", "/tmp/w", "--browse-root", "/data",
                       SHARE_NO_AUTH_FLAG])
    assert args.listen and args.port == 9000 and args.share and args.auth == ["a:b", "c:d"]
    assert args.root_path == "/atelier" and args.inbrowser and args.workspace == "/tmp/w"
    assert args.browse_root == ["/data"] and args.share_without_auth
    defaults = parse_args([])
    assert defaults.port == 7860 and not defaults.listen and not defaults.share


def test_live_poll_follows_a_run_started_elsewhere(tmp_path, monkeypatch):
    """A fresh page (or UI) finds the running job by itself: the run folder is the state."""
    from test_webui_runner import fake_config, fake_trainer_argv, state_of, wait_for
    from webui import runner
    from webui.jobqueue import Job
    from webui.runner import RunManager
    # 3 s a step: the fake trainer samples every 5 steps, so no sample lands before the second poll below even on a
    # loaded machine (at 0.1 s one every 0.5 s did, and the gallery was rightly sent again; a poll can take seconds there)
    monkeypatch.setenv("FAKE_STEP_SECONDS", "3")
    ws = tmp_path / "ws"
    elsewhere = RunManager(ws, trainer_argv=fake_trainer_argv(tmp_path))
    _, run_dir, _ = elsewhere.submit(Job(name="bg", config_yaml=fake_config("", 300)))
    wait_for(lambda: state_of(run_dir) == "running", 30, "running")
    ctx = build_app(ws, start_scheduler=False).atelier  # a UI that did not start it
    out = ctx.handlers["poll"]("(follow the current run)", "newest first", {})
    status = out[0]
    assert 'data-state="running"' in status and 'data-run="bg"' in status
    again = ctx.handlers["poll"]("(follow the current run)", "newest first", out[-2])  # the seen-state
    assert isinstance(again[3], dict) and again[3].get("__type__") == "update"  # unchanged gallery is skipped
    runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped", 30, "stopped")
    out = ctx.handlers["poll"]("bg", "newest first", {})
    assert 'data-state="stopped"' in out[0] and "Backup" in out[0]


def test_colab_notebook_installs_and_starts_the_ui_with_share_and_auth():
    import json
    import shlex
    nb = json.loads((ROOT / "notebooks" / "colab.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("pip install -q -e ." in s for s in sources)
    assert any("MyDrive" in s and "WORKSPACE" in s for s in sources)
    start = next(s for s in sources if "-m webui" in s)
    argv = shlex.split(start.split("-m webui", 1)[1].replace("{USER}:{PASSWORD}", "u:p")
                       .replace('"{WORKSPACE}"', "/ws"))
    args = parse_args(argv)
    assert args.share and args.auth == ["u:p"] and args.workspace == "/ws"


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_runs_tab_resumes_a_stopped_run_and_reuses_its_config(tmp_path, monkeypatch):
    from test_webui_runner import fake_config, fake_trainer_argv, state_of, wait_for
    from webui import runner
    from webui.jobqueue import Job
    from webui.runner import RunManager
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.1")
    ws = tmp_path / "ws"
    manager = RunManager(ws, trainer_argv=fake_trainer_argv(tmp_path))
    ctx = build_app(ws, manager=manager, start_scheduler=False).atelier
    _, run_dir, _ = manager.submit(Job(name="r", config_yaml=fake_config("", 40)))
    wait_for(lambda: state_of(run_dir) == "running", 30, "running")
    assert "still running" in ctx.handlers["resume_run"]("r")[0]
    runner.stop(run_dir)
    wait_for(lambda: state_of(run_dir) == "stopped" and not runner.process_alive(run_dir), 30, "stopped")
    summary = ctx.handlers["run_details"]("r")[0]
    assert "Stopped" in summary and "backup" in summary
    out = ctx.handlers["resume_run"]("r")
    assert "Resuming" in out[0] and out[2].selected == "run"
    assert json_cmd(run_dir)[-2:] == ["--resume", "last"]
    wait_for(lambda: state_of(run_dir) == "finished", 30, "finished after resume")
    wait_for(lambda: not runner.process_alive(run_dir), 30, "exit")
    launched = json_cmd(run_dir)
    assert "nothing left to resume" in ctx.handlers["resume_run"]("r")[0]  # a finished run is not trained again
    assert "nothing left to resume" in ctx.handlers["run_resume"]("r")[0]  # nor from the live-run panel
    assert json_cmd(run_dir) == launched and not manager.queue.list()
    # a reload after Resume lands on the live run; a tab remembered from before the page was arranged by task
    # opens inside its task tab
    from webui.tabs.config_bar import write_ui_state
    main_tab, train_tab, data_tab = ctx.handlers["on_load"]()[-4:-1]
    assert main_tab.selected == "run" and train_tab.get("__type__") == data_tab.get("__type__") == "update"
    write_ui_state(ctx, tab="sampling")
    main_tab, train_tab, _ = ctx.handlers["on_load"]()[-4:-1]
    assert main_tab.selected == "train" and train_tab.selected == "sampling"
    (run_dir / "config.yaml").write_text("training:\n  epochs: 3\ngeneral:\n  run_name: old\n")
    values = ctx.handlers["reuse_config"]("r")
    keys = [s.key for s in ctx.form.specs]
    assert values[keys.index("training.epochs")]["value"] == 3
    assert values[keys.index("general.run_name")]["value"] == ""  # a new run gets a new name


def json_cmd(run_dir):
    import json
    return json.loads((run_dir / "launch.json").read_text())["cmd"]


def test_logins_are_rate_limited_and_compared_in_constant_time():
    from webui.app import RateLimitedAuth
    now = [1000.0]
    auth = RateLimitedAuth([("ada", "s3cret")], limit=5, window=60, cooldown=30, clock=lambda: now[0])
    assert auth("ada", "s3cret")
    for _ in range(50):  # a brute force: after 5 misses even the right password is refused for a while
        assert not auth("ada", "guess")
    assert not auth("ada", "s3cret")
    now[0] += 31
    assert auth("ada", "s3cret") and not auth("eve", "s3cret")


def test_the_served_page_uses_the_rate_limited_login(served):
    from gradio_client import Client
    for _ in range(5):
        with pytest.raises(Exception):
            Client(served, auth=("ada", "wrong"), verbose=False)
    with pytest.raises(Exception):  # locked out: the right password waits for the cool-down
        Client(served, auth=("ada", "s3cret"), verbose=False)


def test_listen_without_auth_warns_loudly(tmp_path, capsys, monkeypatch):
    import webui.app as app
    calls = []
    monkeypatch.setattr(app, "serve", lambda demo, **kw: calls.append(kw))
    assert app.main(["--listen", "--workspace", str(tmp_path)]) == 0
    assert calls and calls[0]["host"] == "0.0.0.0"
    assert "--listen without --auth" in capsys.readouterr().err
    assert app.main(["--listen", "--auth", "a:b", "--workspace", str(tmp_path)]) == 0
    assert "--listen without --auth" not in capsys.readouterr().err


def test_a_run_zip_leaves_backups_out_takes_results_saved_elsewhere_and_is_remade_only_after_a_change(tmp_path):
    import zipfile

    from webui.downloads import result_file, zip_run
    ws, run_dir, elsewhere = tmp_path / "ws", tmp_path / "ws" / "runs" / "r", tmp_path / "exports"
    for rel, text in {"config.yaml": "a: 1\n", "events.jsonl": "{}\n", "samples/s1.png": "png",
                      "backups/backup-step000010/state.json": "{}", "control/stop": "{}", "trainer.lock": "x",
                      ".hidden.tmp": "x"}.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    elsewhere.mkdir()
    (elsewhere / "r.safetensors").write_bytes(b"lora")
    (elsewhere / "ft").mkdir()
    (elsewhere / "ft" / "model_index.json").write_text("{}")
    outputs = [str(elsewhere / "r.safetensors"), str(elsewhere / "ft")]
    first = zip_run(ws, run_dir, outputs)
    with zipfile.ZipFile(first) as z:
        assert sorted(z.namelist()) == ["config.yaml", "events.jsonl", "results/ft/model_index.json",
                                        "results/r.safetensors", "samples/s1.png"]
    stamp = first.stat().st_mtime_ns
    assert zip_run(ws, run_dir, outputs).stat().st_mtime_ns == stamp  # nothing changed: the same zip
    time.sleep(0.01)
    (run_dir / "samples" / "s2.png").write_text("png")
    with zipfile.ZipFile(zip_run(ws, run_dir, outputs)) as z:
        assert "samples/s2.png" in z.namelist()
    assert result_file(outputs) == elsewhere / "r.safetensors"  # the newest single file
    assert result_file([str(elsewhere / "ft")]) is None  # a folder result goes home as the zip
    with pytest.raises(FileNotFoundError):
        zip_run(ws, tmp_path / "nope")


def test_warnings_emitted_before_started_show_with_their_launch(tmp_path):
    from webui.monitor import build_view
    run = tmp_path / "r"
    run.mkdir()
    events = [{"type": "warning", "message": "old launch's warning", "time": 1},
              {"type": "started", "time": 2, "total_steps": 10}, {"type": "stopped", "step": 3, "time": 3},
              {"type": "warning", "message": "2 images are too small and were dropped: a.png, b.png", "time": 4},
              {"type": "started", "time": 5, "total_steps": 10, "resumed_from_step": 3},
              {"type": "warning", "message": "late warning", "time": 6}]
    view = build_view(run, events)
    assert view.warnings == ["2 images are too small and were dropped: a.png, b.png", "late warning"]


def test_cancelling_a_job_that_already_left_the_queue_says_so(tmp_path):
    from webui.jobqueue import Job
    ctx = build_app(tmp_path / "ws", start_scheduler=False).atelier
    job = ctx.manager.queue.add(Job(name="later", config_yaml="{}"))
    out = ctx.handlers["queue_drop"](job.id)
    assert "Cancelled **later**" in out[-1] and not ctx.manager.queue.list()
    assert "no longer waiting" in ctx.handlers["queue_drop"](job.id)[-1]  # the page was stale: no server error
    assert "no longer waiting" in ctx.handlers["queue_move"](job.id, -1)[-1]
    assert "Pick a job" in ctx.handlers["queue_drop"](None)[-1]


def test_the_start_here_line_names_presets_that_exist():
    import re

    from trainer.config.load import preset_names
    from webui.app import START_HERE
    named = re.findall(r"`([a-z0-9-]+)`", START_HERE)
    assert "demo" in named and set(named) <= set(preset_names())


@pytest.mark.slow
def test_deleting_a_run_asks_first_refuses_a_running_one_and_removes_folder_and_zip(tmp_path, monkeypatch):
    from test_webui_runner import fake_config, fake_trainer_argv, state_of, wait_for
    from webui import runner
    from webui.downloads import zip_run
    from webui.jobqueue import Job
    from webui.runner import RunManager
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.05")
    ws = tmp_path / "ws"
    manager = RunManager(ws, trainer_argv=fake_trainer_argv(tmp_path))
    ctx = build_app(ws, manager=manager, start_scheduler=False).atelier
    delete = ctx.handlers["delete_run"]
    _, done, _ = manager.submit(Job(name="done", config_yaml=fake_config("", 5)))
    wait_for(lambda: state_of(done) == "finished" and not runner.process_alive(done), 30, "finished")
    _, busy, _ = manager.submit(Job(name="busy", config_yaml=fake_config("", 100000)))
    wait_for(lambda: state_of(busy) == "running", 30, "running")
    try:
        assert "still running" in delete("busy", "busy")[0] and busy.is_dir()
        zipped = zip_run(ws, done)
        first = delete("done", "")
        assert "cannot be undone" in first[0] and first[1] == "done" and done.is_dir()  # asked, nothing deleted
        assert "cannot be undone" in delete("done", "busy")[0] and done.is_dir()  # armed for another run
        gone = delete("done", "done")
        assert "Deleted **done**" in gone[0] and not done.exists() and not zipped.exists()
        assert "done" not in ctx.run_names() and "busy" in ctx.run_names()
    finally:
        runner.stop(busy, force=True)


@pytest.mark.slow
def test_the_vram_estimate_runs_the_trainers_estimator_on_the_form_and_says_whether_it_fits(tmp_path, monkeypatch):
    from trainer.config.checks import load_config
    from webui import vram
    runs = []
    real = vram.run_estimator
    monkeypatch.setattr(vram, "run_estimator", lambda *a, **k: runs.append(1) or real(*a, **k))
    monkeypatch.setattr(vram, "_kept", type(vram._kept)())
    ctx = build_app(tmp_path / "ws", start_scheduler=False).atelier
    # the demo without its sample prompts: the estimator skips the sampling phase (a sixth of its CPU), and the
    # peak is the training step's either way
    values = ctx.form.values_for(load_config(preset="demo", overrides=["sampling.prompts=[]"]))
    fits = ctx.handlers["vram_estimate"](8, *values)
    assert fits.startswith("OK:") and "Estimated peak" in fits and "Fits a 8 GiB card" in fits
    tight = ctx.handlers["vram_estimate"](0.5, *values)  # the CUDA context alone is 0.75 GiB
    assert tight.startswith("Error:") and "Does **not** fit a 0.5 GiB" in tight and "gradient_checkpointing" in tight
    assert len(runs) == 1  # another card size: the same config's estimate, judged again
    peak = float(re.search(r"Estimated peak: ([0-9.]+) GiB", fits).group(1))
    spare = float(re.search(r"with ([0-9.]+) GiB to spare", fits).group(1))
    assert abs(peak + spare - 8) < 0.011
    bad = list(values)
    bad[[s.key for s in ctx.form.specs].index("training.batch_size")] = 0
    assert "Fix the settings first" in ctx.handlers["vram_estimate"](8, *bad)


def test_comparing_runs_overlays_their_losses_and_puts_samples_side_by_side_by_prompt(tmp_path):
    import json
    ctx = build_app(tmp_path / "ws", start_scheduler=False).atelier
    for name, losses in (("a", [1.0, 0.8, 0.6]), ("b", [1.0, 0.9, 0.85])):
        run = tmp_path / "ws" / "runs" / name
        (run / "samples").mkdir(parents=True)
        events = [{"type": "started", "time": 1, "total_steps": 3}]
        events += [{"type": "step", "step": i + 1, "loss": v, "time": 2 + i} for i, v in enumerate(losses)]
        events += [{"type": "sample", "step": 3, "prompts": ["a red square", "a blue circle"], "time": 6},
                   {"type": "finished", "step": 3, "time": 7}]
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        for step in (2, 3):
            for i in (0, 1):
                (run / "samples" / f"step{step:06d}-p{i}.png").write_bytes(b"png")
    frame, samples = ctx.handlers["compare_runs"](["a", "b"])
    assert set(frame["series"]) == {"a", "b"} and len(frame) == 6
    assert frame[frame.series == "a"].value.iloc[-1] < frame[frame.series == "b"].value.iloc[-1]  # a learned faster
    assert [c for _, c in samples] == ["a · step 3 · a red square", "b · step 3 · a red square",
                                       "a · step 3 · a blue circle", "b · step 3 · a blue circle"]
    assert ctx.handlers["compare_runs"]([]) == [None, []]


def test_every_full_lora_preset_with_memory_tiers_has_a_tier_of_its_own_above_them():
    """A card bigger than every smaller tier gets the full preset (its own tier: the preset unchanged, at the card its
    estimate fits) or, where the estimate fits a card with less of it, the preset without gradient checkpointing or
    with every second block checkpointed; not the largest smaller tier with its fp8, offloading and checkpointing."""
    import yaml

    from trainer.config.load import PRESETS_DIR
    from trainer.families import quick_choices
    from trainer.memory.tiers import card_gib
    from webui.tabs.quickstart import memory_tiers
    for choice in quick_choices().values():
        full = choice.presets.get("lora")
        tiers = memory_tiers(full) if full and not card_gib(full) else {}
        if not tiers:
            continue
        top = tiers[max(tiers)]
        own = {"base": full, "general": {"sized_for": top}}
        assert yaml.safe_load((PRESETS_DIR / f"{top}.yaml").read_text()) in (
            own, {**own, "training": {"gradient_checkpointing": False}},
            {**own, "training": {"gradient_checkpointing_interval": 2}}), (full, sorted(tiers))


def test_quick_start_picks_the_preset_for_model_method_and_card_and_checks_each_choice(tmp_path):
    from webui.tabs.quickstart import fill, preset_for
    assert preset_for("sdxl", "LoRA", 8) == "sdxl-lora-8gb" and preset_for("sdxl", "LoRA", 11) == "sdxl-lora-8gb"
    assert preset_for("sdxl", "LoRA", 16) == "sdxl-lora-16gb" and preset_for("sdxl", "LoRA", None) == "sdxl-lora"
    # a card the full preset fits takes it (its alias tier, sized by the estimate), not the largest smaller tier
    assert preset_for("sdxl", "LoRA", 24) == "sdxl-lora-24gb" and preset_for("sdxl", "LoRA", 80) == "sdxl-lora-24gb"
    # and a card it fits with less gradient checkpointing, that tier (Z-Image: 32 GB all blocks, 48 half, 80 none)
    assert preset_for("zimage", "LoRA", 24) == "zimage-lora-16gb"
    assert preset_for("zimage", "LoRA", 40) == "zimage-lora-32gb"
    assert preset_for("zimage", "LoRA", 48) == "zimage-lora-48gb"
    assert preset_for("zimage", "LoRA", 80) == "zimage-lora-80gb"  # 48: every second block checkpointed, 80: none
    assert preset_for("sdxl", "Fine-tune", 8) == "sdxl-finetune"
    assert preset_for("flux", "LoRA", 24) == "flux-lora-24gb" and preset_for("flux", "LoRA", 12) == "flux-lora-12gb"
    # the big cards' tiers: a 48 GB card checkpoints every second block, an 80 GB one (nvidia-smi's 81559 MiB, as
    # the page rounds it) none
    assert preset_for("flux", "LoRA", 48) == "flux-lora-48gb" and preset_for("flux", "LoRA", 64) == "flux-lora-48gb"
    assert preset_for("flux", "LoRA", round(81559 / 1024)) == "flux-lora-80gb"
    assert preset_for("qwenimage", "LoRA", 16) == "qwen-image-lora-16gb"
    assert preset_for("flux2-dev", "LoRA", 32) == "flux2-dev-lora-32gb" and preset_for("flux2-dev", "LoRA", 24) == "flux2-dev-lora-24gb"
    assert preset_for("flux2-dev", "LoRA", 16) == "flux2-dev-lora"  # no tier fits: the base (the VRAM check says so)
    model, images = tmp_path / "juggernaut.safetensors", tmp_path / "cats"
    model.write_bytes(b"\0" * 16)
    images.mkdir()
    cfg, preset, note = fill("sdxl", "LoRA", str(model), str(images), 12)
    assert preset == "sdxl-lora-12gb" and cfg.model.path == str(model)
    assert cfg.data.concepts[0].path == str(images) and cfg.data.concepts[0].name == "cats"
    assert "sdxl-lora-12gb" in note
    assert "is not a folder" in fill("sdxl", "LoRA", str(model), str(tmp_path / "dogs"), 12)[2]
    assert "does not exist" in fill("sd15", "LoRA", str(tmp_path / "nope.safetensors"), str(images), 12)[2]
    assert "Give the model" in fill("sd15", "LoRA", "", str(images), 12)[2]
    assert "no preset for Embedding" in fill("flux", "Embedding", str(model), str(images), 24)[2]
    cfg, preset, _ = fill("sd15", "LoRA", "stable-diffusion-v1-5/stable-diffusion-v1-5", str(images), None)
    assert preset == "sd15-lora" and cfg.model.path == "stable-diffusion-v1-5/stable-diffusion-v1-5"  # a hub id
    assert fill("demo", "LoRA", "", "", None)[1] == "demo"  # the demo needs nothing


def test_an_idle_served_page_does_not_poll_every_millisecond_and_the_console_names_launch_flags(tmp_path, capsys):
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    serve(demo, port=None, prevent_thread_lock=True)
    try:
        assert demo._queue.sleep_when_free >= 0.02 and demo._queue.progress_update_sleep_when_free >= 0.1
    finally:
        demo.close()
    out = capsys.readouterr().out
    # the console gives the page's address, and says how to get a public link with launch.py's flags (Gradio's
    # own hint tells a Python author to edit launch())
    assert "Running on local URL:  http://127.0.0.1:" in out
    assert "python3 launch.py --share --auth USER:PASS" in out and "share=True" not in out



def test_the_run_and_queue_tabs_are_refreshed_when_what_they_show_changes(tmp_path):
    """No timer: the page asks <page>/atelier/changes (a plain request, behind the login) for a signature of what
    the tab would show, and refreshes only when it differs."""
    import httpx
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    _, url, _ = serve(demo, port=None, auth=[("ada", "s3cret")], prevent_thread_lock=True, quiet=True)
    base = url.rstrip("/")
    try:
        assert httpx.get(f"{base}/atelier/changes?view=run", timeout=30).status_code == 401  # no login
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{base}/login", data={"username": "ada", "password": "s3cret"}).status_code == 200
            ask = lambda **q: client.get(f"{base}/atelier/changes", params=q).json()  # noqa: E731
            idle = ask(view="run")
            assert idle["active"] is False and ask(view="run") == idle  # nothing changed: the same signature
            queue_idle = ask(view="queue")
            run = demo.atelier.workspace / "runs" / "manual"
            (run / "samples").mkdir(parents=True)
            from trainer.events import EventWriter
            EventWriter(run / "events.jsonl").emit("started", total_steps=4)
            assert ask(view="run")["sig"] != idle["sig"]  # a new run (the runs list and the followed run)
            seen = ask(view="run", run="manual")
            EventWriter(run / "events.jsonl").emit("step", step=1, total_steps=4, loss=0.5, lr={"unet": 1e-4})
            stepped = ask(view="run", run="manual")
            # a step alone: the page writes the status line in place and refreshes the charts and log only every
            # few seconds (its own signature); the rest of the tab is as it was
            assert stepped["sig"] == seen["sig"] and stepped["tsig"] != seen["tsig"]
            assert stepped["status"]["step"] == 1 and stepped["status"]["run"] == "manual"
            assert "loss 0.5" in stepped["status"]["line"] and stepped["status"]["pct"] == 25.0
            EventWriter(run / "events.jsonl").emit("failed", step=1, message="boom")
            assert ask(view="run", run="manual")["sig"] != seen["sig"]  # another state: refreshed at once
            assert ask(view="queue") == queue_idle
            assert client.get(f"{base}/atelier/changes", params={"view": "nope"}).status_code == 400
    finally:
        demo.close()


@pytest.mark.slow
def test_tensorboard_is_served_under_the_page_behind_its_login(tmp_path):
    import httpx
    demo = build_app(tmp_path / "ws", start_scheduler=False)
    _, url, _ = serve(demo, port=None, auth=[("ada", "s3cret")], prevent_thread_lock=True, quiet=True)
    board = demo.atelier.components["tensorboard"]
    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{base}/login", data={"username": "ada", "password": "s3cret"}).status_code == 200
            assert client.get(f"{base}/tensorboard/").status_code == 503  # logged in, not started yet
        opened = demo.atelier.handlers["open_tensorboard"]()
        assert 'href="tensorboard/"' in opened, opened
        assert httpx.get(f"{base}/tensorboard/", timeout=30).status_code == 401  # no login, no TensorBoard
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{base}/login", data={"username": "ada", "password": "s3cret"}).status_code == 200
            page = client.get(f"{base}/tensorboard/")
            assert page.status_code == 200 and "tensorboard" in page.text.lower()
            runs = client.get(f"{base}/tensorboard/data/runs")
            assert runs.status_code == 200 and runs.json() == []  # TensorBoard's own API, through the page
    finally:
        board.stop()
        demo.close()


def test_the_caption_editor_edits_in_place_replaces_across_the_folder_and_counts_tags(tmp_path):
    from PIL import Image
    ws = tmp_path / "ws"
    data = ws / "cats"
    data.mkdir(parents=True)
    for name, caption in (("a", "cat, sofa, red"), ("b", "cat, window"), ("c", None)):
        Image.new("RGB", (8, 8)).save(data / f"{name}.png")
        if caption:
            (data / f"{name}.txt").write_text(caption + "\n")
    Image.new("L", (8, 8)).save(data / "a-masklabel.png")  # a mask is not an image to caption
    ctx = build_app(ws, start_scheduler=False).atelier
    Image.new("L", (8, 8)).save(data / "b-masklabel.png")  # all black: b is masked out entirely
    note, items, _, _, tags = ctx.handlers["captions_show"](str(data))
    assert note.startswith("3 images") and "1 without a caption" in note and len(items) == 3
    assert "2 with a mask" in note and items[1][1].endswith("· mask") and not items[2][1].endswith("· mask")
    assert tags[0] == ("cat", 2)
    saved = ctx.handlers["captions_store"](str(data), "c.png", "dog, garden")
    assert saved[0] == "Saved `c.txt`." and (data / "c.txt").read_text() == "dog, garden\n"
    assert "not an image of this folder" in ctx.handlers["captions_store"](str(data), "../x.png", "y")[0]
    out = ctx.handlers["captions_replace"](str(data), "cat", "kitten", False)
    assert out[0] == "Replaced in 2 caption(s)." and (data / "a.txt").read_text() == "kitten, sofa, red\n"
    out = ctx.handlers["captions_replace"](str(data), r"\bred\b", "crimson", True)
    assert (data / "a.txt").read_text() == "kitten, sofa, crimson\n"
    assert "not a valid regular expression" in ctx.handlers["captions_replace"](str(data), "(", "", True)[0]
    assert "outside the folders" in ctx.handlers["captions_show"]("/etc")[0]


def test_mask_painter_layers_become_a_black_and_white_mask_and_an_existing_mask_loads_back(tmp_path):
    import numpy as np
    from PIL import Image

    from webui.maskpaint import layer_from_mask, mask_file, save_mask
    image = tmp_path / "a.jpg"
    Image.new("RGB", (40, 20)).save(image)
    layer = Image.new("RGBA", (80, 40), (255, 255, 255, 0))  # the editor's layer may be larger: scaled down
    layer.paste((255, 255, 255, 191), (0, 0, 40, 40))  # painted: the left half
    assert save_mask(image, [layer]) == mask_file(image) == tmp_path / "a-masklabel.png"
    mask = np.asarray(Image.open(mask_file(image)))
    assert mask.shape == (20, 40) and mask[:, :20].min() == 255 and mask[:, 20:].max() == 0
    again = np.asarray(layer_from_mask(mask_file(image), (40, 20)))
    assert (again[..., 3] > 0)[:, :20].all() and not (again[..., 3] > 0)[:, 20:].any()


def test_grid_thumbnails_darken_what_the_mask_leaves_out(tmp_path):
    from PIL import Image

    from webui.captions import thumbnail
    Image.new("RGB", (40, 20), (250, 250, 250)).save(tmp_path / "a.png")
    mask = Image.new("L", (40, 20), 0)
    mask.paste(255, (0, 0, 20, 20))  # train on the left half only
    mask.save(tmp_path / "a-masklabel.png")
    thumb = thumbnail(tmp_path / "a.png")
    assert thumb.getpixel((5, 10))[0] == 250 and thumb.getpixel((35, 10))[0] == 75


def test_a_fresh_click_keeps_the_action_line_cleared_until_it_settles():
    """A queued Stop answer may reach the page after the poll that saw the run end: while the click is fresh
    and the run has ended, each tick clears the line again; while the run still runs, the message stays."""
    import time as _time

    from webui.tabs.run import ACTION_SETTLE_S, _click_settling
    now = _time.time()
    assert _click_settling(("run-a", False, now), ("run-a", True))
    assert _click_settling(("run-a", False, now), "none")
    assert not _click_settling(("run-a", False, now), ("run-a", False))  # still running: "Stopping…" stays
    assert not _click_settling(("run-a", False, now - ACTION_SETTLE_S - 1), ("run-a", True))  # old click
    assert not _click_settling(("run-a", True), ("run-a", True))  # no click: compared as usual
