"""Stable Cascade stage C / Würstchen 2 prior key maps (trainer/families/common/cascade_keys.py): the original layout is
the one diffusers' single-file converter reads, the round trips are exact, every module has a ComfyUI LoRA name,
the predicates tell the models apart and ComfyUI's checkpoint layout reads back."""

from __future__ import annotations

import pytest
import torch

from trainer.families.common import cascade_keys as K

pytestmark = pytest.mark.usefixtures("one_thread")

STAGE_C = dict(
    in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1, conditioning_dim=32,
    block_out_channels=(32, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 2),
    up_num_layers_per_block=(2, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
    clip_text_in_channels=24, clip_text_pooled_in_channels=20, clip_image_in_channels=12, clip_seq=4,
    kernel_size=3, dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca", "crp"),
    switch_level=(False,))
STAGE_B = dict(
    in_channels=4, out_channels=4, timestep_ratio_embedding_dim=64, patch_size=2, conditioning_dim=32,
    block_out_channels=(16, 32), num_attention_heads=(0, 2), down_num_layers_per_block=(1, 1),
    up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(2, 2),
    block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                           ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock")),
    clip_text_pooled_in_channels=32, effnet_in_channels=16, pixel_mapper_in_channels=3, kernel_size=3,
    dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca",), switch_level=None)
WUERSTCHEN = dict(c_in=16, c=32, c_cond=24, c_r=8, depth=2, nhead=2, dropout=0.0)


def _unet(cfg):
    from diffusers import StableCascadeUNet
    torch.manual_seed(0)
    return StableCascadeUNet(**cfg)


def _wuerstchen():
    from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior
    torch.manual_seed(0)
    return WuerstchenPrior(**WUERSTCHEN)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    assert list(a) == list(b) or set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def models():
    return {"c": _unet(STAGE_C), "b": _unet(STAGE_B), "w": _wuerstchen()}


def _comfy_split(state):
    """ComfyUI's comfy/supported_models.py ``Stable_Cascade_C.process_unet_state_dict``, as written there: every
    ``…in_proj_{weight,bias}`` popped and cut into thirds named ``<prefix>.to_q/to_k/to_v.{weight,bias}``, where
    ``prefix = k_from[:-(len(suffix) + 1)]``."""
    state_dict = dict(state)
    key_list = list(state_dict.keys())
    for y in ["weight", "bias"]:
        suffix = "in_proj_{}".format(y)
        for k_from in filter(lambda a: a.endswith(suffix), key_list):
            weights = state_dict.pop(k_from)
            prefix = k_from[:-(len(suffix) + 1)]
            shape_from = weights.shape[0] // 3
            for x in range(3):
                p = ["to_q", "to_k", "to_v"]
                state_dict["{}.{}.{}".format(prefix, p[x], y)] = weights[shape_from * x:shape_from * (x + 1)]
    return state_dict


def _comfy_unet_key_map(comfy_state):
    """comfy/lora.py ``model_lora_keys_unet`` for a ``StableCascade_C`` model: ``lora_prior_unet_<k without
    "diffusion_model." and ".weight", "." → "_">`` for each model key ``diffusion_model.<…>.weight``."""
    sdk = ["diffusion_model." + k for k in comfy_state]
    key_map = {}
    for k in sdk:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_lora = k[len("diffusion_model."):-len(".weight")].replace(".", "_")
            key_map["lora_prior_unet_{}".format(key_lora)] = k
    return key_map


# --- original ↔ diffusers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["c", "b", "w"])
def test_round_trip_is_exact_and_loads_strictly(models, which):
    model = models[which]
    sd = _state(model)
    orig = K.diffusers_to_original(sd)
    assert not any(".to_q." in k or ".to_out.0." in k for k in orig)
    assert any(k.endswith(".attention.attn.in_proj_weight") for k in orig)
    assert any(k.endswith(".attention.attn.out_proj.bias") for k in orig)
    back = K.original_to_diffusers(orig)
    _same(back, sd)
    _same(K.diffusers_to_original(back), orig)
    fresh = type(model).from_config(model.config)
    fresh.load_state_dict(K.original_to_diffusers(orig), strict=True)
    _same(_state(fresh), sd)


def test_stage_b_original_names_its_pooled_mapper_clip_mapper(models):
    orig = K.diffusers_to_original(_state(models["b"]))
    assert "clip_mapper.weight" in orig and "clip_txt_pooled_mapper.weight" not in orig
    orig_c = K.diffusers_to_original(_state(models["c"]))
    assert "clip_txt_pooled_mapper.weight" in orig_c and "clip_mapper.weight" not in orig_c


@pytest.mark.parametrize("which", ["c", "b", "w"])
def test_our_original_layout_is_the_one_diffusers_reads(models, which):
    """diffusers' single-file converter (also what scripts/convert_wuerstchen.py does to the Würstchen 2 prior)
    gives back the model's own state from our original layout."""
    from diffusers.loaders.single_file_utils import convert_stable_cascade_unet_single_file_to_diffusers
    sd = _state(models[which])
    _same(convert_stable_cascade_unet_single_file_to_diffusers(K.diffusers_to_original(sd)), sd)


def test_comfy_split_attention_names_read_back(models):
    sd = _state(models["c"])
    comfy = _comfy_split(K.diffusers_to_original(sd))
    assert any(k.endswith(".attention.attn.to_q.weight") for k in comfy)
    _same(K.original_to_diffusers(comfy), sd)


# --- LoRA names ------------------------------------------------------------------------------------------------------
def test_every_prior_module_has_a_comfy_lora_key(models):
    model = models["c"]
    comfy = _comfy_split(K.diffusers_to_original(_state(model)))
    key_map = _comfy_unet_key_map(comfy)
    comfy_modules = {k[:-len(".weight")] for k in comfy if k.endswith(".weight")}
    targets = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert len(targets) > 20
    for name in targets:
        comfy_name = K.comfy_lora_name(name)
        assert comfy_name in comfy_modules, (name, comfy_name)
        assert "lora_prior_unet_" + comfy_name.replace(".", "_") in key_map, name
        assert K.diffusers_lora_name(comfy_name) == name
    # and back: every weight matrix ComfyUI can patch is one of the prior's Linear/Conv modules
    matrices = {k[:-len(".weight")] for k, v in comfy.items() if k.endswith(".weight") and v.ndim >= 2}
    assert {K.diffusers_lora_name(n) for n in matrices} == set(targets)
    assert K.comfy_lora_name("down_blocks.1.0.attention.to_out.0") == "down_blocks.1.0.attention.attn.out_proj"
    assert K.comfy_lora_name("up_blocks.0.2.attention.to_k") == "up_blocks.0.2.attention.attn.to_k"
    assert K.comfy_lora_name("clip_txt_mapper") == "clip_txt_mapper"


def test_lora_prior_te_names_are_the_transformers_paths():
    """comfy/lora.py ``model_lora_keys_clip`` (CLIP-G alone): ``lora_prior_te_text_model_encoder_layers_{b}_
    {LORA_CLIP_MAP[c]}`` for the six per-layer Linears, and ``lora_prior_te_text_projection``."""
    lora_clip_map = {"mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2", "self_attn.k_proj": "self_attn_k_proj",
                     "self_attn.q_proj": "self_attn_q_proj", "self_attn.v_proj": "self_attn_v_proj",
                     "self_attn.out_proj": "self_attn_out_proj"}
    te = _text_encoder()
    sdk = {"clip_g.transformer." + k for k in te.state_dict()}
    key_map = {}
    for b in range(32):
        for c in lora_clip_map:
            k = "clip_g.transformer.text_model.encoder.layers.{}.{}.weight".format(b, c)
            if k in sdk:
                key_map["lora_prior_te_text_model_encoder_layers_{}_{}".format(b, lora_clip_map[c])] = k
    if "clip_g.transformer.text_projection.weight" in sdk:
        key_map["lora_prior_te_text_projection"] = "clip_g.transformer.text_projection.weight"
    wanted = [n for n, m in te.named_modules()
              if isinstance(m, torch.nn.Linear) and (".self_attn." in n or ".mlp." in n or n == "text_projection")]
    assert len(wanted) == 2 * 6 + 1
    for n in wanted:
        assert "lora_prior_te_" + n.replace(".", "_") in key_map, n


# --- predicates ------------------------------------------------------------------------------------------------------
def test_predicates_tell_the_models_apart(models):
    from diffusers.pipelines.deprecated.wuerstchen import WuerstchenDiffNeXt
    torch.manual_seed(0)
    w_decoder = WuerstchenDiffNeXt(c_in=4, c_out=4, c_r=8, patch_size=2, c_cond=16, c_hidden=[8, 16, 32, 32],
                                   nhead=[-1, -1, 2, 2], blocks=[1, 1, 1, 1], level_config=["CT", "CT", "CTA", "CTA"],
                                   effnet_embd=4, clip_embd=16, dropout=0.0)
    cases = {"c": (True, False, False), "b": (False, True, False), "w": (False, False, True)}
    for which, want in cases.items():
        sd = _state(models[which])
        for layout in (sd, K.diffusers_to_original(sd)):
            for prefix in ("", "model.diffusion_model.", "diffusion_model."):
                keys = K.strip_prefix({prefix + k: tuple(v.shape) for k, v in layout.items()})
                got = (K.is_stage_c(keys), K.is_stage_b(keys), K.is_wuerstchen_prior(keys))
                assert got == want, (which, prefix)
                assert got == (K.is_stage_c(list(keys)), K.is_stage_b(set(keys)), K.is_wuerstchen_prior(keys))
    wd = w_decoder.state_dict()
    assert not (K.is_stage_c(wd) or K.is_stage_b(wd) or K.is_wuerstchen_prior(wd))


def test_strip_prefix_keeps_only_the_prefixed_keys():
    state = {"model.diffusion_model.clf.1.weight": 1, "text_encoder.x": 2, "vae.y": 3}
    assert K.strip_prefix(state) == {"clf.1.weight": 1}
    assert K.strip_prefix({"clf.1.weight": 1}) == {"clf.1.weight": 1}


# --- the real configs, lite vs full --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_shapes():
    """Parameter shapes of the real full and lite priors and the Würstchen 2 prior, built on the meta device."""
    from diffusers import StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior
    out = {}
    with torch.device("meta"):
        for name, cls, cfg in (("full", StableCascadeUNet, K.CONFIG_FULL), ("lite", StableCascadeUNet, K.CONFIG_LITE),
                               ("w", WuerstchenPrior, K.CONFIG_WUERSTCHEN)):
            model = cls.from_config(cfg)
            out[name] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            out[name + "_params"] = sum(p.numel() for p in model.parameters())
    return out


def _cfg(cfg):
    return {k: (list(map(list, v)) if k == "block_types_per_layer" else list(v) if isinstance(v, (list, tuple)) else v)
            for k, v in dict(cfg).items() if not k.startswith("_")}


def test_real_configs(real_shapes):
    assert K.CONFIG_FULL["block_out_channels"] == [2048, 2048] and K.CONFIG_FULL["down_num_layers_per_block"] == [8, 24]
    assert K.CONFIG_LITE["block_out_channels"] == [1536, 1536] and K.CONFIG_LITE["down_num_layers_per_block"] == [4, 12]
    assert 3.5e9 < real_shapes["full_params"] < 3.7e9  # "3.6B"
    assert 0.9e9 < real_shapes["lite_params"] < 1.1e9  # "1B"
    assert 0.9e9 < real_shapes["w_params"] < 1.1e9  # Würstchen 2 prior: 1B
    for name, lite in (("full", False), ("lite", True)):
        shapes = real_shapes[name]
        orig = {k: shapes[k] for k in shapes if ".attention." not in k}  # names shared by both layouts
        assert K.is_stage_c(shapes) and K.is_lite(shapes) is lite and K.is_lite(orig) is lite
        assert K.is_lite(set(shapes)) is lite  # from the block count alone
    assert not K.is_lite(_state(_unet(STAGE_C)))


def test_config_from_state_finds_the_real_configs(real_shapes):
    for name, base, want in (("lite", K.CONFIG_FULL, K.CONFIG_LITE), ("full", K.CONFIG_LITE, K.CONFIG_FULL),
                             ("full", K.CONFIG_FULL, K.CONFIG_FULL)):
        assert _cfg(K.config_from_state(real_shapes[name], base)) == _cfg(want), name
    small = dict(K.CONFIG_WUERSTCHEN, c=768, nhead=12, depth=4)
    assert K.config_from_state(real_shapes["w"], small) == K.CONFIG_WUERSTCHEN
    assert K.wuerstchen_config_from_state(real_shapes["w"], small) == K.CONFIG_WUERSTCHEN


@pytest.mark.parametrize("which, cfg", [("c", STAGE_C), ("b", STAGE_B)])
def test_config_from_state_rebuilds_the_tiny_models(models, which, cfg):
    from diffusers import StableCascadeUNet
    sd = _state(models[which])
    base = dict(K.CONFIG_FULL, patch_size=cfg["patch_size"])  # patch size is not in the weights
    for layout in (sd, K.diffusers_to_original(sd)):
        got = K.config_from_state({"model.diffusion_model." + k: v for k, v in layout.items()}, base)
        want = _cfg(models[which].config)
        got["dropout"] = want["dropout"]  # not in the weights: the base's
        # heads are not in the weights either: the base's head width (64) where it divides the level's width, else
        # the most heads up to the base's that do; 0 where a level has no attention
        assert got["num_attention_heads"] == ([32, 32] if which == "c" else [0, 32])
        StableCascadeUNet.from_config(got).load_state_dict(sd, strict=True)
        got["num_attention_heads"] = want["num_attention_heads"]
        assert {k: got[k] for k in want} == want
    StableCascadeUNet.from_config(got).load_state_dict(K.original_to_diffusers(K.diffusers_to_original(sd)),
                                                       strict=True)


def test_wuerstchen_config_from_state(models):
    from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior
    sd = _state(models["w"])
    got = K.wuerstchen_config_from_state(K.diffusers_to_original(sd), K.CONFIG_WUERSTCHEN)
    fixed = ("c_in", "c", "c_cond", "c_r", "depth")
    assert {k: got[k] for k in fixed} == {k: WUERSTCHEN[k] for k in fixed}
    assert got["c"] % got["nhead"] == 0  # heads are not in the weights; they must still split the width
    WuerstchenPrior.from_config(got).load_state_dict(sd, strict=True)


# --- ComfyUI checkpoint ----------------------------------------------------------------------------------------------
def _text_encoder():
    import transformers
    torch.manual_seed(1)
    cfg = transformers.CLIPTextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=77, projection_dim=24)
    return transformers.CLIPTextModelWithProjection(cfg)


def test_comfy_checkpoint_round_trip(models):
    te = _text_encoder()
    te_sd = _state(te)
    sd = _state(models["c"])
    orig = K.diffusers_to_original(sd)
    extra = {"vae.encoder.backbone.0.weight": torch.ones(2), "clip_l_vision.x": torch.zeros(1)}
    ck = K.comfy_checkpoint(orig, te_sd, extra=extra)
    assert set(ck) == ({"model.diffusion_model." + k for k in orig} | set(extra)
                       | {"text_encoder.clip_g.transformer." + k for k in te_sd if k != "text_projection.weight"}
                       | {"text_encoder.clip_g.text_projection"})
    proj = ck["text_encoder.clip_g.text_projection"]
    assert proj.shape == (32, 24) and torch.equal(proj, te_sd["text_projection.weight"].t())
    # ComfyUI's Stable_Cascade_C.process_clip_state_dict: strip "text_encoder." (filter_keys), then transpose
    # "clip_g.text_projection" into "clip_g.transformer.text_projection.weight": the model's own Linear weight.
    clip_sd = {k[len("text_encoder."):]: v for k, v in ck.items() if k.startswith("text_encoder.")}
    clip_sd["clip_g.transformer.text_projection.weight"] = clip_sd.pop("clip_g.text_projection").transpose(0, 1)
    _same({k[len("clip_g.transformer."):]: v for k, v in clip_sd.items()}, te_sd)
    # the unet part, as ComfyUI's loaders read it
    unet = {k[len("model.diffusion_model."):]: v for k, v in ck.items() if k.startswith("model.diffusion_model.")}
    assert K.is_stage_c(unet) and any(k.endswith("in_proj_weight") for k in unet)

    prior, text = K.split_comfy_checkpoint(ck)
    _same(prior, orig)
    _same(text, te_sd)
    prior, text = K.split_comfy_checkpoint(K.comfy_checkpoint(sd))  # diffusers layout in → original out
    _same(prior, orig)
    assert text is None
    prior, text = K.split_comfy_checkpoint(orig)  # a bare stage_c.safetensors
    _same(prior, orig)
    assert text is None
    # as ComfyUI itself saves one: split attention, projection as its Linear weight
    saved = {"model.diffusion_model." + k: v for k, v in _comfy_split(orig).items()}
    saved.update({"text_encoder.clip_g.transformer." + k: v for k, v in te_sd.items()})
    saved["text_encoder.clip_g.logit_scale"] = torch.tensor(4.6)
    prior, text = K.split_comfy_checkpoint(saved)
    _same(prior, orig)
    _same(text, te_sd)
