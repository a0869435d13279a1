"""LoRA variants end to end: each trains a few steps of the real loop on the tiny model, saves, and
loads back where users load it — LoRA into a diffusers pipeline (``load_lora_weights``), DoRA, LoHa
and LoKr through lycoris-lora (the library that defines the LyCORIS format; diffusers drops
DoRA's ``dora_scale`` with a warning and cannot read LoHa/LoKr). The loaded pipeline must give the
same image as the trained peft model (rebuilt from the run's backup), which pins the alpha/scale
conventions, and a different image from the base model.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.__main__ import main as cli
from trainer.config.checks import cross_field_warnings, load_config
from trainer.errors import ConfigError
from trainer.events import read_events

PROMPT = "a red square on a white background"
COMMON = ["training.max_steps=3", "backup.every_n_steps=3", "training.learning_rate=0.005", "sampling.prompts=[]", "backup.every_n_epochs=0",
          "general.tensorboard=false", "output.dtype=fp32", "lora.alpha=2"]
RUNS = {
    # LoCon (conv layers), own conv rank/alpha, text encoder too
    "lora": ["lora.type=lora", "lora.unet_targets=all", "training.train_text_encoder=true",
             "training.text_encoder_learning_rate=0.005", "lora.conv_rank=2", "lora.conv_alpha=1"],
    "dora": ["lora.type=dora", "lora.unet_targets=attn_mlp",
             "output.dora_format=lycoris"],  # checked below through the LyCORIS library's own apply
    "loha": ["lora.type=loha", "lora.unet_targets=all", "training.train_text_encoder=true",
             "training.text_encoder_learning_rate=0.005"],
    # rank 4 on the tiny widths: most layers get two full Kronecker factors (alpha ignored by
    # LyCORIS loaders, so the scale is baked in), a few keep a low-rank factor
    "lokr": ["lora.type=lokr", "lora.unet_targets=custom",
             "lora.custom_targets=[to_q, to_k, to_v, to_out.0, conv1, 're:.*ff\\.net\\.2']"],
}


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


def _args(ws: Path, run: str, *extra: str) -> list:
    return ["train", "--preset", "demo", "--no-progress",
            *[x for e in (f"general.workspace={ws}", f"general.run_name={run}", *COMMON, *extra)
              for x in ("--set", e)]]


@pytest.fixture(scope="module")
def runs(tiny_workspace):
    """Train every variant once (a few steps each)."""
    out = {}
    for kind, extra in RUNS.items():
        assert cli(_args(tiny_workspace, f"m-{kind}", *extra)) == 0
        out[kind] = tiny_workspace / "runs" / f"m-{kind}"
    return out


_TEMPLATES: dict = {}


def _pipe(ws: Path):
    """A fresh copy of the workspace's tiny-sd pipeline (loaded from disk once)."""
    import copy
    if ws not in _TEMPLATES:
        from diffusers import StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained(ws / "models" / "tiny-sd", local_files_only=True,
                                                       safety_checker=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        _TEMPLATES[ws] = pipe
    return copy.deepcopy(_TEMPLATES[ws])


@pytest.fixture(scope="module")
def base_image(tiny_workspace):
    return _image(_pipe(tiny_workspace))


def _image(pipe, prompt=PROMPT):
    return pipe(prompt, num_inference_steps=3, height=64, width=64, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images[0]


_TRAINED: dict = {}


def _trained_peft_pipe(ws: Path, run: Path):
    """The run's peft model: the same adapters as the run, weights from its last backup (built once)."""
    if run not in _TRAINED:
        _TRAINED[run] = _build_trained_peft_pipe(ws, run)
    return _TRAINED[run]


def _sd_model(pipe):
    """The SD family object over an already loaded pipeline (what the trainer's loader builds)."""
    from trainer.families.sd.family import StableDiffusion
    model = StableDiffusion.__new__(StableDiffusion)
    model.unet, model.text_encoder, model.tokenizer, model.family = pipe.unet, pipe.text_encoder, pipe.tokenizer, "sd15"
    return model


def _build_trained_peft_pipe(ws: Path, run: Path):
    from trainer.methods.lora import LoraMethod
    cfg = load_config(run / "config.yaml")
    pipe = _pipe(ws)
    model = _sd_model(pipe)
    method = LoraMethod(model, cfg)
    backup = sorted((run / "backups").iterdir())[-1]
    weights = load_file(str(backup / "trainable.safetensors"))
    params = {f"{n}.{pn}": p for n, m in method.modules.items() for pn, p in m.named_parameters() if p.requires_grad}
    assert set(params) == set(weights)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k])
    return pipe, method


def _apply_lycoris(pipe, path: Path):
    """Load a kohya/LyCORIS file with lycoris-lora onto a diffusers pipeline (forward hooks, not
    ``merge_to``, which scales LoHa twice — LIBRARY-NOTES). A1111 names the text encoder's modules
    ``text_model.…``, so it is wrapped to have that prefix."""
    from lycoris import LycorisNetwork, create_lycoris_from_weights
    state = load_file(str(path))
    te = torch.nn.Module()
    te.text_model = pipe.text_encoder
    root = torch.nn.ModuleDict({"unet": pipe.unet, "te": te})
    previous = LycorisNetwork.LORA_PREFIX
    LycorisNetwork.LORA_PREFIX = "lora"  # → lora_unet_… / lora_te_…
    try:
        network, _ = create_lycoris_from_weights(1.0, None, root, weights_sd=state)
    finally:
        LycorisNetwork.LORA_PREFIX = previous
    names = {k.split(".")[0] for k in state}
    assert len(network.loras) == len(names), "lycoris matched only part of the file"
    network.apply_to()
    return network


def _load_lora_strictly(pipe, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inconsistency was discovered.*")
        pipe.load_lora_weights(str(path))


@pytest.mark.parametrize("kind", list(RUNS))
def test_variant_trains_saves_and_loads_back(kind, runs, tiny_workspace, base_image):
    ws, run = tiny_workspace, runs[kind]
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished"
    path = run / f"m-{kind}.safetensors"
    with safe_open(str(path), "pt") as fh:
        keys = set(fh.keys())
        meta = fh.metadata()
    suffixes = {k.split(".", 1)[1] for k in keys}
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in keys)
    expected = {"lora": {"lora_down.weight", "lora_up.weight", "alpha"},
                "dora": {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"},
                "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
                "lokr": {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}}[kind]
    assert suffixes == expected, suffixes
    if "training.train_text_encoder=true" in RUNS[kind]:
        assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_out_proj.") for k in keys)
    if kind in ("loha", "lokr"):
        assert meta["ss_network_module"] == "lycoris.kohya" and f'"algo": "{kind}"' in meta["ss_network_args"]
    if kind == "lora":  # conv layers with their own rank (LoCon conv_dim)
        down = load_file(str(path))["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"]
        assert down.shape[0] == 2 and down.ndim == 4
        assert '"conv_dim": "2"' in meta["ss_network_args"]
    if kind == "lokr":  # custom targets: exactly the listed layers
        assert any("_ff_net_2." in k for k in keys) and not any("_ff_net_0_proj." in k for k in keys)
        assert any("_attn1_to_out_0." in k for k in keys) and not any("_resnets_0_conv2." in k for k in keys)

    trained_pipe, _ = _trained_peft_pipe(ws, run)
    trained = _image(trained_pipe)
    assert abs(trained - base_image).max() > 1e-3, "training did not change the output"

    loaded_pipe = _pipe(ws)
    if kind == "lora":
        _load_lora_strictly(loaded_pipe, path)
    else:
        _apply_lycoris(loaded_pipe, path)
    loaded = _image(loaded_pipe)
    assert abs(loaded - trained).max() < 1e-4, abs(loaded - trained).max()


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_our_loader_round_trips_into_peft(kind, runs, tiny_workspace):
    """lora.init_weights path: the saved file loaded into fresh peft layers gives the trained model."""
    ws, run = tiny_workspace, runs[kind]
    trained_pipe, method = _trained_peft_pipe(ws, run)
    fresh_pipe = _pipe(ws)
    cfg = load_config(run / "config.yaml", [f"lora.init_weights={run / f'm-{kind}.safetensors'}"])
    from trainer.methods.lora import LoraMethod
    LoraMethod(_sd_model(fresh_pipe), cfg)
    ids = trained_pipe.tokenizer([PROMPT], padding="max_length", max_length=77, return_tensors="pt").input_ids
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([400])
    with torch.no_grad():
        a = trained_pipe.unet(latents, t, trained_pipe.text_encoder(ids)[0]).sample
        b = fresh_pipe.unet(latents, t, fresh_pipe.text_encoder(ids)[0]).sample
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_diffusers_drops_dora_scale(runs, tiny_workspace, caplog):
    """Why DoRA is verified through lycoris: diffusers loads the file without its magnitudes."""
    pipe = _pipe(tiny_workspace)
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(caplog.handler)
    try:
        pipe.load_lora_weights(str(runs["dora"] / "m-dora.safetensors"))
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
    assert "dora_scale" in caplog.text


# --- layer filter and config rules (no training) -------------------------------------------------

def test_custom_targets_select_by_name_ending_and_regex():
    from trainer.methods.lora import adapter_config, unet_targets
    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline
    cfg = load_config(preset="demo", overrides=["lora.unet_targets=custom",
                                                "lora.custom_targets=[attn2.to_k, 're:up_blocks\\.1\\..*conv1']"])
    unet = build_tiny_pipeline().unet
    unet.add_adapter(adapter_config(cfg.lora, unet_targets(cfg), unet))
    adapted = {n for n, m in unet.named_modules() if hasattr(m, "lora_A")}
    assert adapted and all(n.endswith("attn2.to_k") or (n.startswith("up_blocks.1.") and n.endswith("conv1"))
                           for n in adapted)
    assert any(n.endswith("conv1") for n in adapted) and any(n.endswith("attn2.to_k") for n in adapted)


def test_bad_lora_settings_fail_clearly(tiny_workspace):
    with pytest.raises(ConfigError, match="custom_targets"):
        load_config(preset="demo", overrides=["lora.unet_targets=custom"])
    with pytest.raises(ConfigError, match="regular expression"):
        load_config(preset="demo", overrides=["lora.unet_targets=custom", "lora.custom_targets=['re:(']"])
    with pytest.raises(ConfigError, match="lora.type"):
        load_config(preset="demo", overrides=["lora.type=glora"])
    # targets that match nothing: a clear error naming the key, not a peft traceback
    rc = cli(["train", "--preset", "demo", "--no-progress", "--set", f"general.workspace={tiny_workspace}",
              "--set", "general.run_name=m-nomatch", "--set", "lora.unet_targets=custom",
              "--set", "lora.custom_targets=[no_such_layer]"])
    assert rc == 1
    failed = read_events(tiny_workspace / "runs" / "m-nomatch" / "events.jsonl")[-1]
    assert failed["type"] == "failed" and "lora.custom_targets" in failed["message"]


def test_lora_warnings():
    def keys(*overrides):
        return {i.key for i in cross_field_warnings(load_config(preset="demo", overrides=list(overrides)))}
    assert "lora.alpha" in keys("lora.alpha=8")
    assert "lora.alpha" not in keys("lora.alpha=4")
    assert "lora.conv_alpha" in keys("lora.unet_targets=all", "lora.conv_rank=2", "lora.conv_alpha=4")
    assert "lora.conv_rank" in keys("lora.conv_rank=2")  # attention-only targets: no conv layer
    assert "lora.dropout" in keys("lora.type=loha", "lora.dropout=0.1")
    assert "lora.rank_dropout" in keys("lora.type=lora", "lora.rank_dropout=0.1")
