"""fp8 weights kept in fp8 with their scale, layer by layer: a stored layer holds one byte per weight and computes
with fp8 · scale (per tensor or per output row, as ComfyUI's scaled fp8 files and other releases store them); DoRA
sees that dequantised weight; and an SD single file in ComfyUI's fp8_scaled layout, read through diffusers' own
single-file converter, trains a LoRA close to the one its full-precision file trains, its UNet layers stored with
the file's own fp8 values and scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEMO_DATA, load_tiny_fp32, train_quiet

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _scaled(weight: torch.Tensor, per_row: bool) -> tuple:
    """(fp8 tensor, scale) as a scaled-fp8 file stores ``weight``: weight / scale in float8_e4m3fn."""
    flat = weight.float().flatten(1).abs()
    scale = flat.amax(dim=1) / FP8_MAX if per_row else flat.max() / FP8_MAX
    factor = scale.reshape(-1, *([1] * (weight.ndim - 1))) if per_row else scale
    return (weight.float() / factor).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("per_row", [False, True])
def test_a_stored_layer_keeps_one_byte_per_weight_and_computes_with_fp8_times_scale(per_row):
    from trainer.memory.precision import store_fp8
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    fp8, scale = _scaled(layer.weight.data * 40, per_row)  # values well outside fp8's range before scaling
    store_fp8(layer, fp8, scale, torch.float32)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.element_size() == 1
    assert torch.equal(layer.weight.view(torch.uint8), fp8.view(torch.uint8))  # the file's bits, not re-rounded
    dense = fp8.float() * (scale.reshape(-1, 1) if per_row else scale)
    x = torch.randn(3, 32, requires_grad=True)
    out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, dense, layer.bias), rtol=0, atol=0)
    out.sum().backward()  # backward recomputes the upcast from the fp8 weight
    torch.testing.assert_close(x.grad, dense.sum(0).expand(3, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_stored_linear_trains_as_the_upcast_layer_and_keeps_no_upcast_for_backward(autocast):
    """What a LoRA over an fp8 base relies on: the stored layer's output, its input's gradient and a trainable bias's
    gradient are those of an ordinary layer holding fp8 · scale (bitwise: the same ops in the same dtypes, also under
    bf16 autocast from fp32 inputs), and backward keeps nothing of the weight's size but the fp8 weight itself (the
    upcast is made again there)."""
    from trainer.memory.precision import store_fp8
    torch.manual_seed(2)
    dtype = torch.bfloat16
    layer = torch.nn.Linear(64, 48)
    fp8, scale = _scaled(layer.weight.data * 30, per_row=True)
    bias = layer.bias.data.to(dtype)
    layer.to(dtype).requires_grad_(False)
    layer.bias.requires_grad_(True)  # a trainable bias beside the frozen weight
    store_fp8(layer, fp8, scale, dtype)
    dense = torch.nn.Linear(64, 48).to(dtype)
    dense.weight.data = (fp8.float() * scale[:, None]).to(dtype)
    dense.weight.requires_grad_(False)
    dense.bias.data = bias.clone()
    x_dtype = torch.float32 if autocast else dtype
    x = torch.randn(2, 5, 64, dtype=x_dtype)
    g = torch.randn(2, 5, 48, dtype=dtype)
    results = []
    for net in (layer, dense):
        xi = x.clone().requires_grad_(True)
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = net(xi)
        out.backward(g.to(out.dtype))
        results.append((out.detach(), xi.grad, net.bias.grad, saved))
    (out, gx, gb, saved), (out_d, gx_d, gb_d, saved_d) = results
    assert torch.equal(out, out_d) and gx.dtype == x_dtype and torch.equal(gx, gx_d) and torch.equal(gb, gb_d)
    def weight_sized(saved):
        return [dt for dt, shape in saved if sorted(shape) == [48, 64]]
    assert weight_sized(saved) == [torch.float8_e4m3fn], saved
    assert weight_sized(saved_d) == [dtype], saved_d  # the ordinary layer keeps its weight in bf16 for backward


def test_storing_a_dequantised_file_layer_with_its_scale_gives_the_file_bits_back():
    from trainer.memory.precision import enable_fp8_storage
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    fp8, scale = _scaled(net[0].weight.data * 100, per_row=True)
    net[0].weight.data = (fp8.float() * scale[:, None]).to(torch.bfloat16).float()  # as loaded: bf16 floats
    net.requires_grad_(False)
    assert enable_fp8_storage(net, torch.float32, scales={"0": scale}) == 2
    assert torch.equal(net[0].weight.view(torch.uint8), fp8.view(torch.uint8))
    assert net[1].weight_scale is None and net[1].weight.dtype == torch.float8_e4m3fn  # no scale known: as before


def test_dora_sees_the_dequantised_weight():
    from peft import LoraConfig, get_peft_model
    from trainer.memory.precision import enable_fp8_storage

    def model():
        torch.manual_seed(2)
        return torch.nn.Sequential(torch.nn.Linear(16, 32))

    fp8, scale = _scaled(model()[0].weight.data * 50, per_row=False)
    dense = fp8.float() * scale

    def dora(stored: bool):
        net = model()
        net[0].weight.data = dense.clone()
        peft = get_peft_model(net, LoraConfig(r=4, lora_alpha=4, target_modules=["0"], use_dora=True))
        with torch.no_grad():
            peft.base_model.model[0].lora_B["default"].weight.normal_(0, 0.1)
        if stored:
            enable_fp8_storage(peft, torch.float32, scales={"base_model.model.0": scale})
        return peft

    x = torch.randn(4, 16)
    stored, reference = dora(True), dora(False)
    base = stored.base_model.model[0].base_layer
    assert base.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(base.weight.view(torch.uint8), fp8.view(torch.uint8))
    # peft's DoRA takes the norm of the weight it asks the base layer for: fp8 alone would be off by the scale (×50)
    torch.testing.assert_close(stored(x), reference(x), rtol=1e-5, atol=1e-5)
    from trainer.formats.dora import dora_scale_for
    torch.testing.assert_close(dora_scale_for(stored.base_model.model[0], "default"),
                               dora_scale_for(reference.base_model.model[0], "default"), rtol=1e-6, atol=1e-7)


# --- an SD single file in ComfyUI's fp8_scaled layout, through diffusers' single-file loader ----------------------

def write_fp8_scaled_sd(source: Path, out: Path) -> Path:
    """``source`` (an SD single file) as ComfyUI writes fp8_scaled checkpoints (``comfy/ops.py`` scaled_fp8_ops):
    the UNet's Linear weights as float8_e4m3fn of weight / scale, ``<layer>.scale_weight`` (one value) beside each,
    and the ``scaled_fp8`` marker."""
    state = load_file(str(source))
    for name in [k for k, v in state.items() if k.startswith("model.diffusion_model.") and k.endswith(".weight")
                 and v.ndim == 2]:
        fp8, scale = _scaled(state[name], per_row=False)
        state[name] = fp8
        state[name[: -len(".weight")] + ".scale_weight"] = scale.reshape(())
    state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(out))
    return out


COMMON = ("training.max_steps=3", "training.batch_size=1", "training.learning_rate=0.01", "sampling.prompts=[]",
          "lora.rank=4", "lora.alpha=4", f"data.concepts=[{{path: {DEMO_DATA}}}]")


def test_an_fp8_scaled_sd_file_trains_a_lora_close_to_the_full_precision_ones(tiny_workspace, tmp_path, capfd):
    models = tiny_workspace / "models"
    scaled = write_fp8_scaled_sd(models / "tiny-sd.safetensors", tmp_path / "sd-fp8-scaled.safetensors")
    quantised = sum(k.endswith(".scale_weight") for k in load_file(str(scaled)))
    config = f"model.config_path={models / 'tiny-sd'}"  # the tiny model's sizes (the shipped configs are full size)
    full = load_file(str(next(train_quiet(tmp_path, "full", "demo", f"model.path={models / 'tiny-sd.safetensors'}",
                                          config, *COMMON).glob("*.safetensors"))))
    capfd.readouterr()
    fp8 = load_file(str(next(train_quiet(tmp_path, "fp8", "demo", f"model.path={scaled}",
                                         config, *COMMON).glob("*.safetensors"))))
    log = capfd.readouterr()
    # every layer the file quantised was found under its diffusers name (q/k/v, ff, proj_in/out, time_embed …) and
    # stored in fp8 with its scale, but the two the UNet keeps in full precision anyway (time_embedding)
    stored = [line.split("INFO ", 1)[-1] for line in (log.out + log.err).splitlines() if "fp8 storage" in line]
    assert stored == [f"fp8 storage: {quantised - 2} denoiser layers"], (stored, quantised)
    assert set(fp8) == set(full)
    ups = [k for k in full if "lora_up" in k or "lora_B" in k]
    distance = float(torch.cat([(fp8[k] - full[k]).flatten() for k in ups]).norm()
                     / torch.cat([full[k].flatten() for k in ups]).norm())
    # stated tolerance: within 30 % (relative L2 of the trained halves) of the LoRA the full-precision file trains.
    # Measured: 0.19; the full-precision run with another seed: 1.44; the fp8 values read without their scales: 1.26
    assert distance < 0.30, distance


def test_an_fp8_scaled_flux_transformer_file_loads_as_fp8_times_scale(tmp_path):
    """Flux.1, SD3 and PixArt read their transformer file themselves: the fp8 values there must not be read as the
    weights (each would be off by its scale), and the layers must be found for fp8 storage."""
    from trainer.families import build_tiny
    from trainer.families.flux.keys import bfl_to_diffusers
    paths = build_tiny("tiny-flux", tmp_path / "models")
    state = load_file(str(paths["single_file"]))
    for name in [k for k, v in state.items() if k.endswith(".weight") and v.ndim == 2 and "norm" not in k]:
        fp8, scale = _scaled(state[name] * 100, per_row=False)
        state[name] = fp8
        state[name[: -len(".weight")] + ".scale_weight"] = scale.reshape(())
    state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(tmp_path / "flux-fp8-scaled.safetensors"))
    model = load_tiny_fp32(tmp_path, tmp_path / "flux-fp8-scaled.safetensors",
                           f"model.config_path={paths['diffusers']}")
    dense = bfl_to_diffusers({k: v.float() * state.get(k[: -len(".weight")] + ".scale_weight", torch.tensor(1.0))
                              for k, v in state.items() if not k.endswith(".scale_weight") and k != "scaled_fp8"})
    name = "transformer_blocks.0.attn.to_q"  # split from the file's fused qkv: its rows keep the file's scale
    torch.testing.assert_close(model.transformer.get_submodule(name).weight, dense[name + ".weight"])
    assert name in model.transformer.fp8_file_scales


def _small_layers() -> torch.nn.Sequential:
    """A Linear whose rows range over three orders of magnitude (the smallest far below fp8's smallest normal, 2⁻⁶)
    and a Conv2d of small weights."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Conv2d(4, 8, 3))
    with torch.no_grad():
        net[0].weight.mul_(torch.logspace(-3, 0, 48)[:, None] * 0.1)
        net[1].weight.mul_(0.05)
    return net.requires_grad_(False)  # frozen, as a LoRA's base


def test_fp8_scaled_keeps_fp8s_precision_for_small_weights():
    """parts.denoiser.fp8_scaled: each row is divided by a scale that maps its largest magnitude to 448 before it is
    rounded to fp8, and multiplied back as the layer runs (musubi-tuner's --fp8_scaled, per channel); without it a
    small weight falls among fp8's subnormals, or to 0. A file's own scale still wins."""
    from trainer.memory.precision import enable_fp8_storage
    dense, plain, scaled = _small_layers(), _small_layers(), _small_layers()
    assert enable_fp8_storage(plain, torch.float32, skip=()) == 2
    assert enable_fp8_storage(scaled, torch.float32, skip=(), scaled=True) == 2
    assert plain[0].weight_scale is None
    assert scaled[0].weight_scale.shape == (48, 1) and scaled[1].weight_scale.shape == (8, 1, 1, 1)
    assert torch.equal(scaled[0].weight.float().abs().amax(1), torch.full((48,), FP8_MAX))  # fp8's whole range

    def row_errors(net, i):
        w, q = dense[i].weight.flatten(1), net[i].dequantize().flatten(1)
        return (q - w).norm(dim=1) / w.norm(dim=1)

    for i in (0, 1):
        assert float(row_errors(scaled, i).max()) < 0.05  # fp8's 3 mantissa bits: ~2.7 % a row
    assert float(row_errors(plain, 0).max()) > 0.5 and float(row_errors(plain, 1).max()) > 0.05
    x = torch.randn(3, 64)
    torch.testing.assert_close(scaled[0](x), torch.nn.functional.linear(x, scaled[0].dequantize(), scaled[0].bias))

    from_file = _small_layers()
    enable_fp8_storage(from_file, torch.float32, skip=(), scales={"0": torch.tensor(0.5)}, scaled=True)
    assert float(from_file[0].weight_scale) == 0.5 and from_file[1].weight_scale.shape == (8, 1, 1, 1)


def test_scales_per_block_keep_the_precision_a_few_large_inputs_take_from_their_rows():
    """parts.denoiser.fp8_scale_block: a scale per block of N inputs in each row (musubi-tuner's default
    --fp8_scaled, 64). Where a few inputs are larger than the rest by more than fp8's range of normal numbers (448 /
    2⁻⁶, 4.5 orders of magnitude), a row's scale follows them and the row's other weights fall among fp8's
    subnormals; per block only their own block does (below that, fp8's relative precision is the same across its
    range, and blocks gain ~5 %). A Conv's inputs are flattened with its kernel; a layer whose inputs do not divide
    into two blocks or more keeps one scale per row."""
    from trainer.memory.precision import block_scale, enable_fp8_storage

    def layers():
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.Conv2d(8, 16, 3), torch.nn.Linear(24, 8))
        with torch.no_grad():
            net[0].weight.mul_(0.02 / net[0].weight.std())
            net[0].weight[:, :4] *= 3e4  # four outlier inputs, all in the first block of 64
            net[1].weight.mul_(0.02)
        return net.requires_grad_(False)

    dense, rows, blocks = layers(), layers(), layers()
    assert enable_fp8_storage(rows, torch.float32, skip=(), scaled=True) == 3
    assert enable_fp8_storage(blocks, torch.float32, skip=(), scaled=True, block=64) == 3
    assert blocks[0].weight_scale.shape == (32, 4, 1)  # 256 inputs, 4 blocks
    assert blocks[1].weight_scale.shape == (16, 1, 1, 1)  # 8·3·3 = 72 inputs: not a multiple of 64, one per row
    assert blocks[2].weight_scale.shape == (8, 1)  # 24 inputs: fewer than a block
    # each block uses fp8's whole range
    assert torch.equal(blocks[0].weight.float().reshape(32, 4, 64).abs().amax(2), torch.full((32, 4), FP8_MAX))

    def error(net, i, cols=slice(None)):
        w, q = dense[i].weight.flatten(1)[:, cols], net[i].dequantize().flatten(1)[:, cols]
        return float((q - w).norm() / w.norm())

    rest = slice(64, None)  # the blocks without an outlier
    assert error(blocks, 0, rest) < 0.03 < 0.045 < error(rows, 0, rest), (error(blocks, 0, rest), error(rows, 0, rest))
    assert error(blocks, 0) <= error(rows, 0)
    x = torch.randn(3, 256)
    torch.testing.assert_close(blocks[0](x), torch.nn.functional.linear(x, blocks[0].dequantize(), blocks[0].bias))
    # a Conv2d whose flattened inputs divide: 8·2·2 = 32 inputs, two blocks of 16 (the outlier channel's four kernel
    # weights in the first)
    torch.manual_seed(2)
    conv, dense_conv, row_conv = (torch.nn.Conv2d(8, 16, 2).requires_grad_(False) for _ in range(3))
    with torch.no_grad():
        conv.weight.mul_(0.02 / conv.weight.std())
        conv.weight[:, 0] *= 3e4
        dense_conv.weight.copy_(conv.weight)
        row_conv.weight.copy_(conv.weight)
    assert block_scale(conv.weight, 16).shape == (16, 2, 1) and block_scale(conv.weight, 64).shape == (16,)
    enable_fp8_storage(torch.nn.Sequential(conv), torch.float32, skip=(), scaled=True, block=16)
    enable_fp8_storage(torch.nn.Sequential(row_conv), torch.float32, skip=(), scaled=True)

    def conv_error(layer):  # the block without the outlier channel
        w, q = dense_conv.weight.flatten(1)[:, 16:], layer.dequantize().flatten(1)[:, 16:]
        return float((q - w).norm() / w.norm())

    assert conv_error(conv) < 0.03 < 0.045 < conv_error(row_conv), (conv_error(conv), conv_error(row_conv))
    y = torch.randn(1, 8, 5, 5)
    torch.testing.assert_close(conv(y), torch.nn.functional.conv2d(y, conv.dequantize(), conv.bias))


@pytest.mark.parametrize("sets, key, says", [
    (["parts.denoiser.fp8_scale_block=48"], "parts.denoiser.fp8_scale_block", "power of two"),
    (["parts.denoiser.fp8_scale_block=64", "parts.denoiser.fp8_scaled=false"], "parts.denoiser.fp8_scale_block",
     "fp8_scaled on"),
    (["parts.denoiser.fp8_scale_block=64", "parts.denoiser.fp8_matmul=true"], "parts.denoiser.fp8_scale_block",
     "one scale per output row"),
    (["parts.text_encoder_2.fp8=true", "parts.text_encoder_2.fp8_scale_block=64"],
     "parts.text_encoder_2.fp8_scale_block", "fp8_scaled on"),
])
def test_validate_names_a_scale_block_it_cannot_use(tmp_path, sets, key, says):
    from trainer.config.checks import check_config
    base = [f"general.workspace={tmp_path}", "parts.denoiser.fp8=true", "parts.denoiser.fp8_scaled=true"]
    cfg, issues = check_config(None, [*base, *sets], preset="demo-flux")
    errors = [i for i in issues if i.level == "error"]
    assert cfg is None and [i.key for i in errors] == [key] and says in errors[0].message, issues
    cfg, issues = check_config(None, [*base, "parts.denoiser.fp8_scale_block=64"], preset="demo-flux")
    assert cfg is not None and not [i for i in issues if i.level == "error"], issues


@pytest.mark.slow  # three runs of the tiny Flux.1
def test_a_run_with_scaled_fp8_trains_the_lora_of_the_bf16_run(tiny_workspace):
    common = ("training.max_steps=4", "parts.denoiser.dtype=bf16", "training.mixed_precision=bf16",
              "sampling.at_end=false")
    bf16 = train_quiet(tiny_workspace, "bf16-stored", "demo-flux", *common)
    fp8 = train_quiet(tiny_workspace, "fp8-scaled", "demo-flux", *common, "parts.denoiser.fp8=true",
                      "parts.denoiser.fp8_scaled=true")
    blocks = train_quiet(tiny_workspace, "fp8-blocks", "demo-flux", *common, "parts.denoiser.fp8=true",
                         "parts.denoiser.fp8_scaled=true", "parts.denoiser.fp8_scale_block=16")
    assert "denoiser layers, scaled per output row" in (fp8 / "train.log").read_text()
    assert "denoiser layers, scaled per block of 16 inputs" in (blocks / "train.log").read_text()
    a = load_file(str(next(bf16.glob("*.safetensors"))))
    for run in (fp8, blocks):
        b = load_file(str(next(run.glob("*.safetensors"))))
        assert a.keys() == b.keys()
        ups = [k for k in a if "lora_B" in k]
        distance = float(torch.cat([(b[k] - a[k]).flatten() for k in ups]).norm()
                         / torch.cat([a[k].flatten() for k in ups]).norm())
        # stated tolerance: within 20 % (relative L2 of the trained halves) of the bf16-stored run's LoRA. Measured:
        # per row 0.089, per block of 16 0.089; plain fp8 storage 0.125; the bf16 run with another seed 1.47
        assert 0 < distance < 0.2, (run.name, distance)
