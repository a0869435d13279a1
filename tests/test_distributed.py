"""Several processes (DDP over gloo on CPU): same result as one process with the same global batch,
one set of outputs, resume on another number of processes, and a failing rank ends the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.__main__ import main as cli
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["training.epochs=2", "sampling.prompts=[]", "general.tensorboard=false", "output.dtype=fp32",
          "general.device=cpu", "general.dataloader_workers=0"]


def _sets(ws: Path, run: str, *extra: str) -> list:
    return ["--set", f"general.workspace={ws}", "--set", f"general.run_name={run}", "--no-progress",
            *[x for e in (*COMMON, *extra) for x in ("--set", e)]]


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    env.pop("ATELIER_TEST_FAULT", None)
    env.update(extra)
    return env


def _torchrun(args: list, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_port()), "-m", "trainer", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lora(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def _close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=atol)


@pytest.fixture(scope="module")
def runs(tiny_workspace):
    """One process with batch 2, and two processes with batch 1 (same global batch, backups on)."""
    ws = tiny_workspace
    assert cli(["train", "--preset", "demo", *_sets(ws, "dist-one", "backup.every_n_epochs=0")]) == 0
    t0 = time.time()
    out = _torchrun(["train", "--preset", "demo", *_sets(ws, "dist-two", "training.batch_size=1",
                                                          "backup.every_n_epochs=1", "backup.keep_last=2")])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return ws, time.time() - t0


def test_two_processes_equal_one_process_with_the_global_batch(runs):
    ws, _ = runs
    one, two = ws / "runs" / "dist-one", ws / "runs" / "dist-two"
    _close(_lora(one / "dist-one.safetensors"), _lora(two / "dist-two.safetensors"))
    # one set of outputs and events: a single started/finished, one result, rank 0's backups only
    events = read_events(two / "events.jsonl")
    types = [e["type"] for e in events]
    assert types.count("started") == 1 and types.count("finished") == 1 and types[-1] == "finished"
    started = events[0]
    assert started["world_size"] == 2 and started["global_micro_batch"] == 2 and started["global_batch"] == 2
    assert started["batch_size"] == 1
    steps = [e for e in events if e["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 9))  # one event per step, not one per rank
    ref = [e["loss"] for e in read_events(one / "events.jsonl") if e["type"] == "step"]
    assert [s["loss"] for s in steps] == pytest.approx(ref, abs=1e-5)  # loss averaged over the ranks
    assert sorted(p.name for p in two.glob("*.safetensors")) == ["dist-two.safetensors"]
    backups = sorted(p.name for p in (two / "backups").iterdir())
    assert backups == ["backup-step000004", "backup-step000008"]
    state = json.loads((two / "backups" / "backup-step000004" / "state.json").read_text())
    assert state["world_size"] == 2 and state["global_micro_batch"] == 2 and state["step"] == 4
    assert not list(two.glob("rank-*-error.json"))


def test_a_two_process_backup_resumes_on_one_process(runs, capsys):
    ws, _ = runs
    backup = ws / "runs" / "dist-two" / "backups" / "backup-step000004"
    run = ws / "runs" / "dist-resumed"
    # the config still says batch 1 per process: on one process the batch becomes 2 (global batch kept)
    rc = cli(["train", "--preset", "demo", *_sets(ws, "dist-resumed", "training.batch_size=1",
                                                  "backup.every_n_epochs=0"),
              "--run-dir", str(run), "--resume", str(backup)])
    assert rc == 0
    events = read_events(run / "events.jsonl")
    assert any(e["type"] == "warning" and "global batch" in e["message"] for e in events)
    started = [e for e in events if e["type"] == "started"][0]
    assert started["resumed_from_step"] == 4 and started["world_size"] == 1 and started["batch_size"] == 2
    _close(_lora(ws / "runs" / "dist-one" / "dist-one.safetensors"), _lora(run / "dist-resumed.safetensors"))


def test_resume_refuses_another_accumulation(runs):
    ws, _ = runs
    backup = ws / "runs" / "dist-two" / "backups" / "backup-step000004"
    run = ws / "runs" / "dist-bad-accum"
    rc = cli(["train", "--preset", "demo", *_sets(ws, "dist-bad-accum", "training.gradient_accumulation_steps=2"),
              "--run-dir", str(run), "--resume", str(backup)])
    assert rc == 1
    last = read_events(run / "events.jsonl")[-1]
    assert last["type"] == "failed" and "gradient_accumulation_steps" in last["message"]


def test_a_failing_rank_ends_the_job_with_a_failed_event_naming_it(tiny_workspace):
    """Launched through the CLI helper (accelerate launch); rank 1 raises after step 2."""
    ws = tiny_workspace
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--preset", "demo", "--num-processes", "2",
                           *_sets(ws, "dist-fault", "training.batch_size=1", "general.dist_timeout_s=60")],
                          cwd=ROOT, env=_env(ATELIER_TEST_FAULT="1:2:raise"), capture_output=True, text=True,
                          timeout=180)
    elapsed = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert elapsed < 150
    run = ws / "runs" / "dist-fault"
    events = read_events(run / "events.jsonl")
    failed = [e for e in events if e["type"] == "failed"]
    assert len(failed) == 1 and events[-1]["type"] == "failed", [e["type"] for e in events]
    assert failed[0]["rank"] == 1 and "test fault on rank 1" in failed[0]["message"], failed[0]
    err = json.loads((run / "rank-1-error.json").read_text())
    assert "test fault" in err["message"] and "Traceback" in err["traceback"]
    assert not (run / "dist-fault.safetensors").exists()


def test_a_rank_that_dies_hard_is_named(tiny_workspace):
    """Rank 1 calls os._exit (no Python error, like the OOM killer): rank 0 or the launcher names it."""
    ws = tiny_workspace
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--preset", "demo", "--num-processes", "2",
                           *_sets(ws, "dist-exit", "training.batch_size=1", "general.dist_timeout_s=60")],
                          cwd=ROOT, env=_env(ATELIER_TEST_FAULT="1:2:exit"), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.time() - t0 < 150
    events = read_events(ws / "runs" / "dist-exit" / "events.jsonl")
    failed = [e for e in events if e["type"] == "failed"]
    assert len(failed) == 1 and failed[0]["rank"] == 1, failed


def test_validate_shows_the_effective_batch_and_bad_device_counts(tiny_workspace, capsys):
    ws = tiny_workspace
    assert cli(["validate", "--preset", "demo", "--set", f"general.workspace={ws}", "--set",
                "general.num_processes=3", "--set", "training.gradient_accumulation_steps=2"]) == 0
    assert "= 12" in capsys.readouterr().out  # 2 x 2 x 3
    rc = cli(["train", "--preset", "demo", *_sets(ws, "dist-too-many", "general.device=cuda"),
              "--num-processes", "2"]) if not torch.cuda.is_available() else 2
    assert rc == 2
    if not torch.cuda.is_available():
        assert "CUDA GPU" in capsys.readouterr().err
    rc = cli(["train", "--preset", "demo", *_sets(ws, "dist-ids", "general.gpu_ids=0"), "--num-processes", "2"])
    assert rc == 2 and "gpu_ids" in capsys.readouterr().err
