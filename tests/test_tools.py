"""The model tools (``python -m trainer convert|merge|resize|sample``) on the tiny models.

LoRAs are made the way training makes them: peft adapters with random weights, written by the project's
kohya writer (trainer/formats/kohya.py), and read back here by diffusers, so every comparison is against an
independent loader or a computation done in the test."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]  # attention + LoCon convs
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
PROMPT = "a photo of a red square"


def cli(*args: str) -> int:
    from trainer.__main__ import main
    return main([str(a) for a in args])


def _pipe(folder: Path, xl: bool = False):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    cls = StableDiffusionXLPipeline if xl else StableDiffusionPipeline
    kw = {} if xl else {"safety_checker": None, "requires_safety_checker": False}
    pipe = cls.from_pretrained(str(folder), local_files_only=True, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _from_single_file(path: Path, config: Path):
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_single_file(str(path), config=str(config), local_files_only=True,
                                                    safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _write_lora(folder: Path, path: Path, *, xl: bool = False, seed: int = 1, rank: int = 4, alpha: float = 2.0):
    """A kohya LoRA/LoCon with non-zero up weights and alpha != rank, written by Atelier's writer."""
    from peft import LoraConfig

    from trainer.families.common.sd_kit.lora import lora_metadata
    from trainer.families.common.sd_kit.lora import sd_kohya_lora_state_dict as kohya_lora_state_dict
    from trainer.formats.kohya import save_lora_kohya
    pipe = _pipe(folder, xl)
    pipe.unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=UNET_TARGETS,
                                     init_lora_weights="gaussian"))
    te = None
    if not xl:
        pipe.text_encoder.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=TE_TARGETS,
                                                 init_lora_weights="gaussian"))
        te = pipe.text_encoder
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model in (pipe.unet, te):
            for name, param in (model.named_parameters() if model is not None else ()):
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    family = "sdxl" if xl else "sd15"
    state = kohya_lora_state_dict(pipe.unet, te, family=family)
    save_lora_kohya(path, state, lora_metadata(family, title=path.stem), "fp32")
    return path


@pytest.fixture(scope="module")
def made(tiny_workspace, tmp_path_factory):
    """Two SD 1.5 LoRAs and one SDXL LoRA for the tiny models."""
    root = tmp_path_factory.mktemp("tools")
    sd, xl = tiny_workspace / "models" / "tiny-sd", tiny_workspace / "models" / "tiny-sdxl"
    return {
        "root": root, "sd": sd,
        "lora": _write_lora(sd, root / "a.safetensors", seed=1),
        "lora2": _write_lora(sd, root / "b.safetensors", seed=2, rank=2, alpha=2.0),
        "xl_lora": _write_lora(xl, root / "xl.safetensors", xl=True, seed=3),
    }


def _image(pipe, seed: int = 0) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    return pipe(PROMPT, num_inference_steps=2, generator=gen, output_type="np", height=64, width=64).images[0]


def _delta(lora: dict, name: str) -> torch.Tensor:
    down, up = lora[f"{name}.lora_down.weight"].double(), lora[f"{name}.lora_up.weight"].double()
    alpha = float(lora[f"{name}.alpha"])
    return (up.flatten(1) @ down.flatten(1)) * alpha / down.shape[0]


# ------------------------------------------------------------------------------------------------
# convert
# ------------------------------------------------------------------------------------------------

def test_convert_folder_to_single_file_and_back(made, tiny_workspace, tmp_path, capsys):
    sd = made["sd"]
    full = tmp_path / "sd.safetensors"
    assert cli("convert", sd, "--to", "single-file", "--dtype", "fp32", "--out", full) == 0
    assert f"wrote {full}" in capsys.readouterr().out
    original = _pipe(sd).unet.state_dict()
    loaded = _from_single_file(full, sd).unet.state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(original[k], loaded[k]) for k in original)

    half = tmp_path / "sd16.safetensors"
    assert cli("convert", sd, "--to", "single-file", "--dtype", "fp16", "--out", half) == 0
    ratio = half.stat().st_size / full.stat().st_size
    assert 0.45 < ratio < 0.55, ratio
    assert {t.dtype for t in load_file(half).values()} == {torch.float16}
    # the dtype defaults to the source's own: converting the fp16 file back keeps fp16
    back = tmp_path / "back"
    assert cli("convert", half, "--to", "diffusers", "--config-path", sd, "--workspace", tiny_workspace,
               "--out", back) == 0
    unet = load_file(next((back / "unet").glob("*.safetensors")))
    assert {t.dtype for t in unet.values()} == {torch.float16}
    assert all(torch.equal(original[k].half(), unet[k]) for k in original)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_convert_refuses_bad_input(made, tmp_path, capsys):
    sd = made["sd"]
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"keep me")
    assert cli("convert", sd, "--to", "single-file", "--out", taken) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and str(taken) in err
    assert taken.read_bytes() == b"keep me"
    assert cli("convert", tmp_path / "nope", "--to", "single-file", "--out", tmp_path / "x.safetensors") == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli("convert", sd, "--to", "single-file", "--out", tmp_path / "folder") == 2
    assert ".safetensors" in capsys.readouterr().err
    assert cli("convert", made["lora"], "--to", "diffusers", "--out", tmp_path / "d") == 2
    assert "LoRA" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# merge
# ------------------------------------------------------------------------------------------------

def test_merge_equals_base_plus_delta_and_fused_lora(made, tmp_path, capsys):
    sd, lora_path, lora2_path = made["sd"], made["lora"], made["lora2"]
    out = tmp_path / "merged.safetensors"
    assert cli("merge", sd, f"{lora_path}:0.7", f"{lora2_path}:-0.5", "--out", out) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    base = _pipe(sd)
    merged = _from_single_file(out, sd)
    lora, lora2 = load_file(lora_path), load_file(lora2_path)
    checks = [("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"),
              ("unet", "up_blocks.1.resnets.0.conv1"),  # LoCon 3x3 conv
              ("unet", "mid_block.attentions.0.transformer_blocks.0.attn2.to_v"),
              ("text_encoder", "text_model.encoder.layers.1.self_attn.out_proj")]
    for part, path in checks:
        kohya = ("lora_unet_" if part == "unet" else "lora_te_") + path.replace(".", "_")
        module_path = path if part == "unet" or hasattr(base.text_encoder, "text_model") else \
            path.removeprefix("text_model.")
        w0 = getattr(base, part).get_submodule(module_path).weight.detach().double()
        w1 = getattr(merged, part).get_submodule(module_path).weight.detach().double()
        expected = w0 + (0.7 * _delta(lora, kohya) - 0.5 * _delta(lora2, kohya)).reshape(w0.shape)
        assert not torch.allclose(w0, w1, atol=1e-4), path  # the merge changed it
        torch.testing.assert_close(w1, expected, atol=1e-5, rtol=1e-5)
    meta = safe_open(str(out), framework="pt").metadata()
    assert [m["weight"] for m in json.loads(meta["atelier_merged_loras"])] == [0.7, -0.5]

    # one LoRA: the merged model draws what diffusers draws with the LoRA loaded and fused
    one = tmp_path / "one"
    assert cli("merge", sd, f"{lora_path}:0.8", "--out", one) == 0
    reference = _pipe(sd)
    reference.load_lora_weights(str(lora_path))
    reference.fuse_lora(lora_scale=0.8)
    merged_pipe = _pipe(one)
    merged_pipe.scheduler = reference.scheduler  # a saved folder carries DDIM, as fine-tunes do; compare like with like
    mine = _image(merged_pipe)
    assert np.abs(mine - _image(reference)).max() < 2e-3
    base.scheduler = reference.scheduler
    assert np.abs(mine - _image(base)).max() > 1e-2  # and the LoRA matters


def test_merge_refuses_wrong_family_and_non_lora(made, tiny_workspace, tmp_path, capsys):
    sd = made["sd"]
    out = tmp_path / "m.safetensors"
    assert cli("merge", sd, made["xl_lora"], "--out", out) == 2
    err = capsys.readouterr().err.strip()
    n = len([k for k in load_file(made["xl_lora"]) if k.endswith(".lora_down.weight")])
    assert f"only 0 of its {n} layers match" in err and "sdxl" in err, err
    assert len(err.splitlines()) == 1
    checkpoint = tiny_workspace / "models" / "tiny-sd.safetensors"
    assert cli("merge", sd, checkpoint, "--out", out) == 2
    err = capsys.readouterr().err
    assert "is not a LoRA file" in err and "full model checkpoint" in err
    assert cli("merge", sd, tmp_path / "missing.safetensors", "--out", out) == 2
    assert "missing.safetensors' does not exist" in capsys.readouterr().err
    assert cli("merge", sd, f"{made['lora']}:lots", "--out", out) == 2
    assert "must be a number" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# resize
# ------------------------------------------------------------------------------------------------

def test_resize_keeps_full_rank_and_truncates_optimally(made, tmp_path, capsys):
    src = load_file(made["lora"])
    names = [k[: -len(".lora_down.weight")] for k in src if k.endswith(".lora_down.weight")]
    same = tmp_path / "r4.safetensors"
    assert cli("resize", made["lora"], "--rank", "4", "--out", same) == 0
    full = load_file(same)
    for name in names:
        torch.testing.assert_close(_delta(full, name), _delta(src, name), rtol=1e-5, atol=1e-7)
    from trainer.tools.resize import resize_layer  # the SVD path itself at full rank (the CLI copies such layers)
    for name in names:
        layer = {"down": src[f"{name}.lora_down.weight"], "up": src[f"{name}.lora_up.weight"]}
        new, dropped = resize_layer(layer, float(src[f"{name}.alpha"]), 4)
        assert dropped.numel() == 0 and new["down"].shape == layer["down"].shape
        rebuilt = {f"{name}.lora_down.weight": new["down"], f"{name}.lora_up.weight": new["up"],
                   f"{name}.alpha": new["alpha"]}
        torch.testing.assert_close(_delta(rebuilt, name), _delta(src, name), rtol=1e-5, atol=1e-7)

    low = tmp_path / "r2.safetensors"
    assert cli("resize", made["lora"], "--rank", "2", "--out", low) == 0
    assert f"wrote {low}" in capsys.readouterr().out
    small = load_file(low)
    assert {small[f"{n}.lora_down.weight"].shape[0] for n in names} == {2}
    for name in names:
        target = _delta(src, name)
        s = torch.linalg.svd(target, full_matrices=False).S
        error = torch.linalg.norm(_delta(small, name) - target)
        best = s[2:].pow(2).sum().sqrt()  # Eckart-Young: the best rank-2 error
        assert error <= best * (1 + 1e-6) + 1e-9, (name, float(error), float(best))
        assert error >= best * (1 - 1e-6) - 1e-9
    meta = safe_open(str(low), framework="pt").metadata()
    original = safe_open(str(made["lora"]), framework="pt").metadata()
    assert meta["ss_network_dim"] == "2" and float(meta["ss_network_alpha"]) == 2.0
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "2.0"}
    assert meta["ss_base_model_version"] == original["ss_base_model_version"]
    pipe = _pipe(made["sd"])  # still a kohya file diffusers reads
    pipe.load_lora_weights(str(low))


def test_resize_refuses_bad_rank_and_existing_out(made, tmp_path, capsys):
    for rank, text in (("0", "at least 1"), ("-3", "at least 1"), ("5", "larger than the LoRA's rank (4)")):
        assert cli("resize", made["lora"], "--rank", rank, "--out", tmp_path / "x.safetensors") == 2
        assert text in capsys.readouterr().err
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"x")
    assert cli("resize", made["lora"], "--rank", "2", "--out", taken) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli("resize", made["lora"], "--rank", "2", "--out", taken, "--overwrite") == 0
    assert load_file(taken)  # replaced by a real file
    not_lora = tmp_path / "notes.txt"
    not_lora.write_text("hello")
    assert cli("resize", not_lora, "--rank", "2") == 2
    assert "LoRA files are .safetensors" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# sample
# ------------------------------------------------------------------------------------------------

def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_sample_writes_seeded_images_and_lora_changes_them(made, tiny_workspace, tmp_path, capsys):
    common = ("--workspace", tiny_workspace, "--prompt", PROMPT, "--steps", "2", "--seed", "7", "--device", "cpu")
    first = tmp_path / "a"
    assert cli("sample", "builtin:tiny-sd", *common, "--count", "2", "--out", first) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(first / "000-7.png"), str(first / "001-8.png")]
    a0, a1 = _pixels(first / "000-7.png"), _pixels(first / "001-8.png")
    assert a0.shape == (64, 64, 3)
    assert np.abs(a0 - a1).max() > 0  # another seed, another image
    again = tmp_path / "b"
    assert cli("sample", "builtin:tiny-sd", *common, "--out", again) == 0
    assert np.array_equal(_pixels(again / "000-7.png"), a0)  # same seed, same image
    with_lora = tmp_path / "c"
    assert cli("sample", "builtin:tiny-sd", *common, "--lora", f"{made['lora']}:1.0", "--out", with_lora) == 0
    assert np.abs(_pixels(with_lora / "000-7.png") - a0).max() > 2
    capsys.readouterr()
    assert cli("sample", "builtin:tiny-sd", *common, "--out", first) == 2  # 000-7.png exists
    assert "already exists" in capsys.readouterr().err
    assert cli("sample", "builtin:tiny-sd", *common, "--lora", made["xl_lora"], "--out", tmp_path / "d") == 2
    assert "layers match" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_sample_runs_the_two_stage_families_through_their_decoder(tiny_workspace, tmp_path, capsys):
    out = tmp_path / "w"
    assert cli("sample", "builtin:tiny-wuerstchen", "--workspace", tiny_workspace, "--prompt", PROMPT, "--steps", "2",
               "--width", "128", "--height", "128", "--device", "cpu", "--out", out) == 0
    image = _pixels(out / "000-42.png")
    assert image.shape == (128, 128, 3) and image.std() > 0  # the prior's output decoded into a picture


def test_sample_from_a_run_config(tiny_workspace, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  path: builtin:tiny-sd\n"
        f"general:\n  workspace: {json.dumps(str(tiny_workspace))}\n"
        "sampling:\n  prompts:\n"
        "    - {prompt: a red square, seed: 3, steps: 2, width: 64, height: 64}\n"
        "    - {prompt: a blue circle, seed: 5, steps: 2, width: 64, height: 72}\n")
    out = tmp_path / "s"
    assert cli("sample", "--config", config, "--device", "cpu", "--out", out) == 0
    assert capsys.readouterr().out.split() == [str(out / "000-3.png"), str(out / "001-5.png")]
    assert _pixels(out / "001-5.png").shape == (72, 64, 3)
    assert cli("sample", "--device", "cpu") == 2
    assert "--prompt" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the Tools tab runs the CLI in a subprocess
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_tools_tab_runs_the_cli_and_names_the_output(made, tmp_path):
    from webui.tabs.tools import describe_tool_result, run_tool, tool_command
    out = tmp_path / "ui r2.safetensors"
    argv, missing = tool_command("resize", "", f"{made['lora']}\n", str(out), rank=2.0)
    assert not missing and argv == ["resize", str(made["lora"]), "--rank", "2", "--out", str(out)]
    result = run_tool(argv, timeout=300)
    assert result["rc"] == 0 and result["outputs"] == [str(out)], result
    assert load_file(out)[next(k for k in load_file(out) if k.endswith(".lora_down.weight"))].shape[0] == 2
    text = describe_tool_result(argv, result)
    assert text.startswith("OK:") and f"`{out}`" in text
    again = run_tool(argv, timeout=300)  # exists now: one clear line, exit code 2
    assert again["rc"] == 2 and "already exists" in describe_tool_result(argv, again)
    assert tool_command("merge", "builtin:tiny-sd", "", "")[1].startswith("give at least one LoRA")


def test_the_tools_section_uses_only_the_folders_the_page_may_use(tmp_path):
    from webui.app import build_app
    ctx = build_app(tmp_path / "ws", start_scheduler=False).atelier
    def run(*args):  # the page's handler yields progress, then the result: the last update counts
        return list(ctx.handlers["tools_model_run"](*args))[-1]
    outside = tmp_path / "elsewhere" / "merged.safetensors"
    msg, _ = run("merge", "single-file", "auto", "builtin:tiny-sd", "/etc/passwd:0.5", None, "", 20, 42, 1,
                 str(ctx.workspace / "m.safetensors"), False)
    assert "The LoRA `/etc/passwd` is outside the folders" in msg
    msg, _ = run("convert", "single-file", "auto", "builtin:tiny-sd", "", None, "", 20, 42, 1, str(outside), False)
    assert "The output" in msg and "outside the folders" in msg and not outside.parent.exists()


def test_a_tool_run_from_the_page_reports_progress_and_cancel_kills_it(tmp_path):
    import sys
    import time

    from trainer.host import procs
    from webui.tabs.tools import stream_tool
    script = tmp_path / "slow.py"  # stands in for a long caption run: prints, then works for a minute
    script.write_text("import sys, time\nprint('captioned 1/100', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    fake = tmp_path / "fakepython"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    fake.chmod(0o755)
    gen = stream_tool(["caption", "x"], python=str(fake), poll_s=0.1)
    start, update = time.time(), None
    for update in gen:
        if "captioned 1/100" in update.get("tail", "") or time.time() - start > 20:
            break
    assert update and update["rc"] is None and "captioned 1/100" in update["tail"]
    def cmdline(proc_dir: Path) -> str:
        try:
            return (proc_dir / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # ended meanwhile
            return ""
    pid_file = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and str(script) in cmdline(p)]
    assert pid_file, "the tool is running"
    gen.close()  # what the page's Cancel does to the running handler
    assert not any(procs.pid_alive(pid) for pid in pid_file)


def test_merge_resize_and_sample_take_diffusers_layout_loras_of_the_transformer_families(tiny_workspace, tmp_path,
                                                                                          capsys):
    """A Flux LoRA (transformer + CLIP-L, diffusers/peft layout, α/r in lora_B): merge adds B·A to each layer,
    resize keeps the layout (at full rank the same change), sample --lora changes the image."""
    from trainer.config.checks import load_config
    from trainer.families import build_tiny
    from trainer.methods.lora import LoraMethod
    from trainer.families.sources import load_model
    paths = build_tiny("tiny-flux", tiny_workspace / "models")
    cfg = load_config(None, [f"model.path={paths['diffusers']}", "training.method=lora", "lora.rank=4",
                             "lora.alpha=2", "lora.unet_targets=attn", "training.train_text_encoder=true"])
    model = load_model(cfg, str(tiny_workspace))
    method = LoraMethod(model, cfg)
    gen = torch.Generator().manual_seed(0)
    for name, p in list(model.transformer.named_parameters()) + list(model.text_encoder.named_parameters()):
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    from safetensors.torch import save_file
    lora = tmp_path / "flux-lora.safetensors"
    state = method.adapter_state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(lora))
    assert any(k.startswith("transformer.") and k.endswith("lora_A.weight") for k in state)
    # merge: every layer of the transformer is W + B·A (the file's B carries α/r)
    out = tmp_path / "merged.safetensors"
    assert cli("merge", str(paths["single_file"]), str(lora), "--out", out, "--workspace", tiny_workspace,
               "--config-path", str(paths["diffusers"])) == 0
    base = load_model(load_config(None, [f"model.path={paths['diffusers']}"]), str(tiny_workspace))
    merged = load_model(load_config(None, [f"model.path={out}", f"model.config_path={paths['diffusers']}"]),
                        str(tiny_workspace))
    key = "transformer_blocks.0.attn.to_q"
    expected = base.transformer.state_dict()[f"{key}.weight"] + \
        state[f"transformer.{key}.lora_B.weight"] @ state[f"transformer.{key}.lora_A.weight"]
    torch.testing.assert_close(merged.transformer.state_dict()[f"{key}.weight"], expected, atol=1e-5, rtol=1e-5)
    # resize to the full rank: the same change, still in the diffusers layout
    small = tmp_path / "flux-r4.safetensors"
    assert cli("resize", str(lora), "--rank", "4", "--out", small) == 0
    resized = load_file(str(small))
    assert set(resized) == set(state)
    for k in (f"transformer.{key}",):
        torch.testing.assert_close(resized[f"{k}.lora_B.weight"] @ resized[f"{k}.lora_A.weight"],
                                   state[f"{k}.lora_B.weight"] @ state[f"{k}.lora_A.weight"], atol=1e-5, rtol=1e-5)
    # sample --lora on a Flux model
    common = ("--workspace", tiny_workspace, "--prompt", PROMPT, "--steps", "2", "--width", "64", "--height", "64",
              "--device", "cpu")
    assert cli("sample", "builtin:tiny-flux", *common, "--out", tmp_path / "plain") == 0
    assert cli("sample", "builtin:tiny-flux", *common, "--lora", f"{lora}:1.0", "--out", tmp_path / "with") == 0
    assert np.abs(_pixels(tmp_path / "with" / "000-42.png") - _pixels(tmp_path / "plain" / "000-42.png")).max() > 0


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_merge_bakes_loha_and_lokr_files_as_peft_computes_them(kind, tiny_workspace, tmp_path):
    """A LyCORIS LoHa/LoKr file as Atelier writes it (ComfyUI's and LyCORIS' formulas read it): merging adds to each
    layer exactly the change peft's adapter layer applies; resize refuses it with what to do instead."""
    from safetensors.torch import save_file

    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    from trainer.families.sources import load_model
    sd = tiny_workspace / "models" / "tiny-sd"
    cfg = load_config(None, [f"model.path={sd}", "training.method=lora", f"lora.type={kind}", "lora.rank=4",
                             "lora.alpha=2"])
    model = load_model(cfg, str(tiny_workspace))
    method = LoraMethod(model, cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.unet.named_parameters():
            if ".hada_" in name or ".lokr_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    layer = model.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    expected = layer.get_base_layer().weight.detach().clone() + layer.get_delta_weight("default").detach()
    lora = tmp_path / f"{kind}.safetensors"
    save_file({k: v.contiguous() for k, v in method.adapter_state_dict().items()}, str(lora))
    out = tmp_path / "merged.safetensors"
    assert cli("merge", str(sd), str(lora), "--out", out, "--workspace", tiny_workspace) == 0
    merged = load_model(load_config(None, [f"model.path={out}", f"model.config_path={sd}"]), str(tiny_workspace))
    got = merged.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert cli("resize", str(lora), "--rank", "2", "--out", tmp_path / "r2.safetensors") == 2


@pytest.mark.parametrize("fmt", ["comfyui", "a1111", "lycoris"])
def test_merge_bakes_a_dora_file_into_the_weight_it_trained(fmt, tiny_workspace, tmp_path):
    """A DoRA file in each dora_scale convention (output.dora_format, named in its header): merged at weight 1 each
    layer becomes the weight peft's DoRA layer computes, m · V / ‖V‖; at 0.5 half-way there. Resize still refuses it."""
    from trainer.config.checks import load_config
    from trainer.methods.lora import LoraMethod
    from trainer.families.sources import load_model
    sd = tiny_workspace / "models" / "tiny-sd"
    cfg = load_config(None, [f"model.path={sd}", "training.method=lora", "lora.type=dora", "lora.rank=4",
                             "lora.alpha=2", f"output.dora_format={fmt}"])
    model = load_model(cfg, str(tiny_workspace))
    method = LoraMethod(model, cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.unet.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=gen))
    layer = model.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    base = layer.get_base_layer().weight.detach().clone()
    layer.merge()  # peft's own DoRA merge: the weight the trained layer computes with
    expected = layer.get_base_layer().weight.detach().clone()
    layer.unmerge()
    assert (expected - base).abs().max() > 1e-3
    lora = tmp_path / f"dora-{fmt}.safetensors"
    method.save(lora, "fp32", {})
    for weight, want in ((1.0, expected), (0.5, base + 0.5 * (expected - base))):
        out = tmp_path / f"merged-{weight}.safetensors"
        assert cli("merge", str(sd), f"{lora}:{weight}", "--out", out, "--workspace", tiny_workspace) == 0
        merged = load_model(load_config(None, [f"model.path={out}", f"model.config_path={sd}"]), str(tiny_workspace))
        got = merged.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert cli("resize", str(lora), "--rank", "2", "--out", tmp_path / "r2.safetensors") == 2
