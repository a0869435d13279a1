"""The General tab's device picker: GPUs from nvidia-smi (a stand-in script on PATH here, since CI has no
GPU), ticked into general.gpu_ids / num_processes, and what Start will launch — in a real browser."""

from __future__ import annotations

import os
import stat

import pytest

from test_webui_e2e import free_port, open_page
from webui import devices

pytestmark = pytest.mark.slow

FAKE_SMI = """#!/bin/sh
# stands in for the NVIDIA driver's nvidia-smi: answers the one query the UI makes
case "$*" in
  *--query-gpu=index,name,memory.total*) printf '0, NVIDIA H100 80GB HBM3, 81559\\n1, NVIDIA H100 80GB HBM3, 81559\\n' ;;
  *) echo "unexpected arguments: $*" >&2; exit 9 ;;
esac
"""


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return smi


def test_detect_gpus_reads_nvidia_smi(fake_gpus):
    gpus, note = devices.detect_gpus()
    assert [(g.index, g.name) for g in gpus] == [(0, "NVIDIA H100 80GB HBM3"), (1, "NVIDIA H100 80GB HBM3")]
    assert gpus[0].label == "0: NVIDIA H100 80GB HBM3 (80 GiB)" and note == ""


def test_no_driver_and_a_failing_driver_are_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    gpus, note = devices.detect_gpus()
    assert gpus == [] and "No NVIDIA GPU found" in note
    broken = tmp_path / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA "
                      "driver.' >&2\nexit 9\n")
    broken.chmod(0o755)
    gpus, note = devices.detect_gpus()
    assert gpus == [] and "could not communicate with the NVIDIA driver" in note


def test_selection_and_fields_map_both_ways():
    gpus = [devices.Gpu(0, "A", 1024), devices.Gpu(1, "B", 2048), devices.Gpu(2, "C", 2048)]
    assert devices.selection_to_fields([gpus[2].label, gpus[0].label]) == ("0,2", 2)
    assert devices.fields_to_selection(gpus, "0,2", 2) == [gpus[0].label, gpus[2].label]
    assert devices.fields_to_selection(gpus, "", 2) == [gpus[0].label, gpus[1].label]
    text = devices.launch_summary(2, "0,2", 4, 2, "auto", gpus)
    assert "2 processes" in text and "accelerate launch" in text and "**16**" in text
    assert "one training process on GPU 1" in devices.launch_summary(1, "1", 2, 1, "auto", gpus)


def test_one_gpu_id_narrows_a_single_process_and_bad_lists_are_refused(monkeypatch):
    from trainer.__main__ import _one_gpu
    from trainer.config.checks import load_config
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config(None, ["general.gpu_ids=1"], preset="demo")
    assert _one_gpu(cfg, apply=True) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # already narrowed by the user: id 1 is the 6
    assert _one_gpu(cfg, apply=True) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert "leaves GPUs 0..0" in _one_gpu(cfg, apply=True)
    cfg = load_config(None, ["general.gpu_ids=0,1"], preset="demo")
    assert "set num_processes = 2" in _one_gpu(cfg, apply=False)


@pytest.fixture
def page_with_gpus(fake_gpus, tmp_path):
    from webui.app import build_app, serve
    demo = build_app(tmp_path / "ws")
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield url, demo.atelier
    demo.atelier.manager.shutdown()
    demo.close()


def test_ticking_gpus_sets_processes_and_shows_the_launch(page_with_gpus):
    url, ctx = page_with_gpus
    with open_page(url) as page:
        page.get_by_role("tab", name="General", exact=True).click()
        picker = page.locator("#gpu-picker")
        picker.wait_for(state="visible", timeout=20000)
        assert "2 GPU(s) found" in page.locator("#gpu-note").inner_text()
        second = picker.get_by_label("1: NVIDIA H100 80GB HBM3 (80 GiB)")
        second.check()
        page.wait_for_function(
            "document.querySelector('#launch-summary').innerText.includes('2 processes')", timeout=20000)
        summary = page.locator("#launch-summary").inner_text()
        assert "accelerate launch" in summary and "GPU 0, 1" in summary
        ids = ctx.form.widgets["general.gpu_ids"].elem_id
        procs = ctx.form.widgets["general.num_processes"].elem_id
        assert page.locator(f"#{ids} input, #{ids} textarea").first.input_value() == "0,1"
        assert page.locator(f"#{procs} input[type=number]").input_value() == "2"
        picker.get_by_label("0: NVIDIA H100 80GB HBM3 (80 GiB)").uncheck()  # only GPU 1 now
        page.wait_for_function(
            "document.querySelector('#launch-summary').innerText.includes('one training process on GPU 1')",
            timeout=20000)
        assert page.locator(f"#{procs} input[type=number]").input_value() == "1"
