"""``training.checkpoint_keep_attention``: gradient checkpointing that keeps each block's attention output, so
backward recomputes the block without its attention. The same gradients and the same trained LoRA as plain
checkpointing, one attention forward fewer per block and step (counted, not timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer.memory.checkpointing import checkpointed, enable_checkpointing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import step_counts  # noqa: E402
from checkpoint_attention import AttentionCalls  # noqa: E402  (bench/'s own module)

pytestmark = pytest.mark.usefixtures("one_thread")


def _flux_block_grads(keep: bool, compiled: bool = False):
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    torch.manual_seed(0)
    block = FluxTransformerBlock(32, 2, 16).requires_grad_(False)
    block.attn.to_q.weight.requires_grad_(True)  # what a LoRA trains sits inside the block
    if compiled:  # training.compile's regional compile (AOTAutograd traces forward and backward)
        block.compile(backend="aot_eager")
    x = torch.randn(2, 12, 32, requires_grad=True)
    text = torch.randn(2, 5, 32)
    temb = torch.randn(2, 32)
    calls = AttentionCalls()
    with calls:
        # keyword arguments pass on (HunyuanImage's blocks are called with them)
        text_out, out = checkpointed(block, x, text, temb=temb, keep_attention=keep)
        (out.square().mean() + text_out.square().mean()).backward()
    return calls.forwards, x.grad, block.attn.to_q.weight.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kept_attention_gives_the_same_gradients_with_one_attention_forward_less(compiled):
    plain_calls, plain_x, plain_w = _flux_block_grads(False, compiled)
    kept_calls, kept_x, kept_w = _flux_block_grads(True, compiled)
    assert plain_calls == 2  # the forward, and again when backward recomputes the block
    assert kept_calls == 1
    assert torch.equal(plain_x, kept_x) and torch.equal(plain_w, kept_w)


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
    assert model.gradient_checkpointing and model._gradient_checkpointing_func.keywords == {"keep_attention": True}


def test_a_flux_lora_run_keeps_attention_and_trains_the_same_lora(tiny_workspace):
    """Through ``python -m trainer train``: the setting reaches the denoiser's blocks (two attention forwards of
    the tiny Flux's two blocks per step instead of four) and the saved LoRA equals plain checkpointing's bit for
    bit."""
    counts, loras = {}, {}
    for keep in (False, True):
        name = f"keep-attention-{keep}".lower()
        counts[keep] = step_counts.run_case(
            "demo-flux", ["training.mixed_precision=bf16", "training.gradient_checkpointing=true",
                          f"training.checkpoint_keep_attention={str(keep).lower()}"],
            warmup=2, count=1, workspace=tiny_workspace, run_name=name)
        loras[keep] = load_file(str(tiny_workspace / "runs" / name / f"{name}.safetensors"))
    attention = {keep: sum(v for k, v in c["op_names"].items() if k.startswith("_scaled_dot_product")
                           and not k.endswith("_backward")) for keep, c in counts.items()}
    assert attention == {False: 4, True: 2}
    assert loras[False].keys() == loras[True].keys()
    assert all(torch.equal(loras[False][k], loras[True][k]) for k in loras[False])


def test_keeping_attention_without_checkpointing_is_warned_about(tmp_path):
    from trainer.config.checks import cross_field_warnings, load_config
    ws = f"general.workspace={tmp_path}"
    keys = {on: {i.key for i in cross_field_warnings(load_config(preset="demo-flux", overrides=[
        ws, "training.checkpoint_keep_attention=true", f"training.gradient_checkpointing={on}"]))}
        for on in ("true", "false")}
    assert "training.checkpoint_keep_attention" in keys["false"]
    assert "training.checkpoint_keep_attention" not in keys["true"]
