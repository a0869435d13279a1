"""Shipped diffusers configs for Stable Diffusion 1.5 / 2.x / XL, and checkpoint family detection.

Why: users load SD 1.5 / 2.x from one original-layout ``.safetensors``/``.ckpt`` file, and
``StableDiffusionPipeline.from_single_file(path, config=<local diffusers folder>, local_files_only=True)``
only works offline when it is given a local folder with the diffusers configs and the tokenizer files.
Nothing can be downloaded here, so we ship those configs (``trainer/families/common/sd_kit/configs/<name>/``, copied from
the hub repos) and build the tokenizer's ``vocab.json``/``merges.txt`` at run time from the real CLIP BPE
file (``configs/clip_bpe_simple_vocab_16e6.txt.gz``, MIT, from OpenAI CLIP via open_clip_torch; see
``configs/LICENSE-clip-bpe.txt``).

Shipped configs (``CONFIG_NAMES``):

``sd15``     — runwayml/stable-diffusion-v1-5 (epsilon, 512)
``sd2``      — stabilityai/stable-diffusion-2-1 (v-prediction, 768)
``sd2-base`` — stabilityai/stable-diffusion-2-1-base (epsilon, 512)

and, for SDXL (``XL_CONFIG_NAMES``, kept apart because its pipeline has two text encoders/tokenizers):

``sdxl``     — stabilityai/stable-diffusion-xl-base-1.0 (epsilon, 1024; ``tokenizer`` pads with
               ``<|endoftext|>``, ``tokenizer_2`` with ``!``, both built from the same CLIP BPE)

and the inpainting variants (``INPAINT_CONFIG_NAMES``), not shipped as files but materialised from the
config above them with the UNet's ``in_channels`` set to 9 and the inpainting pipeline class in
``model_index.json`` — the only differences between the hub's inpainting repos and their bases:

``sd15-inpaint`` — ``sd15`` as stable-diffusion-v1-5/stable-diffusion-inpainting
``sd2-inpaint``  — ``sd2-base`` as stabilityai/stable-diffusion-2-inpainting (epsilon, 512: it was
                   trained on from the 512-base model; diffusers' own single-file loader maps a
                   9-channel SD 2 checkpoint to that repo too, ``inpainting_v2``, 512 px)
``sdxl-inpaint`` — ``sdxl`` as diffusers/stable-diffusion-xl-1.0-inpainting-0.1

Public API: :func:`config_folder`, :func:`detect_family`, :func:`default_config_for`,
:func:`detect_from_configs`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import uuid
from pathlib import Path

CONFIG_NAMES = ("sd15", "sd2", "sd2-base")
XL_CONFIG_NAMES = ("sdxl",)
# inpainting variant -> (shipped config it is derived from, pipeline class written to model_index.json)
INPAINT_CONFIGS = {
    "sd15-inpaint": ("sd15", "StableDiffusionInpaintPipeline"),
    "sd2-inpaint": ("sd2-base", "StableDiffusionInpaintPipeline"),
    "sdxl-inpaint": ("sdxl", "StableDiffusionXLInpaintPipeline"),
}
INPAINT_CONFIG_NAMES = tuple(INPAINT_CONFIGS)
ALL_CONFIG_NAMES = CONFIG_NAMES + XL_CONFIG_NAMES + INPAINT_CONFIG_NAMES
INPAINT_IN_CHANNELS = 9
FAMILIES = ("sd15", "sd2", "sdxl", "sd15-inpaint", "sd2-inpaint", "sdxl-inpaint")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
CLIP_BPE_FILE = CONFIGS_DIR / "clip_bpe_simple_vocab_16e6.txt.gz"
CLIP_VOCAB_SIZE = 49408

# Bump when the materialised layout changes (the stamp also covers the shipped files' contents).
_MATERIALISE_VERSION = 1
_STAMP = ".atelier-config"

_UNET = "model.diffusion_model."


# --------------------------------------------------------------------------------------------------
# CLIP BPE vocabulary
# --------------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """OpenAI CLIP / GPT-2 reversible byte → unicode table (no longer exported by transformers 5).

    Printable bytes map to themselves; the rest map to code points from 256 upwards, so that BPE never
    sees whitespace or control characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


@functools.lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], tuple[str, ...]]:
    """The 49,408-token CLIP vocabulary and its 48,894 BPE merges, built the way OpenAI CLIP's /
    open_clip's ``SimpleTokenizer`` builds them from ``bpe_simple_vocab_16e6.txt.gz``."""
    lines = gzip.decompress(CLIP_BPE_FILE.read_bytes()).decode("utf-8").split("\n")
    merges = tuple(lines[1:49152 - 256 - 2 + 1])  # line 0 is a "#version" header
    tokens = list(bytes_to_unicode().values())
    tokens = tokens + [t + "</w>" for t in tokens]
    tokens += ["".join(m.split(" ")) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != CLIP_VOCAB_SIZE or len(tokens) != CLIP_VOCAB_SIZE:
        raise RuntimeError(f"{CLIP_BPE_FILE} yields {len(vocab)} tokens, expected {CLIP_VOCAB_SIZE}: corrupt file?")
    return vocab, merges


def write_clip_tokenizer_files(folder: Path) -> None:
    """Write ``vocab.json`` and ``merges.txt`` (Hugging Face CLIPTokenizer format) into ``folder``."""
    vocab, merges = clip_vocab_and_merges()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Materialising a shipped config
# --------------------------------------------------------------------------------------------------

def _source_name(name: str) -> str:
    """The shipped folder a config is materialised from (an inpainting variant's base)."""
    return INPAINT_CONFIGS[name][0] if name in INPAINT_CONFIGS else name


def _shipped_files(name: str) -> list[Path]:
    src = CONFIGS_DIR / _source_name(name)
    return sorted(p for p in src.rglob("*.json") if p.is_file())


def _inpaint_patches(name: str) -> dict[str, dict]:
    """JSON keys an inpainting variant changes in its base's files: ``{relative path: {key: value}}``."""
    if name not in INPAINT_CONFIGS:
        return {}
    pipeline = INPAINT_CONFIGS[name][1]
    index: dict = {"_class_name": pipeline}
    if "XL" in pipeline:
        index["requires_aesthetics_score"] = False  # as in the hub's SDXL inpainting 0.1 repo
    return {"unet/config.json": {"in_channels": INPAINT_IN_CHANNELS}, "model_index.json": index}


def _fingerprint(name: str) -> str:
    h = hashlib.sha256(f"atelier-sd-config:{_MATERIALISE_VERSION}:{name}\n".encode())
    h.update(json.dumps(_inpaint_patches(name), sort_keys=True).encode())
    src = CONFIGS_DIR / _source_name(name)
    for p in _shipped_files(name):
        h.update(p.relative_to(src).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    h.update(CLIP_BPE_FILE.read_bytes())
    return h.hexdigest()


def _is_current(folder: Path, fingerprint: str) -> bool:
    try:
        return (folder / _STAMP).read_text(encoding="utf-8") == fingerprint
    except OSError:
        return False


def config_folder(name: str, cache_root: Path) -> Path:
    """Materialise the shipped config ``name`` (``sd15``, ``sd2``, ``sd2-base``, ``sdxl``, or an
    inpainting variant ``sd15-inpaint``, ``sd2-inpaint``, ``sdxl-inpaint``) into
    ``cache_root/configs/<name>/`` and return that folder.

    The folder is a diffusers pipeline folder without weights: ``model_index.json``, ``unet/``, ``vae/``,
    ``text_encoder/``, ``scheduler/`` configs and a complete ``tokenizer/`` (with ``vocab.json`` and
    ``merges.txt``); SDXL also has ``text_encoder_2/`` and ``tokenizer_2/``. Use it as ``config=str(folder)`` for ``from_single_file(..., local_files_only=True)``
    and as a ``from_pretrained`` source for the tokenizer (``subfolder="tokenizer"``).

    Built once (a stamp records the shipped files' hash; changed shipped files are rebuilt), in a temporary
    sibling folder that is renamed into place, so concurrent callers never see a half-written folder."""
    if name not in ALL_CONFIG_NAMES:
        raise ValueError(f"unknown SD config {name!r}; shipped configs: {', '.join(ALL_CONFIG_NAMES)}")
    src = CONFIGS_DIR / _source_name(name)
    if not (src / "model_index.json").is_file():
        raise FileNotFoundError(f"shipped config folder {src} is missing or incomplete (package data not installed?)")
    patches = _inpaint_patches(name)
    parent = Path(cache_root) / "configs"
    target = parent / name
    fingerprint = _fingerprint(name)
    if _is_current(target, fingerprint):
        return target

    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        for p in _shipped_files(name):
            dst = tmp / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            patch = patches.get(p.relative_to(src).as_posix())
            if patch:
                dst.write_text(json.dumps({**read_json(p), **patch}, indent=2) + "\n", encoding="utf-8")
            else:
                shutil.copyfile(p, dst)
        for tokenizer_dir in sorted(p for p in src.glob("tokenizer*") if p.is_dir()):  # tokenizer[, tokenizer_2]
            write_clip_tokenizer_files(tmp / tokenizer_dir.name)
        (tmp / _STAMP).write_text(fingerprint, encoding="utf-8")
        _install(tmp, target, fingerprint)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(tmp: Path, target: Path, fingerprint: str) -> None:
    """Atomically move ``tmp`` to ``target``; replace a stale ``target``; accept a concurrent winner."""
    try:
        os.replace(tmp, target)  # succeeds if target is absent (or an empty directory)
        return
    except OSError:
        if _is_current(target, fingerprint):
            return  # another process installed the same thing first
    trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(target, trash)
    except FileNotFoundError:
        pass
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_current(target, fingerprint):
            raise
    finally:
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Choosing a config
# --------------------------------------------------------------------------------------------------

def default_config_for(family: str, prediction_type: str | None) -> str:
    """The shipped config to use with ``from_single_file`` for a detected ``family``.

    ``sd15`` → ``sd15``; ``sd2`` + ``epsilon`` → ``sd2-base`` (512, PNDM), any other ``sd2`` → ``sd2``
    (768, v-prediction); ``sdxl`` → ``sdxl`` whatever the prediction type (v-prediction SDXL
    fine-tunes share the base topology; the family overrides the scheduler's prediction type).
    The inpainting families map to their variants whatever the prediction type: ``sd15-inpaint``,
    ``sdxl-inpaint``, and ``sd2-inpaint`` (512, epsilon, like the only SD 2 inpainting model there is;
    a ``v_prediction`` setting still wins over the scheduler's at training time)."""
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"unknown prediction_type {prediction_type!r}; expected one of {', '.join(PREDICTION_TYPES)}")
    if family == "sd15":
        return "sd15"
    if family == "sd2":
        return "sd2-base" if prediction_type == "epsilon" else "sd2"
    if family == "sdxl":
        return "sdxl"
    if family in INPAINT_CONFIGS:
        return family
    raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")


def full_size_folder(variant: str, cache_root: Path, prediction_type: str | None = None) -> Path:
    """The SD lineage's full-size configs (``trainer.families.common.full_size``): its shipped diffusers
    configs, as a single file of ``variant`` loads with them."""
    return config_folder(default_config_for(variant, prediction_type), cache_root)


# --------------------------------------------------------------------------------------------------
# Family detection
# --------------------------------------------------------------------------------------------------

_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def detect_family(path: Path) -> str:
    """Tell which Stable Diffusion family a checkpoint belongs to, reading only key names and a few
    shapes (no weights are loaded).

    ``path`` is an original-layout single file (``.safetensors``, or a torch pickle: ``.ckpt``/``.pt``/…)
    or a diffusers pipeline folder. Returns one of ``sd15``, ``sd2``, ``sdxl``, ``sd15-inpaint``,
    ``sd2-inpaint``, ``sdxl-inpaint``. Raises ValueError saying what was found for anything else (VAE-only
    files, LoRAs, embeddings, refiners, depth/pix2pix UNets, garbage), FileNotFoundError if ``path``
    does not exist."""
    path = Path(path)
    if path.is_dir():
        return _detect_diffusers_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    shapes = read_key_shapes(path)
    return classify_state_dict(shapes, str(path))


def _sniff(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(9)
    size = path.stat().st_size
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if len(head) == 9:
        n = int.from_bytes(head[:8], "little")
        if head[8:9] == b"{" and 0 < n <= size - 8:
            return "safetensors"
    if head[:1] == b"\x80" and path.suffix.lower() in _TORCH_SUFFIXES:
        return "torch-legacy"
    return "unknown"


def read_key_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    kind = _sniff(path)
    if kind == "safetensors":
        from safetensors import safe_open  # inside: detection (validate) reads this module without torch

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # SafetensorError, OSError
            raise ValueError(f"{path}: not a readable .safetensors file ({e})") from e
    if kind in ("torch-zip", "torch-legacy"):
        return _read_torch_key_shapes(path, mmap=kind == "torch-zip")
    raise ValueError(f"{path}: not a Stable Diffusion checkpoint: neither a .safetensors file nor a "
                     f"PyTorch checkpoint (.ckpt/.pt)")


# ComfyUI's SD 2.x v-prediction test (comfy/supported_models.py SD20.model_type, comfy/sd.py): the standard deviation
# of this bias is above 0.09 in the 768 px v-prediction models and below it in the 512 px ε base models
V_PREDICTION_STATISTIC = "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.norm1.bias"


def sd2_prediction(path: Path) -> str | None:
    """``v_prediction`` or ``epsilon`` for an SD 2.x single file, as ComfyUI tells them apart (the population standard
    deviation of :data:`V_PREDICTION_STATISTIC` above 0.09: v); None when the file lacks that tensor."""
    import torch  # inside: detection (validate) reads this module without torch

    kind = _sniff(Path(path))
    try:
        if kind == "safetensors":
            from safetensors import safe_open  # inside: detection (validate) reads this module without torch

            with safe_open(str(path), framework="pt") as f:
                if V_PREDICTION_STATISTIC not in f.keys():
                    return None
                bias = f.get_tensor(V_PREDICTION_STATISTIC)
        elif kind in ("torch-zip", "torch-legacy"):
            obj = torch.load(path, map_location="cpu", mmap=kind == "torch-zip", weights_only=True)
            obj = obj.get("state_dict", obj) if isinstance(obj, dict) else {}
            bias = obj.get(V_PREDICTION_STATISTIC)
            if bias is None:
                return None
        else:
            return None
    except Exception:  # unreadable here: the loader says what is wrong with the file
        return None
    return "v_prediction" if float(torch.std(bias.float(), unbiased=False)) > 0.09 else "epsilon"


def _read_torch_key_shapes(path: Path, mmap: bool) -> dict[str, tuple[int, ...]]:
    import torch  # inside: detection (validate) reads this module without torch

    try:
        obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: the .ckpt holds Python objects besides tensors and cannot be read safely "
            f"(weights_only=True refused it: {str(e).splitlines()[0] if str(e) else e!r}); "
            f"convert it to .safetensors with a trusted tool") from e
    except Exception as e:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from e
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a Stable Diffusion checkpoint: holds a {type(obj).__name__}, "
                         f"not a state dict")
    return {str(k): tuple(v.shape) for k, v in obj.items() if isinstance(v, torch.Tensor)}


def _examples(keys, n: int = 3) -> str:
    keys = sorted(keys)
    more = f", … ({len(keys)} keys)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def describe_non_checkpoint(shapes: dict[str, tuple[int, ...]], where: str) -> str:
    """Message for a file with no ``model.diffusion_model.*`` keys: say what it looks like."""
    keys = list(shapes)
    if not keys:
        return f"{where}: not a Stable Diffusion checkpoint: it holds no tensors"

    def any_key(pred) -> bool:
        return any(pred(k) for k in keys)

    if any_key(lambda k: k.startswith(("lora_", "lycoris_")) or ".lora_down." in k or ".lora_A." in k
               or ".hada_w1_a" in k or ".lokr_w1" in k):
        what = "looks like a LoRA/LyCORIS file (a network to apply to a model), not a full checkpoint"
    elif any_key(lambda k: k in ("emb_params", "string_to_param", "string_to_token")) or set(keys) <= {"clip_l", "clip_g"}:
        what = "looks like a textual-inversion embedding, not a full checkpoint"
    elif any_key(lambda k: k.startswith("control_model.") or k.startswith("controlnet_")):
        what = "looks like a ControlNet, not a full checkpoint"
    elif any_key(lambda k: k.startswith("first_stage_model.")):
        if any_key(lambda k: k.startswith(("cond_stage_model.", "conditioner."))):
            what = "holds a VAE and a text encoder but no UNet"
        else:
            what = "looks like a VAE-only file (first_stage_model.* keys only)"
    elif "encoder.conv_in.weight" in shapes and "decoder.conv_in.weight" in shapes:
        what = "looks like a VAE-only file (encoder.*/decoder.* keys)"
    elif "conv_in.weight" in shapes and any_key(lambda k: k.startswith("down_blocks.")):
        what = ("looks like a diffusers-format UNet weights file (unet/diffusion_pytorch_model.*); "
                "point at the whole diffusers folder instead")
    elif any_key(lambda k: k.startswith(("cond_stage_model.", "conditioner.", "text_model.", "encoder.layers.",
                                         "transformer.resblocks."))):
        what = "looks like a text-encoder-only file"
    else:
        what = f"not a Stable Diffusion checkpoint: no {_UNET}* keys (found {_examples(keys)})"
        return f"{where}: {what}"
    return f"{where}: {what}; no {_UNET}* keys"


def classify_state_dict(shapes: dict[str, tuple[int, ...]], where: str) -> str:
    unet_keys = [k for k in shapes if k.startswith(_UNET)]
    if not unet_keys:
        raise ValueError(describe_non_checkpoint(shapes, where))

    if any(".joint_blocks." in k for k in unet_keys):
        raise ValueError(f"{where}: looks like Stable Diffusion 3 (MMDiT joint_blocks), not SD 1.x/2.x/XL")
    if any(".double_blocks." in k for k in unet_keys):
        raise ValueError(f"{where}: looks like a Flux model (double_blocks), not SD 1.x/2.x/XL")
    conv_in = shapes.get(_UNET + "input_blocks.0.0.weight")
    if conv_in is None or len(conv_in) != 4:
        raise ValueError(f"{where}: has {_UNET}* keys but no UNet input conv "
                         f"({_UNET}input_blocks.0.0.weight); found {_examples(unet_keys)}")
    in_ch = conv_in[1]

    label_emb = shapes.get(_UNET + "label_emb.0.0.weight")
    has_te1 = any(k.startswith("conditioner.embedders.1.") for k in shapes)
    has_conditioner = any(k.startswith("conditioner.embedders.") for k in shapes)
    if label_emb is not None or has_conditioner:
        adm = label_emb[-1] if label_emb is not None else None
        if has_te1 or adm == 2816:
            base = "sdxl"
        elif adm == 2560 or (has_conditioner and not has_te1):
            raise ValueError(f"{where}: looks like the SDXL refiner (one OpenCLIP-G text encoder, "
                             f"label_emb in_features {adm}); only SDXL base models are supported")
        else:
            raise ValueError(f"{where}: the UNet has a class/ADM embedding (label_emb in_features {adm}): "
                             f"an unCLIP/upscaler-type model, not SD 1.x/2.x/XL")
    else:
        base = _sd1_or_sd2(shapes, where)

    if in_ch == 4:
        return base
    if in_ch == 9:
        return f"{base}-inpaint"
    known = {5: " (depth-conditioned, like SD 2 depth)", 8: " (InstructPix2Pix-style)",
             7: " (x4 upscaler-style)"}.get(in_ch, "")
    raise ValueError(f"{where}: a {base} UNet whose input conv has {in_ch} channels{known}; "
                     f"only 4 (text-to-image) and 9 (inpainting) are supported")


def _sd1_or_sd2(shapes: dict[str, tuple[int, ...]], where: str) -> str:
    # 1) the cross-attention context width: 768 = CLIP ViT-L (SD 1.x), 1024 = OpenCLIP ViT-H (SD 2.x)
    for k, s in shapes.items():
        if k.startswith(_UNET) and k.endswith(".attn2.to_k.weight") and len(s) == 2:
            if s[1] == 768:
                return "sd15"
            if s[1] == 1024:
                return "sd2"
            break  # an unusual width (tiny test models): decide by structure below
    # 2) the text encoder's layout
    if any(k.startswith("cond_stage_model.transformer.") for k in shapes):
        return "sd15"  # HF CLIPTextModel layout (…transformer.text_model.* or older …transformer.*)
    if any(k.startswith("cond_stage_model.model.") for k in shapes):
        return "sd2"  # OpenCLIP layout (…model.transformer.resblocks.*)
    # 3) the UNet's transformer projections: 1×1 conv in SD 1.x, linear in SD 2.x
    proj = shapes.get(_UNET + "input_blocks.1.1.proj_in.weight")
    if proj is not None:
        return "sd15" if len(proj) == 4 else "sd2"
    raise ValueError(f"{where}: an SD-style UNet, but cannot tell SD 1.x from SD 2.x (no attn2.to_k, "
                     f"proj_in or cond_stage_model.* keys)")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _detect_diffusers_folder(folder: Path) -> str:
    unet_cfg_path = folder / "unet" / "config.json"
    index_path = folder / "model_index.json"
    if not unet_cfg_path.is_file():
        own = folder / "config.json"
        if own.is_file():
            cls = read_json(own).get("_class_name", "?")
            raise ValueError(f"{folder}: a single diffusers component folder ({cls}), not a pipeline folder "
                             f"with unet/ and model_index.json")
        raise ValueError(f"{folder}: not a diffusers pipeline folder: no unet/config.json"
                         + ("" if index_path.is_file() else " and no model_index.json"))
    try:  # the UNet's config decides; an unreadable model_index.json only loses the pipeline class name
        index = read_json(index_path) if index_path.is_file() else {}
    except ValueError:
        index = {}
    return detect_from_configs(read_json(unet_cfg_path), index, str(folder))


def detect_from_configs(unet_config: dict, model_index: dict | None, where: str) -> str:
    """The family of a diffusers pipeline from its ``unet/config.json`` (a dict) and, when there is one,
    its ``model_index.json`` (a dict, or None/{}: the UNet's config alone decides).

    SDXL: ``addition_embed_type == "text_time"`` (size/crop conditioning), ``cross_attention_dim`` 2048, or
    an ``…XL…`` pipeline class; SD 2.x: ``cross_attention_dim`` 1024 (else linear projections at unusual
    widths); SD 1.x otherwise; ``in_channels`` 9 adds ``-inpaint``. ValueError for refiners,
    class-embedding UNets (unCLIP, upscalers) and other input widths."""
    cfg = unet_config
    index = model_index or {}
    pipe_cls = str(index.get("_class_name", "") or "")
    unet_cls = str(cfg.get("_class_name", "UNet2DConditionModel"))
    if unet_cls != "UNet2DConditionModel":
        raise ValueError(f"{where}: the UNet is a {unet_cls}, not a UNet2DConditionModel (SD 1.x/2.x/XL)")

    cad = cfg.get("cross_attention_dim")
    if cfg.get("addition_embed_type") == "text_time" or cad == 2048 or "XL" in pipe_cls:
        te1 = index.get("text_encoder")
        no_first_text_encoder = bool(index) and (te1 is None or (isinstance(te1, list) and te1[:1] == [None]))
        if cad == 1280 or no_first_text_encoder:
            raise ValueError(f"{where}: looks like the SDXL refiner (no first text encoder / "
                             f"cross_attention_dim {cad}); only SDXL base models are supported")
        base = "sdxl"
    elif cfg.get("class_embed_type") is not None or cfg.get("num_class_embeds") is not None:
        raise ValueError(f"{where}: the UNet has a class embedding: an unCLIP/upscaler-type model")
    elif cad == 768:
        base = "sd15"
    elif cad == 1024:
        base = "sd2"
    else:  # unusual widths (tiny test models): SD 2.x uses linear projections, SD 1.x 1×1 convs
        base = "sd2" if cfg.get("use_linear_projection") else "sd15"

    in_ch = cfg.get("in_channels", 4)
    if in_ch == 4:
        return base
    if in_ch == INPAINT_IN_CHANNELS:
        return f"{base}-inpaint"
    raise ValueError(f"{where}: a {base} UNet with in_channels={in_ch}; only 4 (text-to-image) and 9 "
                     f"(inpainting) are supported")
