"""data.offload_text_encoders and quantised storage on the way to the device: a run whose text encoders live in
CPU RAM (accelerate's offload hooks, trainer.memory.offload) trains and samples exactly as one whose encoders stay put;
the option refuses to act, with a warning naming why, where the encoders run every step."""

from types import SimpleNamespace

import pytest
from conftest import train_quiet

pytestmark = pytest.mark.usefixtures("one_thread")


def test_offloaded_text_encoders_train_and_sample_as_resident_ones(tmp_path):
    from safetensors.torch import load_file
    common = ("training.max_steps=2", "parts.denoiser.fp8=true", "sampling.at_end=true", "data.cache_text=true")
    plain = train_quiet(tmp_path, "resident", "demo-flux", *common)
    off = train_quiet(tmp_path, "offloaded", "demo-flux", "data.offload_text_encoders=true", *common)
    log = (off / "train.log").read_text()
    assert "text encoders in CPU RAM except while they encode: text_encoder, text_encoder_2" in log
    assert "text encoders in CPU RAM" not in (plain / "train.log").read_text()
    a, b = load_file(str(plain / "resident.safetensors")), load_file(str(off / "offloaded.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    samples = sorted((plain / "samples").glob("*.png"))
    assert samples  # the sample's prompt went through the hooked encoders
    for s in samples:
        assert s.read_bytes() == (off / "samples" / s.name).read_bytes()


def test_offload_names_why_it_cannot_act():
    from trainer.memory.offload import plan_offload
    warned = []
    cfg = SimpleNamespace(data={"offload_text_encoders": True, "cache_text": True})
    cfg.data = SimpleNamespace(cache_text=True, get=lambda k, d=None: True)
    assert plan_offload(cfg, cacheable=True, frozen_text=True, warn=warned.append)
    assert not plan_offload(cfg, cacheable=False, frozen_text=True, warn=warned.append)
    assert not plan_offload(cfg, cacheable=True, frozen_text=False, warn=warned.append)
    cfg.data.cache_text = False
    assert not plan_offload(cfg, cacheable=True, frozen_text=True, warn=warned.append)
    assert len(warned) == 3 and all("data.offload_text_encoders is on but has no effect" in w for w in warned)
    assert "tag shuffling" in warned[0] and "trains" in warned[1] and "data.cache_text is off" in warned[2]
    cfg.data = SimpleNamespace(cache_text=True, get=lambda k, d=None: False)
    assert not plan_offload(cfg, cacheable=True, frozen_text=True, warn=warned.append) and len(warned) == 3


def test_quantised_denoiser_waits_in_ram_until_it_is_quantised(tmp_path):
    """parts.denoiser.fp8: the family leaves the transformer in CPU RAM at load (``model.deferred``), and
    apply_storage quantises it layer by layer on its way to the device, then moves it whole."""
    import torch

    from trainer.config.checks import load_config
    from trainer.methods.make import make_method
    from trainer.families.sources import load_model
    from trainer.memory.precision import apply_storage
    cfg = load_config(None, [f"general.workspace={tmp_path}", "parts.denoiser.fp8=true"], preset="demo-flux")
    model = load_model(cfg, str(tmp_path), "cpu")
    assert model.deferred == ("transformer",)
    method = make_method(model, cfg)
    apply_storage(model, method, cfg)
    assert model.deferred == ()
    dtypes = {m.weight.dtype for n, m in model.transformer.named_modules()
              if type(m) is torch.nn.Linear and "lora" not in n and not any(s in n for s in model.fp8_skip)}
    assert dtypes == {torch.float8_e4m3fn}
    plain = load_model(load_config(None, [f"general.workspace={tmp_path}"], preset="demo-flux"), str(tmp_path), "cpu")
    assert plain.deferred == ()


def test_fp8_text_encoders_and_offloaded_ones_wait_in_ram_until_placed(tmp_path):
    """parts.text_encoder_N.fp8: the frozen encoder's Linear weights in fp8 (not T5's wo, which T5 keeps in fp32 and
    casts its input to; not a head tied to the embedding), its outputs close to the full-precision ones; offloaded or
    fp8 encoders load into RAM (model.deferred) and are placed after, so they never pass through the GPU whole."""
    import torch

    from trainer.config.checks import load_config
    from trainer.families.sources import ModelSettings
    from trainer.errors import ConfigError
    from trainer.families.sources import load_model
    from trainer.memory.precision import place_text_encoders
    cfg = load_config(None, ["model.path=builtin:tiny-flux", f"general.workspace={tmp_path}", "parts.text_encoder_2.fp8=true"])
    assert ModelSettings(cfg).deferred == {"text_encoder_2"}
    offload = load_config(None, ["model.path=builtin:tiny-flux", "data.offload_text_encoders=true"])
    assert ModelSettings(offload).deferred == {"text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"}
    plain = load_model(load_config(None, ["model.path=builtin:tiny-flux", f"general.workspace={tmp_path}"]), str(tmp_path))
    model = load_model(cfg, str(tmp_path))
    assert model.deferred == ("text_encoder_2",)
    place_text_encoders(model, cfg, offloading=False)
    assert model.deferred == ()
    t5 = model.text_encoder_2
    layers = {n: m.weight.dtype for n, m in t5.named_modules() if isinstance(m, torch.nn.Linear)}
    assert layers and all((d == torch.float8_e4m3fn) != n.endswith(".wo") for n, d in layers.items()), layers
    assert t5.dtype == torch.float32 and model.text_encoder.dtype == torch.float32  # CLIP untouched
    ours = model.encode_captions(["a photo of sks"])["prompt_embeds"]
    ref = plain.encode_captions(["a photo of sks"])["prompt_embeds"]
    shift = float((ours - ref).norm() / ref.norm())
    assert 0 < shift < 0.2
    # parts.text_encoder_2.fp8_scaled: a scale per output row (as ComfyUI's scaled fp8 text encoders): T5's features
    # shift less (measured 0.034 against 0.049 plainly rounded)
    scaled_cfg = load_config(None, ["model.path=builtin:tiny-flux", f"general.workspace={tmp_path}",
                                    "parts.text_encoder_2.fp8=true", "parts.text_encoder_2.fp8_scaled=true"])
    scaled = load_model(scaled_cfg, str(tmp_path))
    place_text_encoders(scaled, scaled_cfg, offloading=False)
    rows = {n: m.weight_scale for n, m in scaled.text_encoder_2.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn}
    assert rows and all(s.shape == (m.out_features, 1) for m, s in
                        ((scaled.text_encoder_2.get_submodule(n), s) for n, s in rows.items())), rows
    features = scaled.encode_captions(["a photo of sks"])["prompt_embeds"]
    assert float((features - ref).norm() / ref.norm()) < shift
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-flux", "parts.text_encoder_2.fp8_scaled=true"])
    assert err.value.key == "parts.text_encoder_2.fp8_scaled"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-flux", "parts.text_encoder_1.fp8=true", "parts.text_encoder_1.train=true"])
    assert err.value.key == "parts.text_encoder_1.fp8"


def test_nf4_text_encoders_are_packed_and_refused_where_they_cannot_work(tmp_path):
    """parts.text_encoder_N.nf4: the frozen encoder's Linear weights packed 4-bit (bitsandbytes), the embedding and
    a tied head left as they are, the features still close to the full-precision ones; not with train or fp8."""
    import torch

    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    from trainer.families.sources import load_model
    from trainer.memory.precision import place_text_encoders
    common = ["model.path=builtin:tiny-flux2-dev", f"general.workspace={tmp_path}"]
    plain = load_model(load_config(None, common), str(tmp_path))
    cfg = load_config(None, [*common, "parts.text_encoder_1.nf4=true", "data.offload_text_encoders=true"])
    model = load_model(cfg, str(tmp_path))
    place_text_encoders(model, cfg, offloading=True)
    te = model.text_encoder
    packed = [n for n, m in te.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.uint8]
    assert packed and all("vision" not in n for n in packed) and te.dtype == torch.float32
    assert te.model.language_model.embed_tokens.weight.dtype == torch.float32
    ours = model.encode_captions(["a photo of sks"])["prompt_embeds"]
    ref = plain.encode_captions(["a photo of sks"])["prompt_embeds"]
    assert 0 < float((ours - ref).norm() / ref.norm()) < 0.3
    for extra in (["parts.text_encoder_1.train=true"], ["parts.text_encoder_1.fp8=true"]):
        with pytest.raises(ConfigError) as err:  # an SD model: its CLIP may train
            load_config(None, ["model.path=builtin:tiny-sd", "parts.text_encoder_1.nf4=true", *extra])
        assert err.value.key == "parts.text_encoder_1.nf4"
