"""parts.denoiser.blocks_to_swap (trainer/memory/block_swap.py): the swapped blocks' frozen weights live in CPU RAM and visit
the device one block at a time, and a step gives the same gradients as with every block resident.

On a CPU run the "device copy" of a block is its RAM copy, so here an evicted block is parked as NaNs instead: any
op that read an evicted block's weights would turn the gradients to NaN, so equal gradients show the swap schedule is
right (each block in for its forward and again for the recompute of its backward), not merely harmless."""

from __future__ import annotations

import pytest
import torch


def _flux(ws, blocks_to_swap: int, checkpointing: bool = True, *settings: str):
    """The tiny Flux with a 4-block transformer (2 double, 2 single), its LoRA, storage and checkpointing set up as
    the training loop does; the swap (when asked) parks evicted blocks as NaNs."""
    from diffusers import FluxTransformer2DModel

    from trainer.memory.block_swap import plan_block_swap
    from trainer.config.checks import load_config
    from trainer.methods.make import make_method
    from trainer.families.sources import load_model
    from trainer.memory.precision import apply_storage
    # the config asks for checkpointing with a swap (the no-checkpointing test turns it off on the model itself)
    cfg = load_config(None, ["model.path=builtin:tiny-flux", f"general.workspace={ws}",
                             f"parts.denoiser.blocks_to_swap={blocks_to_swap}", "training.gradient_checkpointing=true",
                             "lora.unet_targets=attn_mlp", *settings])
    model = load_model(cfg, str(ws), "cpu")
    old = model.transformer
    torch.manual_seed(0)
    model.transformer = FluxTransformer2DModel(**{**old.config, "num_layers": 2, "num_single_layers": 2}).to(old.dtype)
    model.transformer.requires_grad_(False)
    torch.manual_seed(1)
    method = make_method(model, cfg)
    swap = plan_block_swap(model, cfg, "cpu")
    if swap is not None:
        swap.park = lambda t: torch.full_like(t, float("nan"))
    apply_storage(model, method, cfg)
    if checkpointing:
        model.transformer.enable_gradient_checkpointing()
    model.transformer.train()
    return cfg, model, method, swap


def _grads(cfg, model, method, ws):
    from trainer.memory import estimate as ev
    from trainer.memory.estimate_session import cpu_autocast
    loop = ev.step_trainer(model, method, cfg, cpu_autocast("no"), str(ws))
    batch = ev.make_batch(model, method, cfg, (64, 64), text_cached=True)
    torch.manual_seed(2)
    loop.generator = torch.Generator().manual_seed(3)
    from trainer.train.step import forward_loss
    forward_loss(loop, batch).backward()
    return {n: p.grad.clone() for n, p in model.transformer.named_parameters() if p.grad is not None}


def test_swapped_blocks_visit_one_at_a_time_and_the_gradients_are_unchanged(tmp_path):
    cfg, model, method, swap = _flux(tmp_path, 3)
    blocks = list(model.transformer.transformer_blocks) + list(model.transformer.single_transformer_blocks)
    assert swap.blocks == blocks[:3]
    for block in blocks[:3]:  # parked: frozen weights NaN, adapters in place
        assert all(p.isnan().all() for p in block.parameters() if not p.requires_grad)
        assert all(not p.isnan().any() for p in block.parameters() if p.requires_grad)
    assert any(p.requires_grad for p in blocks[0].parameters())  # the swapped blocks have adapters
    swapped = _grads(cfg, model, method, tmp_path)
    # forward brings in blocks 0, 1, 2 (each evicting the last); backward recomputes 2 (still in), then 1 and 0
    assert swap.loads == 5 and swap.resident == [0]
    _, plain_model, plain_method, none = _flux(tmp_path, 0)
    assert none is None
    plain = _grads(cfg, plain_model, plain_method, tmp_path)
    assert plain.keys() == swapped.keys() and len(plain) > 8
    for name in plain:
        assert torch.equal(plain[name], swapped[name]), name


def test_without_checkpointing_a_swapped_block_is_gone_when_backward_needs_it(tmp_path):
    """Why the config asks for gradient checkpointing: without it backward reads the evicted weights."""
    cfg, model, method, swap = _flux(tmp_path, 3, checkpointing=False)
    grads = _grads(cfg, model, method, tmp_path)
    assert any(g.isnan().any() for g in grads.values())


def test_fp8_storage_of_swapped_blocks_stays_in_ram(tmp_path):
    cfg, model, method, swap = _flux(tmp_path, 2, True, "parts.denoiser.fp8=true")
    parked = [m for b in swap.blocks for m in b.modules()
              if type(m) is torch.nn.Linear and not m.weight.requires_grad and "norm_out" not in str(m)]
    assert parked and all(m.weight.float().isnan().all() for m in parked)
    copies = [cpu for i in swap.copies for _, _, cpu in swap.copies[i]]
    assert any(c.dtype == torch.float8_e4m3fn for c in copies)
    grads = _grads(cfg, model, method, tmp_path)  # each layer's upcast in backward finds the weights in
    assert swap.loads == 3 and not any(g.isnan().any() for g in grads.values())


@pytest.mark.parametrize("settings, words", [
    (["parts.denoiser.blocks_to_swap=4", "training.gradient_checkpointing=false"], "needs training.gradient_checkpointing"),
    (["parts.denoiser.blocks_to_swap=4", "training.gradient_checkpointing=true", "training.method=finetune"],
     "fine-tune"),
])
def test_block_swap_is_refused_where_it_cannot_work(settings, words):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, ["model.path=builtin:tiny-flux", *settings])
    assert err.value.key == "parts.denoiser.blocks_to_swap"


def test_block_swap_names_the_blocks_a_model_has(tmp_path):
    from trainer.memory.block_swap import plan_block_swap
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    from trainer.families.sources import load_model
    for path, n, words in (("builtin:tiny-flux", 2, "has 2 blocks"), ("builtin:tiny-sd", 1, "no transformer blocks")):
        cfg = load_config(None, [f"model.path={path}", f"general.workspace={tmp_path}", f"parts.denoiser.blocks_to_swap={n}",
                                 "training.gradient_checkpointing=true"])
        with pytest.raises(ConfigError, match=words) as err:
            plan_block_swap(load_model(cfg, str(tmp_path), "cpu"), cfg, "cpu")
        assert err.value.key == "parts.denoiser.blocks_to_swap"


def test_a_run_with_swapped_blocks_trains_the_same_lora(tmp_path):
    """Through the training loop, with fp8 storage and the text encoders offloaded: the same LoRA file as without."""
    from safetensors.torch import load_file

    from tests.conftest import train_quiet
    common = ("parts.denoiser.fp8=true", "data.offload_text_encoders=true", "training.gradient_checkpointing=true",
              "training.max_steps=3", "sampling.prompts=[]")
    plain = load_file(str(train_quiet(tmp_path, "plain", "demo-flux", *common) / "plain.safetensors"))
    run = train_quiet(tmp_path, "swap", "demo-flux", "parts.denoiser.blocks_to_swap=1", *common)
    swapped = load_file(str(run / "swap.safetensors"))
    assert "block swap: 1 of 2 denoiser blocks" in (run / "train.log").read_text()
    assert plain.keys() == swapped.keys()
    for k in plain:
        assert torch.equal(plain[k], swapped[k]), k


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_the_estimate_counts_one_swapped_block(tmp_path):
    """trainer/memory/estimate.py: the swapped blocks' frozen weights leave the peak, but for the largest one (it is on
    the device while it runs). A 4-block tiny Flux from configs alone (the estimator needs no weights)."""
    import json
    import shutil

    from trainer.memory import estimate as ev

    from trainer.config.checks import load_config
    from trainer.families.flux.tiny import ensure_tiny
    folder = tmp_path / "flux4"
    shutil.copytree(ensure_tiny("tiny-flux", tmp_path / "models")["diffusers"], folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 2, "num_single_layers": 2}))
    base = [f"model.path={folder}", "model.family=flux-dev", "training.gradient_checkpointing=true",
            "sampling.prompts=[]"]
    plain = ev.run_estimate(load_config(None, base), workspace=str(tmp_path), phases=("train",))
    swapped = ev.run_estimate(load_config(None, base + ["parts.denoiser.blocks_to_swap=3"]), workspace=str(tmp_path),
                              phases=("train",))
    saved = plain.phases["train"].weights - swapped.phases["train"].weights
    # blocks 0, 1 (double) and 2 (single) swapped; one double block can be resident: a double and a single saved
    per_block = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in _blocks_of(folder)]
    assert per_block[0] == per_block[1] > per_block[2]
    assert saved > 0 and abs(saved - (per_block[1] + per_block[2])) <= 0.01 * saved
    assert swapped.details["blocks_swapped_gib"] == round(saved / ev.GiB, 3)


def _blocks_of(folder):
    from diffusers import FluxTransformer2DModel
    t = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(str(folder / "transformer")))
    return list(t.transformer_blocks) + list(t.single_transformer_blocks)


def test_with_swapped_blocks_an_offloaded_encode_larger_than_the_swapped_denoiser_is_the_peak(tmp_path):
    """The estimate's encode phase with the text encoders offloaded is the larger of the caption encode (encoders in,
    denoiser out) and the denoiser's VAE encode; with swapped blocks the denoiser's side is measured whole and its
    saving taken off after, so the comparison must use the saving too: here the denoiser (4 blocks of width 512) is the
    peak without swapping, the T5 encode (a wide feed-forward) with 3 of 4 blocks swapped."""
    import json
    import shutil

    from trainer.memory import estimate as ev

    from trainer.config.checks import load_config
    from trainer.families.flux.tiny import ensure_tiny
    folder = tmp_path / "flux4"
    shutil.copytree(ensure_tiny("tiny-flux", tmp_path / "models")["diffusers"], folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config.update(num_layers=2, num_single_layers=2, num_attention_heads=8, attention_head_dim=64,
                  axes_dims_rope=[16, 24, 24], joint_attention_dim=256)
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    t5 = json.loads((folder / "text_encoder_2" / "config.json").read_text())
    t5.update(d_model=256, d_ff=5120, num_layers=4, d_kv=32, num_heads=8)
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps(t5))
    base = [f"model.path={folder}", "model.family=flux-dev", "training.gradient_checkpointing=true",
            "sampling.prompts=[]", "data.offload_text_encoders=true"]
    plain = ev.run_estimate(load_config(None, base), workspace=str(tmp_path), phases=("encode",))
    swapped = ev.run_estimate(load_config(None, base + ["parts.denoiser.blocks_to_swap=3"]), workspace=str(tmp_path),
                              phases=("encode",))
    assert not plain.details.get("encode_without_denoiser")  # the denoiser's side is the peak
    assert swapped.details.get("encode_without_denoiser")  # less the swapped blocks, the caption encode is
    saving = swapped.details["blocks_swapped_gib"] * ev.GiB
    assert plain.phases["encode"].total - saving < swapped.phases["encode"].total < plain.phases["encode"].total
