"""Gradient checkpointing's options. ``training.checkpoint_keep_attention``: each block's attention output kept, so
backward recomputes the block without its attention; ``training.gradient_checkpointing_interval``: every Nth block
checkpointed, the others keep their activations. The same gradients and the same trained LoRA as plain
checkpointing, with fewer attention forwards per step (counted, not timed)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from safetensors.torch import load_file
from trainer.memory.checkpointing import (ATTENTION_OPS, Checkpointing, checkpointed, compile_checkpointed,
                                         enable_checkpointing)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import step_counts  # noqa: E402
from checkpoint_attention import AttentionCalls  # noqa: E402  (bench/'s own module)

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention_forwards(graphs) -> int:
    """Attention forwards in AOTAutograd's graphs of a compiled block (its forward, and what its backward recomputes):
    the op itself, or inside the wrappers that run a random op with a saved RNG state (attention may drop out)."""
    def attention(n):
        if n.op != "call_function":
            return False
        if n.target in ATTENTION_OPS:
            return True
        return "rng_state" in str(n.target) and any(a in ATTENTION_OPS for a in n.args if not isinstance(a, fx.Node))
    return sum(1 for g in graphs for n in g.graph.nodes if attention(n))


def _flux_block_grads(keep: bool, compiled: bool = False):
    """(attention forwards run, x's gradient, the trained weight's gradient) of a checkpointed Flux block's forward and
    backward. Compiled: as training.compile compiles it, the checkpoint inside the compiled region, through
    AOTAutograd without kernels; its attention forwards are counted in the forward and backward graphs it made (a
    dispatch mode would make torch.compile fall back to eager)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = FluxTransformerBlock(32, 2, 16).requires_grad_(False)
    block.attn.to_q.weight.requires_grad_(True)  # what a LoRA trains sits inside the block
    graphs = []

    def keep_graph(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    if compiled:
        backend = aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph)
        block.compile(backend=backend)
        compile_checkpointed([block], backend=backend)
    x = torch.randn(2, 12, 32, requires_grad=True)
    text = torch.randn(2, 5, 32)
    temb = torch.randn(2, 32)
    calls = AttentionCalls()
    with contextlib.nullcontext() if compiled else calls:
        # keyword arguments pass on (HunyuanImage's blocks are called with them)
        text_out, out = checkpointed(block, x, text, temb=temb, keep_attention=keep)
        (out.square().mean() + text_out.square().mean()).backward()
    if compiled:
        assert len(graphs) == 2, graphs  # one forward and one backward graph: the block did compile
    return _attention_forwards(graphs) if compiled else calls.forwards, x.grad, block.attn.to_q.weight.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kept_attention_gives_the_same_gradients_with_one_attention_forward_less(compiled):
    plain_calls, plain_x, plain_w = _flux_block_grads(False, compiled)
    kept_calls, kept_x, kept_w = _flux_block_grads(True, compiled)
    assert plain_calls == 2  # the forward, and again when backward recomputes the block
    assert kept_calls == 1
    assert torch.equal(plain_x, kept_x) and torch.equal(plain_w, kept_w)
    if compiled:  # and the eager checkpoint's gradients
        _, eager_x, eager_w = _flux_block_grads(False)
        assert torch.equal(plain_x, eager_x) and torch.equal(plain_w, eager_w)


def test_cross_attention_to_a_caption_is_recomputed_not_kept():
    """An SD/SDXL UNet block: its self-attention is kept; its cross-attention (77 caption tokens against thousands
    of image tokens, here 6 against 64) costs little to recompute and as much memory as self-attention to keep."""
    from diffusers.models.attention import BasicTransformerBlock
    torch.manual_seed(0)
    block = BasicTransformerBlock(32, 2, 16, cross_attention_dim=24).requires_grad_(False)
    block.attn1.to_q.weight.requires_grad_(True)
    x = torch.randn(2, 64, 32, requires_grad=True)
    caption = torch.randn(2, 6, 24)
    calls = {}
    for keep in (False, True):
        mode = AttentionCalls()
        x.grad = None
        with mode:
            checkpointed(block, x, None, caption, keep_attention=keep).square().mean().backward()
        calls[keep] = (mode.forwards, x.grad.clone())
    assert calls[False][0] == 4 and calls[True][0] == 3  # self and cross, twice; then self once, cross twice
    assert torch.equal(calls[False][1], calls[True][1])


def test_a_diffusers_model_takes_the_trainers_checkpointing():
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   axes_dims_rope=(4, 6, 6))
    enable_checkpointing(model, keep_attention=True)
    assert model.gradient_checkpointing
    assert model._gradient_checkpointing_func.keywords == {"keep_attention": True, "reentrant": False}


def _flux_runs(workspace, setting, values):
    """The tiny Flux LoRA trained through ``python -m trainer train`` with checkpointing and each value of
    ``setting``: {value: (attention forwards a counted step, the saved LoRA)}."""
    out = {}
    for value in values:
        name = f"{setting.rsplit('.', 1)[-1]}-{value}".lower().replace("_", "-")
        counted = step_counts.run_case(
            "demo-flux", ["training.mixed_precision=bf16", "training.gradient_checkpointing=true",
                          f"{setting}={str(value).lower()}"], warmup=2, count=1, workspace=workspace, run_name=name)
        attention = sum(v for k, v in counted["op_names"].items()
                        if k.startswith("_scaled_dot_product") and not k.endswith("_backward"))
        out[value] = (attention, load_file(str(workspace / "runs" / name / f"{name}.safetensors")))
    return out


def _same_lora(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_flux_lora_run_keeps_attention_and_trains_the_same_lora(tiny_workspace):
    """The setting reaches the denoiser's blocks (two attention forwards of the tiny Flux's two blocks per step
    instead of four) and the saved LoRA equals plain checkpointing's bit for bit."""
    runs = _flux_runs(tiny_workspace, "training.checkpoint_keep_attention", (False, True))
    assert {k: n for k, (n, _) in runs.items()} == {False: 4, True: 2}
    assert _same_lora(runs[False][1], runs[True][1])


def test_keeping_attention_without_checkpointing_is_warned_about(tmp_path):
    from trainer.config.checks import cross_field_warnings, load_config
    ws = f"general.workspace={tmp_path}"
    keys = {on: {i.key for i in cross_field_warnings(load_config(preset="demo-flux", overrides=[
        ws, "training.checkpoint_keep_attention=true", f"training.gradient_checkpointing={on}"]))}
        for on in ("true", "false")}
    assert "training.checkpoint_keep_attention" in keys["false"]
    assert "training.checkpoint_keep_attention" not in keys["true"]


def test_an_interval_checkpoints_every_nth_block_in_the_order_the_model_calls_them():
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(5)]
    calls = [0] * 5
    for i, block in enumerate(blocks):  # on the first layer: a recomputation stops once it has what backward needs
        block[0].register_forward_hook(lambda m, a, out, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(3, 8, requires_grad=True)
    grads = {}
    for interval in (1, 2):
        calls[:] = [0] * 5
        checkpointing, h = Checkpointing(interval=interval), x
        for block in blocks:
            h = checkpointing(block, h)
        x.grad = None
        h.square().sum().backward()
        grads[interval] = x.grad.clone()
        # a checkpointed block runs again in backward
        assert calls == ([2] * 5 if interval == 1 else [2, 1, 2, 1, 2])
    assert torch.equal(grads[1], grads[2])


def test_a_flux_lora_run_with_an_interval_trains_the_same_lora(tiny_workspace):
    """The tiny Flux's two blocks with interval 2: the first checkpointed, the second not (3 attention forwards a step
    instead of 4), and the LoRA of plain checkpointing, bit for bit."""
    runs = _flux_runs(tiny_workspace, "training.gradient_checkpointing_interval", (1, 2))
    assert {k: n for k, (n, _) in runs.items()} == {1: 4, 2: 3}
    assert _same_lora(runs[1][1], runs[2][1])


def test_an_interval_is_refused_with_block_swapping_and_warned_about_without_checkpointing(tmp_path):
    from trainer.config.checks import check_config, cross_field_warnings, load_config
    ws = f"general.workspace={tmp_path}"
    warned = cross_field_warnings(load_config(preset="demo-flux", overrides=[
        ws, "training.gradient_checkpointing=false", "training.gradient_checkpointing_interval=2"]))
    assert "training.gradient_checkpointing_interval" in {i.key for i in warned}
    cfg, issues = check_config(preset="demo-flux", overrides=[
        ws, "training.gradient_checkpointing=true", "training.gradient_checkpointing_interval=2",
        "parts.denoiser.blocks_to_swap=1"])
    errors = [i for i in issues if i.level == "error"]
    assert cfg is None and [i.key for i in errors] == ["training.gradient_checkpointing_interval"]
    assert "blocks_to_swap" in errors[0].message


def _compiled_block_step(checkpointing: bool):
    """A tiny Flux block compiled as training.compile compiles it (AOTAutograd, no kernels made), run forward and
    backward: (bytes of the activations its forward keeps for backward, parameters not counted; the gradients;
    calls into torch.utils.checkpoint's Python in the second step)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = FluxTransformerBlock(32, 2, 16).requires_grad_(False)
    block.attn.to_q.weight.requires_grad_(True)
    block.compile(backend="aot_eager")
    compile_checkpointed([block], backend="aot_eager")
    params = {id(p) for p in block.parameters()}
    x, text, temb = torch.randn(2, 64, 32, requires_grad=True), torch.randn(2, 5, 32), torch.randn(2, 32)
    kept, calls = [], [0]

    def pack(t):
        if id(t) not in params and t.is_floating_point():
            kept.append(t.numel() * t.element_size())
        return t

    def profile(frame, event, arg):
        calls[0] += event == "call" and frame.f_code.co_filename.endswith("utils/checkpoint.py")

    for step in range(2):
        kept.clear()
        x.grad = block.attn.to_q.weight.grad = None
        if step:
            sys.setprofile(profile)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = checkpointed(block, x, text, temb=temb) if checkpointing else block(x, text, temb=temb)
        (out[0].square().mean() + out[1].square().mean()).backward()
        sys.setprofile(None)
    return sum(kept), (x.grad, block.attn.to_q.weight.grad), calls[0]


def test_a_compiled_blocks_checkpoint_runs_inside_its_compiled_region():
    """training.compile with checkpointing: the compiled forward keeps the block's inputs alone (checkpointing's
    memory), backward recomputes inside the compiled graph (no Python of torch's checkpoint per step), and the
    gradients are the eager checkpoint's bit for bit."""
    kept, grads, calls = _compiled_block_step(True)
    kept_all, _, _ = _compiled_block_step(False)
    inputs = (2 * 64 * 32 + 2 * 5 * 32 + 2 * 32) * 4
    assert kept <= inputs < kept_all / 4, (kept, inputs, kept_all)
    assert calls == 0
    torch.manual_seed(0)
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    block = FluxTransformerBlock(32, 2, 16).requires_grad_(False)
    block.attn.to_q.weight.requires_grad_(True)
    x = torch.randn(2, 64, 32, requires_grad=True)
    text, temb = torch.randn(2, 5, 32), torch.randn(2, 32)
    out = checkpointed(block, x, text, temb=temb)  # the eager checkpoint
    (out[0].square().mean() + out[1].square().mean()).backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], block.attn.to_q.weight.grad)


class _Nested(torch.nn.Module):
    """A block whose output is nested (a tuple holding a dict): the reentrant checkpoint must track every tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.a(x) * scale, {"b": torch.nn.functional.dropout(self.b(x), 0.5)}


def _nested_step(reentrant: bool, x_grad: bool, **kwargs):
    torch.manual_seed(0)
    block = _Nested().requires_grad_(False)
    block.b.weight.requires_grad_(True)  # trained inside; the input may need no gradient (a LoRA's first block)
    x = torch.randn(3, 8, requires_grad=x_grad)
    calls = [0]
    block.a.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    first, rest = checkpointed(block, x, reentrant=reentrant, **kwargs)
    (first.square().sum() + rest["b"].square().sum()).backward()
    return block.b.weight.grad, x.grad, calls[0]


@pytest.mark.parametrize("x_grad", [False, True], ids=["input-without-grad", "input-with-grad"])
def test_the_reentrant_checkpoint_gives_the_non_reentrant_ones_gradients(x_grad):
    """One process checkpoints with torch's reentrant checkpoint (a forward without autograd, no Python hook per saved
    tensor): the same gradients bit for bit (dropout's random draws replayed), also where the block's input needs no
    gradient and the trained weight sits inside it, and whatever structure the block returns."""
    w, x, calls = _nested_step(True, x_grad, scale=2.0)
    w_plain, x_plain, _ = _nested_step(False, x_grad, scale=2.0)
    assert calls == 2  # the forward, and again in backward
    assert w is not None and torch.equal(w, w_plain)
    assert (x is None) == (not x_grad) and (x is None or torch.equal(x, x_plain))
    # a keyword tensor that needs a gradient (handed to the reentrant checkpoint as a positional one), and a tensor
    # that needs one nested in a tuple (the non-reentrant checkpoint takes that call): their gradients arrive
    for reentrant in (True, False):
        torch.manual_seed(0)
        block = _Nested().requires_grad_(False)
        scale = torch.tensor(2.0, requires_grad=True)
        first, _ = checkpointed(block, torch.randn(3, 8), reentrant=reentrant, scale=scale)
        first.sum().backward()
        assert scale.grad is not None and scale.grad != 0
        if reentrant:
            kw_grad = scale.grad
        else:
            assert torch.equal(kw_grad, scale.grad)
    base = torch.tensor(3.0, requires_grad=True)
    pair = (base * 2, torch.tensor(1.0))  # computed from a trained value, as a block's inputs are
    first, _ = checkpointed(_PairScaled().requires_grad_(False), torch.randn(3, 8), pair, reentrant=True)
    (first.sum() + pair[0]).backward()
    assert base.grad is not None
    torch.testing.assert_close(base.grad, 2 * (first.detach().sum() / pair[0].detach() + 1))


class _PairScaled(_Nested):
    def forward(self, x, pair):
        return super().forward(x, scale=pair[0] * pair[1])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_after_backward_the_step_graph_keeps_no_checkpointed_blocks_input(reentrant):
    """What a checkpoint saves for backward is freed there, though the step's graph lives on as long as its loss
    does (the training loop held it into the next step's forward): the block's inputs, positional and keyword, are
    not kept with it. The reentrant checkpoint's function object held them (every checkpointed block's input, the
    activations checkpointing keeps, alive twice at the next forward: 1.07 GiB of the flux-lora-24gb estimate)."""
    import gc
    import weakref
    torch.manual_seed(0)
    block = _Nested().requires_grad_(False)
    block.b.weight.requires_grad_(True)
    x, scale = torch.randn(3, 8, requires_grad=True) * 1, torch.tensor(2.0, requires_grad=True) * 1
    inputs = [weakref.ref(x), weakref.ref(scale)]
    first, rest = checkpointed(block, x, reentrant=reentrant, scale=scale)
    loss = first.square().sum() + rest["b"].square().sum()
    del x, scale, first, rest
    loss.backward()
    gc.collect()
    assert loss.grad_fn is not None  # the graph lives on
    assert [r() is None for r in inputs] == [True, True]


def test_a_block_with_nothing_to_train_is_not_recomputed():
    """No input needs a gradient and nothing inside trains: backward never reaches the block (no recomputation)."""
    block = _Nested().requires_grad_(False)
    calls = [0]
    block.a.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    first, _ = checkpointed(block, torch.randn(3, 8), reentrant=True)
    assert not first.requires_grad and calls[0] == 1


@pytest.mark.slow  # two tiny Flux runs through the trainer
def test_a_checkpointed_flux_lora_run_trains_the_lora_of_one_without_checkpointing(tiny_workspace):
    """Checkpointing (torch's reentrant checkpoint, one process) changes no value: the saved LoRA of a checkpointed
    tiny Flux run equals the unchecked run's bit for bit."""
    runs = {}
    for on in (True, False):
        name = f"checkpointing-{on}".lower()
        counted = step_counts.run_case("demo-flux", ["training.mixed_precision=bf16",
                                                     f"training.gradient_checkpointing={str(on).lower()}"],
                                       warmup=2, count=1, workspace=tiny_workspace, run_name=name)
        runs[on] = (counted, load_file(str(tiny_workspace / "runs" / name / f"{name}.safetensors")))
    assert _same_lora(runs[True][1], runs[False][1])
    mm = {on: runs[on][0]["op_names"].get("mm", 0) + runs[on][0]["op_names"].get("addmm", 0) for on in runs}
    assert mm[True] > mm[False]  # the blocks did run again in backward


def _unet_lora_grads(reentrant: bool):
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4,
                                out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8).requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                       init_lora_weights=False), unet)
    enable_checkpointing(unet, reentrant=reentrant)
    unet.train()
    torch.manual_seed(1)
    with torch.autocast("cpu", torch.bfloat16):
        out = unet(torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 7, 32)).sample
    out.float().square().mean().backward()
    return [p.grad for p in unet.parameters() if p.requires_grad]


def test_in_a_unet_the_reentrant_checkpoint_sums_skip_gradients_in_another_order():
    """Where a tensor feeds a checkpointed block and something else too (a UNet's skip connections), the reentrant
    checkpoint sums its gradient's parts in another order than the autograd engine does with the non-reentrant one:
    the LoRA's gradients agree to bf16's rounding, not bit for bit (a chain of blocks, as in the Flux run above,
    gives the same bits)."""
    plain, reentrant = _unet_lora_grads(False), _unet_lora_grads(True)
    assert len(plain) == len(reentrant) == 96  # lora_A and lora_B of 4 projections in 12 attentions
    for a, b in zip(plain, reentrant):
        torch.testing.assert_close(b, a, rtol=2 ** -7, atol=1e-4)
