"""training.compile traces a LoRA step's blocks whole: no graph break (peft's LoRA layers are inside the compiled
blocks) and no recompile after the first step of one shape, for a tiny SD UNet and a tiny Flux transformer. The
aot_eager backend traces forward and backward as inductor does, without generating kernels (no C++ compiler);
the counts are torch's own (bench/step_counts.py --compiled)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import step_counts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case, blocks, sets", [
    ("demo", "BasicTransformerBlock", []),
    ("demo-flux", "FluxTransformerBlock", []),
    # checkpointed: the checkpoint traced inside the compiled region, fp8 layers' own checkpoints nested in it
    ("demo-flux", "FluxTransformerBlock", ["training.gradient_checkpointing=true", "parts.denoiser.fp8=true",
                                           "parts.denoiser.dtype=bf16"]),
    # training.compile_scope denoiser: the whole transformer one graph, every second block's checkpoint and the fp8
    # layers inside (the blocks' order, learned in the first trace, compiles nothing again)
    ("demo-flux", "FluxTransformer2DModel", ["training.compile_scope=denoiser", "training.gradient_checkpointing=true",
                                             "training.gradient_checkpointing_interval=2", "parts.denoiser.fp8=true",
                                             "parts.denoiser.dtype=bf16"]),
    # parts.denoiser.fp8_matmul: the fp8 products' autograd function traced inside the checkpointed blocks
    ("demo-flux", "FluxTransformerBlock", ["training.gradient_checkpointing=true", "parts.denoiser.fp8=true",
                                           "parts.denoiser.fp8_matmul=true", "parts.denoiser.dtype=bf16"])],
    ids=["sd", "flux", "flux-checkpointed", "flux-denoiser-checkpointed", "flux-fp8-products"])
@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_a_compiled_lora_step_has_no_graph_break_and_no_recompile(tiny_workspace, case, blocks, sets):
    r = step_counts.run_compiled(case, ["training.mixed_precision=bf16", *sets], steps=2, workspace=tiny_workspace,
                                 backend="eager", run_name=f"{case}-graphs{len(sets)}")
    assert blocks in r["blocks"] and r["lora_layers_in_blocks"] > 0
    assert r["graph_breaks"] == 0, r["break_reasons"]
    assert r["first_step_frames"] >= 1 and r["graphs"] >= 1  # the blocks did compile
    assert r["recompiles_after_first"] == 0


@pytest.mark.slow  # three traces of the tiny SD UNet
def test_compile_dynamic_decides_whether_the_blocks_sizes_are_symbolic(tiny_workspace):
    """training.compile_dynamic as torch.compile's ``dynamic``: the tiny SD UNet's blocks see inputs of several sizes
    (its levels, the first block's input without grad); static compiles a graph for each with fixed sizes, dynamic
    makes every graph's sizes symbolic, auto (torch's default) starts fixed and turns the sizes that changed symbolic
    (bench/compile_shapes.py, which counts the real UNets)."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    import compile_shapes
    found = {}
    for value in ("static", "dynamic", "auto"):
        unet = UNet2DConditionModel.from_pretrained(tiny_workspace / "models" / "tiny-sd", subfolder="unet")
        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        found[value] = compile_shapes.block_graphs(unet, value, 64)
    static, dynamic, auto = found["static"], found["dynamic"], found["auto"]
    assert not any(static["symbolic"]) and static["graphs"] >= 3, static
    assert all(dynamic["symbolic"]) and dynamic["graphs"] >= 1, dynamic
    assert any(auto["symbolic"]) and not all(auto["symbolic"]) and auto["graphs"] <= static["graphs"], auto
    assert sum(static["block_calls"]) == sum(auto["block_calls"]) == sum(dynamic["block_calls"]) > static["graphs"]


@pytest.mark.slow  # a traced run of the tiny HiDream
def test_a_first_step_whose_graphs_break_says_so_and_what_to_change(tiny_workspace):
    """HiDream's transformer indexes tensors by masks (sizes known only from the data): compiled whole, its graphs
    break, and the run says so once after the first step, with torch's reason and the scope to try (a run that
    breaks nothing says nothing: the whole UNet's below)."""
    from trainer.events import read_events
    from trainer.train.compile import graph_break_warning
    r = step_counts.run_compiled("demo-hidream", ["training.mixed_precision=bf16", "training.compile_scope=denoiser"],
                                 steps=2, workspace=tiny_workspace, backend="eager", run_name="whole-breaks")
    assert r["graph_breaks"] > 0
    warnings = [e["message"] for e in read_events(tiny_workspace / "runs" / "whole-breaks" / "events.jsonl")
                if e["type"] == "warning" and "graphs broke" in e["message"]]
    assert len(warnings) == 1 and "compile_scope blocks" in warnings[0] and "(torch: " in warnings[0], warnings
    assert graph_break_warning(0, {}, "denoiser") == ""
    assert "runs eagerly between" in graph_break_warning(2, {"a reason": 2}, "blocks")


@pytest.mark.slow  # a compiled run of the tiny SD with its sample at the end
def test_a_run_compiles_with_the_configured_sizes_and_samples_at_its_end(tiny_workspace):
    """The setting reaches the run's compile (training.compile_dynamic = static: no graph with symbolic sizes), and
    a compiled run samples at its end through the compiled blocks (no-grad graphs of their own)."""
    r = step_counts.run_compiled("demo", ["training.mixed_precision=bf16", "training.compile_dynamic=static",
                                          "sampling.at_end=true", "sampling.prompts=[{prompt: a red square, "
                                                                  "width: 64, height: 64, steps: 3}]"],
                                 steps=2, workspace=tiny_workspace, backend="eager", run_name="static-sizes")
    assert r["symbolic_graphs"] == 0 and r["graphs"] >= 3 and r["graph_breaks"] == 0, r
    assert r["recompiles_after_first"] == 0
    run = tiny_workspace / "runs" / "static-sizes"
    assert "(shapes: static)" in (run / "train.log").read_text()
    assert list((run / "samples").rglob("*.png")), "no sample at the end"


@pytest.mark.slow  # an eager run and a traced one of the tiny SD
def test_the_whole_denoiser_compiled_trains_the_lora_of_the_eager_step(tiny_workspace):
    """training.compile_scope = denoiser: the whole UNet is one graph (no break, no recompile), forward and backward
    through AOTAutograd as inductor gets them, and the LoRA it trains is the eager run's (SGD: the comparison is
    about the compiled model; inductor's kernels would sum in another order, tested for the blocks elsewhere).
    Without checkpointing: with it, the eager checkpoint sums the skip connections' gradients in another order, and
    this setting (bf16, a learning rate of 0.5) makes that up to a fifth of a small tensor's largest value, as
    checkpointing on against off does in eager runs; the checkpointed whole graph is traced in the test above.
    The run's sample at its end runs the UNet eagerly."""
    from safetensors.torch import load_file

    from trainer.events import read_events
    from trainer.train.compile import dynamo_counts
    sgd = ["training.mixed_precision=bf16", "training.optimizer.name=sgd", "training.learning_rate=0.5",
           "output.dtype=fp32"]
    step_counts.train_case("demo", sgd, 2, tiny_workspace, "eager", lambda: None)  # the same run, not compiled
    before = dynamo_counts()
    r = step_counts.run_compiled("demo", [*sgd, "training.compile_scope=denoiser", "sampling.at_end=true",
                                          "sampling.prompts=[{prompt: a red square, width: 64, height: 64, steps: 2}]"],
                                 steps=2, workspace=tiny_workspace, backend="aot_eager", run_name="whole")
    assert r["blocks"] == "1 × UNet2DConditionModel" and r["lora_layers_in_blocks"] == 128
    assert r["graph_breaks"] == 0 and r["graphs"] == 1 and r["recompiles_after_first"] == 0, r
    # the sample at the end ran the UNet eagerly: no graph of its own (its size and guidance batch would compile
    # the whole UNet again)
    assert dynamo_counts()["frames_compiled"] - before["frames_compiled"] == r["first_step_frames"] == 1
    runs = tiny_workspace / "runs"
    assert list((runs / "whole" / "samples").glob("*.png")), "no sample at the end"
    assert not [e for e in read_events(runs / "whole" / "events.jsonl") if e["type"] == "warning"]
    assert "1 × UNet2DConditionModel compiled at their first call" in (runs / "whole" / "train.log").read_text()
    eager, whole = load_file(runs / "eager" / "eager.safetensors"), load_file(runs / "whole" / "whole.safetensors")
    assert set(eager) == set(whole)
    assert max(float(v.abs().max()) for k, v in eager.items() if "lora_B" in k or "lora_up" in k) > 0
    for k, v in eager.items():
        torch.testing.assert_close(whole[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a traced run of the tiny Z-Image
def test_z_images_rope_tables_are_made_before_its_whole_transformer_compiles(tiny_workspace):
    """diffusers' Z-Image transformer makes its rope tables at its first call under ``with torch.device("cpu")``,
    which dynamo cannot enter: compiled whole, its first call broke three times and the run warned about breaks
    that later calls did not have. The family makes them before compiling (``before_compile``): no break, no
    warning (its first step; later ones recompile as the captions' lengths change, until torch makes them dynamic)."""
    from trainer.events import read_events
    r = step_counts.run_compiled("demo-zimage", ["training.mixed_precision=bf16", "training.compile_scope=denoiser"],
                                 steps=1, workspace=tiny_workspace, backend="eager", run_name="zimage-whole")
    assert r["blocks"] == "1 × ZImageTransformer2DModel" and r["graph_breaks"] == 0, r["break_reasons"]
    events = read_events(tiny_workspace / "runs" / "zimage-whole" / "events.jsonl")
    assert not [e for e in events if e["type"] == "warning" and "graphs broke" in e["message"]]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(x)


def test_compile_lets_a_block_class_compile_more_graphs_than_torchs_eight():
    """Static sizes make a graph per UNet level, bucket and sampling shape: past torch's limit of 8 a block would run
    eagerly from then on; compiling raises it (OneTrainer's compile sets 8192, musubi-tuner recommends 32)."""
    import torch._dynamo.config as dynamo_config

    from trainer.train.compile import RECOMPILE_LIMIT, compile_blocks, dynamo_counts
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_Block(), _Block()])
    old = dynamo_config.recompile_limit
    try:
        dynamo_config.recompile_limit = 8
        assert compile_blocks(model, "default", "static", backend="eager") == {"_Block": 2}
        assert dynamo_config.recompile_limit == RECOMPILE_LIMIT > 8
        before = dynamo_counts()["frames_compiled"]
        for n in range(1, 11):  # ten shapes, ten graphs: none of them falls back to eager
            model.blocks[0](torch.ones(n, 2))
        assert dynamo_counts()["frames_compiled"] - before == 10
        with pytest.raises(ValueError, match="training.compile_dynamic = 'sometimes'"):
            compile_blocks(model, "default", "sometimes")
    finally:
        dynamo_config.recompile_limit = old
        torch._dynamo.reset()


@pytest.mark.parametrize("preset, key, refused, allowed, sets, says", [
    # CUDA graphs
    ("demo", "compile_mode", "reduce-overhead", "default", ["general.device=cpu"],
     "need a CUDA GPU (general.device = cpu)"),
    ("demo", "compile_mode", "reduce-overhead", "default", ["general.device=cuda",
                                                            "training.gradient_checkpointing=true"],
     "activation checkpointing"),
    # the whole denoiser as one graph where weights move between its blocks
    ("demo-flux", "compile_scope", "denoiser", "blocks", ["parts.denoiser.blocks_to_swap=1",
                                                          "training.gradient_checkpointing=true"],
     "moves weights to the GPU between its blocks' calls"),
    ("demo-flux", "compile_scope", "denoiser", "blocks", ["general.num_processes=2", "general.distributed=fsdp",
                                                          "training.method=finetune"],
     "FSDP gathers each block's weights"),
], ids=["cuda-graphs-on-cpu", "cuda-graphs-checkpointed", "whole-swapped", "whole-fsdp"])
def test_validate_refuses_compile_settings_where_they_cannot_run(preset, key, refused, allowed, sets, says):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(preset=preset, overrides=["training.compile=true", f"training.{key}={refused}", *sets])
    assert err.value.key == f"training.{key}" and says in str(err.value) and "\n" not in str(err.value)
    cfg = load_config(preset=preset, overrides=["training.compile=true", f"training.{key}={allowed}", *sets])
    assert cfg.training[key] == allowed


def test_cuda_graph_shapes_are_the_buckets_and_batch_sizes_of_an_epoch():
    from trainer.data.buckets import PlannedBatch
    from trainer.train.compile import (CUDAGRAPH_SHAPE_LIMIT, cudagraph_shape_warning, static_shape_warning,
                                       step_shapes)
    full = [PlannedBatch((0, 1), (0, 1), (64, 64)), PlannedBatch((2, 3), (2, 3), (64, 64))]
    shapes = step_shapes(full + [PlannedBatch((4,), (4,), (64, 64)), PlannedBatch((5, 6), (5, 6), (96, 32))])
    assert shapes == {((64, 64), 2), ((64, 64), 1), ((96, 32), 2)} and cudagraph_shape_warning(shapes) == ""
    many = step_shapes(PlannedBatch((i,), (i,), (64 + 8 * i, 64)) for i in range(CUDAGRAPH_SHAPE_LIMIT + 1))
    assert f"makes {CUDAGRAPH_SHAPE_LIMIT + 1} (bucket, batch size) shapes" in cudagraph_shape_warning(many)
    # compile_dynamic static: a compile of every block class per shape; auto or fewer buckets named
    assert static_shape_warning(shapes) == ""
    said = static_shape_warning(many)
    assert "training.compile_dynamic = static" in said and f"makes {CUDAGRAPH_SHAPE_LIMIT + 1}" in said
    assert "compile_dynamic auto" in said and "data.bucket_step" in said and "\n" not in said
    assert "the blocks again" in said and "whole denoiser" not in said
    whole = static_shape_warning(many, "denoiser")  # compile_scope denoiser: the whole model compiles again
    assert "the whole denoiser again" in whole and "block" not in whole


@pytest.mark.slow  # two short compiled runs (AOTAutograd traces, no kernels made)
def test_compiled_blocks_compute_from_the_bf16_copies_and_train_the_same_lora(tiny_workspace):
    """training.adapter_compute_copies inside the compiled blocks: their graphs take the LoRA layers' bf16 copies as
    inputs (no cast of each weight in forward, none of its gradient in backward: kernels a GPU's host launches), the
    copies' gradients reach the fp32 masters through AOTAutograd's backward, nothing recompiles, and the trained
    LoRA is the one the autocast casts give, bit for bit."""
    import torch
    from safetensors.torch import load_file
    sgd = ["training.mixed_precision=bf16", "training.optimizer.name=sgd", "training.learning_rate=0.5",
           "output.dtype=fp32"]
    trained = {}
    for copies in (True, False):
        run = f"compiled-copies-{copies}"
        r = step_counts.run_compiled("demo", [*sgd, f"training.adapter_compute_copies={copies}"], steps=3,
                                     workspace=tiny_workspace, backend="aot_eager", run_name=run)
        assert r["graph_breaks"] == 0 and r["graphs"] >= 1 and r["recompiles_after_first"] == 0
        log = (tiny_workspace / "runs" / run / "train.log").read_text()
        assert ("LoRA weights computed from bf16 copies" in log) == copies
        trained[copies] = load_file(tiny_workspace / "runs" / run / f"{run}.safetensors")
    assert set(trained[True]) == set(trained[False])
    assert max(float(v.abs().max()) for k, v in trained[True].items() if "lora_B" in k or "lora_up" in k) > 0
    for k, v in trained[False].items():
        assert torch.equal(trained[True][k], v), k


@pytest.mark.slow  # the tiny SD UNet's blocks captured by dynamo
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_compile_finds_the_blocks_of_a_unet_sharded_by_fsdp_and_gives_the_eager_gradients(tiny_workspace,
                                                                                           checkpointing):
    """FSDP2's fully_shard swaps a sharded module's class for a subclass named FSDP<name>: training.compile found no
    repeated block in the sharded UNet, and every FSDP run with it stopped ('FSDPUNet2DConditionModel has no repeated
    blocks to compile'). The UNet sharded as an FSDP run shards it (one gloo process here), its blocks compiled in
    place (dynamo's capture with the eager backend; two processes through AOTAutograd: docs/performance.md): the
    names are the classes' own, nothing breaks, and a step's gradients are the unsharded eager UNet's. Checkpointed,
    a unit's checkpoint stays around its compiled call: inside the compiled region FSDP's hooks (which torch does
    not trace) broke every block back to eager (no graph at all)."""
    import copy
    import socket

    import torch.distributed as dist
    from diffusers import UNet2DConditionModel

    from trainer.config.checks import load_config
    from trainer.memory.checkpointing import enable_checkpointing
    from trainer.parallel.fsdp import FSDPShards, fsdp_plugin, full_tensor
    from trainer.train.compile import compile_blocks, dynamo_counts
    cfg = load_config(preset="demo-finetune", overrides=["general.distributed=fsdp", "general.device=cpu",
                                                         "training.mixed_precision=no"])
    plain = UNet2DConditionModel.from_pretrained(tiny_workspace / "models" / "tiny-sd", subfolder="unet")
    sharded = copy.deepcopy(plain)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        shards = FSDPShards(sharded, fsdp_plugin(cfg, True, print), torch.device("cpu"), 1)
        assert shards.units > 0 and type(sharded).__name__ == "FSDPUNet2DConditionModel"
        if checkpointing:  # as a run on several processes checkpoints (not torch's reentrant checkpoint)
            enable_checkpointing(sharded, reentrant=False)
            sharded.train()
        torch._dynamo.reset()
        before = dynamo_counts()
        assert compile_blocks(sharded, backend="eager") == compile_blocks(copy.deepcopy(plain), backend="eager")
        g = torch.Generator().manual_seed(0)
        x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 32, generator=g)
        t = torch.tensor([10, 500])
        for model in (plain, sharded):
            model(x, t, text).sample.square().mean().backward()
        after = dynamo_counts()
        assert after["graph_breaks"] == before["graph_breaks"] and after["graphs"] > before["graphs"]
        grads = dict(sharded.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(full_tensor(grads[name].grad), p.grad, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
