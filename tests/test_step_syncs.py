"""The host work of a training step, counted (bench/step_counts.py): the step never makes the host wait for the
device. A tiny SD LoRA step, counted as CUDA would see it: no device sync (the loss is read a step late, from a
non-blocking copy), no blocking host-to-device copy (batches move pinned and non-blocking; noise, timesteps and
posterior samples are drawn on the device). Counts, not timings: they are the same on every machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import step_counts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def counted(tiny_workspace):
    return step_counts.run_case("demo", ["training.mixed_precision=bf16"], warmup=2, count=1,
                                workspace=tiny_workspace, run_name="step-syncs")


def test_a_step_has_no_device_sync_and_no_blocking_copy(counted):
    assert counted["syncs"] == 0, counted["sync_sites"]
    assert counted["blocking_copies"] == 0, counted["copy_sites"]
    assert counted["late_reads"] == 1  # the step before's loss, from its own non-blocking copy
    # the batch's latent mean and std, cached text features and loss weights, moved without blocking
    assert counted["async_copies"] == 4, counted["copy_sites"]


def test_the_counter_sees_what_it_counts(counted):
    assert counted["ops"] > 1000 and counted["python_calls"] > 1000
    assert counted["op_names"]["mm"] > 0
    assert 0 < counted["kernel_ops"] < counted["ops"]


def test_views_and_allocations_run_no_kernel():
    """The "of them kernels" column: ops that launch a kernel on a GPU; views (aliases of their input), empty
    tensors and host reads do not."""
    tally = step_counts.Tally()
    x = torch.ones(4, 6)
    with step_counts.OpCounter(tally, step_counts.WeakTensorKeyDictionary()):
        y = x.view(6, 4).t().unsqueeze(0).expand(2, 4, 6)  # 4 views
        x.detach()
        torch.empty(3)
        z = (y + 1).sum()  # 2 kernels
        z.item()  # a host read
        x.to(torch.bfloat16)  # 1 kernel
    assert tally.ops >= 10 and tally.kernels == 3, tally.op_names


@pytest.mark.parametrize("case", ["demo-sdxl", "demo-chroma", "demo-flux2-klein", "demo-wan", "demo-cascade",
                                  "demo-zimage", "demo-ernie-image", "demo-lumina2"])
def test_other_families_steps_have_no_blocking_copy(case, tiny_workspace):
    """What families make during a step (SDXL's token ids and size conditioning, the Flux lineage's position ids,
    the Wan-style VAEs' per-channel latent statistics) reaches the device without a blocking copy, and their steps
    read nothing back (Stable Cascade's step encoded the empty caption every step, to learn which features a batch
    has; Z-Image and ERNIE-Image cut cached captions at lengths the batch carries on the host, and Lumina 2's RoPE
    embedder reads them there instead of from the mask)."""
    counted = step_counts.run_case(case, ["training.mixed_precision=bf16"], warmup=2, count=1,
                                   workspace=tiny_workspace, run_name=f"step-syncs-{case}")
    assert counted["blocking_copies"] == 0, counted["copy_sites"]
    assert counted["syncs"] == 0, counted["sync_sites"]


def test_hunyuan_images_step_reads_nothing_back_with_its_captions_dropped(tiny_workspace):
    """HunyuanImage 2.1's transformer joined its two text streams with boolean indexes, eight device reads a row
    at every forward; the step joins them by a sort on the device (joined_text.py), and cuts the captions' padding
    at the lengths the cached batch carries on the host, which caption dropout of either stream keeps (the step read
    the two masks' longest runs once before)."""
    counted = step_counts.run_case("demo-hunyuan-image", ["training.mixed_precision=bf16",
                                                          "parts.text_encoder_1.caption_dropout=0.5",
                                                          "parts.text_encoder_2.caption_dropout=0.5"],
                                   warmup=2, count=1, workspace=tiny_workspace, run_name="step-syncs-hunyuan-image")
    assert counted["syncs"] == 0, counted["sync_sites"]
    assert counted["blocking_copies"] == 0, counted["copy_sites"]


def test_hidreams_step_reads_the_device_once_per_routed_feed_forward(tiny_workspace):
    """HiDream's routed experts in training (diffusers' path: two device reads per expert, boolean indexes) read
    their row counts once per feed-forward (trainer/families/hidream/moe.py); nothing else in the step reads back.
    What is left: the one blocking copy of the patch grid's size in diffusers' ``patchify``."""
    counted = step_counts.run_case("demo-hidream", ["training.mixed_precision=bf16"], warmup=2, count=1,
                                   workspace=tiny_workspace, run_name="step-syncs-hidream")
    sites = counted["sync_sites"]
    assert len(sites) == 1 and all(s.startswith("tolist") and "hidream/moe.py" in s for s in sites), sites
    assert counted["syncs"] == 2, sites  # the tiny transformer's two routed feed-forwards (one block of each kind)
    assert counted["blocking_copies"] == 1 and all("patchify" in s for s in counted["copy_sites"] if s.startswith(
        "True")), counted["copy_sites"]


def test_a_move_that_returns_the_same_tensor_on_the_cpu_leaves_the_original_where_it_was():
    """On CUDA a move between host and device makes a new tensor; on the CPU ``.cpu()`` of a CPU tensor and ``.to``
    its own device return the tensor itself. The counter sees them as CUDA would: the host copy of a device tensor
    is read without a sync, and the host tensor moved to the device is still read on the host without one."""
    tally = step_counts.Tally()
    dev = step_counts.WeakTensorKeyDictionary()
    on_device = torch.ones(3)
    dev[on_device] = True
    host = torch.ones(3)
    with step_counts.DeviceTracker(tally, dev):
        back = on_device.cpu()  # a sync (the copy waits for the device)
        back.tolist()  # the host copy: no sync
        moved = host.to(torch.device("cpu"), non_blocking=True)
        host.tolist()  # the host original: no sync
        moved.tolist()  # the device copy: a sync
        on_device.tolist()  # a sync
    assert [name for name, _ in tally.syncs] == ["cpu", "tolist", "tolist"], tally.syncs
    assert sum(tally.syncs.values()) == 3, tally.syncs
    assert back is not on_device and moved is not host


def test_the_cosine_schedules_constants_move_to_the_device_once():
    """Würstchen's and Stable Cascade's objective (diffusers' DDPMWuerstchenScheduler) moved the schedule's two
    constant tensors from the CPU at every call, three blocking copies a step; now once."""
    from trainer.objectives import CosineObjective
    objective = CosineObjective()
    tally = step_counts.Tally()
    dev = step_counts.WeakTensorKeyDictionary()
    latents, noise, t = torch.zeros(2, 4, 8, 8), torch.ones(2, 4, 8, 8), torch.tensor([0.25, 0.75])
    for x in (latents, noise, t):
        dev[x] = True
    with step_counts.DeviceTracker(tally, dev):
        objective.noisy_and_target(latents, noise, t)
        first = sum(tally.copies.values())  # the constants' move
        for _ in range(3):
            objective.noisy_and_target(latents, noise, t)
            objective.alpha_cumprod(t)
    assert first > 0 and sum(tally.copies.values()) == first, tally.copies


@pytest.mark.parametrize("case, sets", [
    ("demo", ["dropout"]),  # caption dropout: the rows' choices and the empty caption's features
    ("demo-flux", ["dropout", "parts.text_encoder_2.caption_dropout=0.5"]),
    ("demo-zimage", ["dropout"]),
    ("demo-sd3", ["dropout", "parts.text_encoder_3.caption_dropout=0.5"]),
    ("demo-flux2-klein", ["pairs"]),  # the controls as Flux.2's reference images
    # …and Qwen-Image-Edit's caption dropout, whose empty instruction is read with each row's images (cached)
    ("demo-qwen-image", ["pairs", "dropout", "model.path=builtin:tiny-qwen-image-edit-2509"]),
    ("demo", ["model.path=builtin:tiny-sd-inpaint"]),  # random masks drawn on the host
    ("demo", ["masks"])])  # masked training: the images' masks move where the loss is taken
def test_steps_on_pairs_masks_and_inpainting_reach_the_device_without_a_blocking_copy(case, sets, tiny_workspace,
                                                                                      tmp_path):
    """Caption dropout draws each row's choice on the host: the choices move as batches do and the empty caption's
    features are kept on the device (both were blocking copies at every step that dropped a row, in every family).
    A step on pairs (a target and the control it was made from): Flux.2's reference ids are made on the device
    (diffusers' helper makes them on the CPU) and Qwen-Image-Edit's latent statistics once per device (they were
    made from Python lists every step), and its caption dropout takes each row's empty instruction, which depends on
    the row's images, from the text cache (Qwen2.5-VL ran on the dropped rows at the step); an inpainting UNet's
    masks, drawn on the host, and masked training's masks (kept on the host for the step's choice to use them) move
    pinned and without making it wait. What is left is
    diffusers' own: Qwen-Image's transformer copies a caption length over when a batch's captions differ in length
    (its ``compute_text_seq_len_from_mask``)."""
    import shutil
    import zlib
    sets = ["parts.text_encoder_1.caption_dropout=0.5" if s == "dropout" else s for s in sets]
    if "pairs" in sets:
        controls = tmp_path / "controls"
        controls.mkdir()
        for image in step_counts.DEMO_DATA.glob("*.png"):
            shutil.copy(image, controls / image.name)
        pairs = f"data.concepts=[{{path: {step_counts.DEMO_DATA}, control_paths: [{controls}]}}]"
        sets = [pairs if s == "pairs" else s for s in sets]
    if "masks" in sets:  # the demo images with a mask each: the left half is what counts
        from PIL import Image
        masked = tmp_path / "masked"
        masked.mkdir()
        for image in step_counts.DEMO_DATA.glob("*.png"):
            shutil.copy(image, masked / image.name)
            shutil.copy(image.with_suffix(".txt"), masked / image.with_suffix(".txt").name)
            size = Image.open(image).size
            mask = Image.new("L", size, 0)
            mask.paste(255, (0, 0, size[0] // 2, size[1]))
            mask.save(masked / f"{image.stem}-masklabel.png")
        sets = [f"data.concepts=[{{path: {masked}}}]", "data.masks=true"]
    name = f"step-syncs-{case}-{zlib.crc32(str(sets).encode())}"
    counted = step_counts.run_case(case, ["training.mixed_precision=bf16", *sets, "sampling.prompts=[]"], warmup=2,
                                   count=1, workspace=tiny_workspace, run_name=name)
    assert counted["syncs"] == 0, counted["sync_sites"]
    blocking = [s for s in counted["copy_sites"] if s.startswith("True")]
    assert all("compute_text_seq_len_from_mask" in s for s in blocking), blocking


def test_a_validation_pass_reads_its_losses_once(tiny_workspace, tmp_path):
    """Validation (a concept of role validation, every training.validation_every_n_steps): each batch's loss stays
    on the device until the pass ends, then all are read at once (it read each batch's loss as it went: one wait
    for the device per validation batch)."""
    import shutil
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    for image in list(step_counts.DEMO_DATA.glob("*.png"))[:6]:  # three validation batches of two
        shutil.copy(image, held_out / image.name)
        shutil.copy(image.with_suffix(".txt"), held_out / image.with_suffix(".txt").name)
    concepts = f"data.concepts=[{{path: {step_counts.DEMO_DATA}}}, {{path: {held_out}, role: validation}}]"
    counted = step_counts.run_case("demo", ["training.mixed_precision=bf16", concepts,
                                            "training.validation_every_n_steps=1"], warmup=2, count=1,
                                   workspace=tiny_workspace, run_name="step-syncs-validation")
    assert counted["syncs"] == 1 and all(" validate" in s for s in counted["sync_sites"]), counted["sync_sites"]
    assert counted["blocking_copies"] == 0, counted["copy_sites"]


def test_lumina2s_rotary_tables_move_to_the_device_once(tiny_workspace):
    """diffusers' Lumina 2 keeps its rotary tables in a Python list (not buffers), so they stayed on the CPU and each
    forward copied the three over; the family moves them once (counted here over three predictions: the first moves
    them, the others copy nothing; the model's weights and the inputs count as on the device)."""
    from conftest import load_tiny
    from trainer.families import build_tiny
    model = load_tiny(tiny_workspace, build_tiny("tiny-lumina2", tiny_workspace / "models")["diffusers"])
    tally = step_counts.Tally()
    dev = step_counts.WeakTensorKeyDictionary()
    for t in list(model.transformer.parameters()) + list(model.transformer.buffers()):
        dev[t] = True
    x, t = torch.randn(1, 16, 8, 8), torch.tensor([0.5])
    cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
    for v in (x, t, cond.prompt_embeds, cond.prompt_mask):
        dev[v] = True
    with torch.no_grad(), step_counts.DeviceTracker(tally, dev):
        model.predict(x, t, cond)
        first = sum(n for (blocking, _), n in tally.copies.items() if blocking)
        model.predict(x, t, cond)
        model.predict(x, t, cond)
    copies = sum(n for (blocking, _), n in tally.copies.items() if blocking)
    assert first == 3 and copies == first, tally.copies  # the three tables, once
