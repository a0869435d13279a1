#!/usr/bin/env bash
# Atelier against diffusers' own example scripts on one GPU, same model, data and settings, in one run: real-size
# random-weight SD 1.5 LoRA (512 px, batch 4, bf16), SDXL LoRA (1024 px, batch 2, bf16) and Flux.1 [dev] LoRA
# (1024 px, batch 1, fp8 base), Atelier eager and compiled (training.compile), then the example scripts; one step of
# Atelier's SD 1.5 under torch.profiler (top kernels, the GPU's idle time between them); a table with steps/s,
# images/s, peak memory, time to first step, MFU and the ratio to the example script, with the card's name.
#
#   bash bench/gpu_side_by_side.sh                          # every case (results in $OUT, default bench-side-by-side/)
#   bash bench/gpu_side_by_side.sh sd15 sdxl                # some of them: sd15 sdxl flux (each: eager, compiled,
#                                                           # the example script), profile
#   bash bench/gpu_side_by_side.sh sd15-eager sd15-example profile sdxl-eager sdxl-example flux-eager sd15-compiled
#                                                           # single runs in this order (each case's eager, compiled,
#                                                           # example): the comparisons first when time is short
#   bash bench/gpu_side_by_side.sh flux-bf16-eager          # Flux with its transformer stored in bf16 (the example
#                                                           # script has no fp8 base: the like-for-like pair)
#   bash bench/gpu_side_by_side.sh profile profile-compiled # one SD 1.5 step under torch.profiler, eager and compiled
#                                                           # (where the compiled step's time goes)
#   bash bench/gpu_side_by_side.sh profile-flux             # one Flux.1 step (flux-eager's settings) under the profiler
#   TINY=1 bash bench/gpu_side_by_side.sh                   # a dry run on the CPU: the tiny models at 64 px, eager only
#
# diffusers' example scripts are not in the diffusers wheel. Get them from a clone of huggingface/diffusers at the tag
# of the installed version, and carry the wheels they need (torchvision, datasets) to the GPU machine:
#
#   git clone --depth 1 --branch v$(python -c 'import diffusers; print(diffusers.__version__)') \
#       https://github.com/huggingface/diffusers /opt/diffusers
#   pip download torchvision datasets -d wheels/      # on a machine with the same Python; then on the GPU machine:
#   pip install --no-index --find-links wheels/ torchvision datasets
#   DIFFUSERS_EXAMPLES=/opt/diffusers/examples bash bench/gpu_side_by_side.sh
#
# Without DIFFUSERS_EXAMPLES (or without torchvision/datasets) the example scripts are skipped, and said so.
# The examples train on random-weight diffusers folders this script writes from the shipped full-size configs
# (SD 1.5 ~2 GB, SDXL ~7 GB, Flux.1 ~34 GB of disk in bf16); Atelier trains the same models with
# bench/random_weights.py (no disk). The example scripts differ where they cannot match (said in the table's notes):
# they encode every batch with the VAE (SD/SDXL scripts: no latent cache), and the Flux script has no fp8 base (bf16).
# Both adapt the same layers: the SD scripts' to_q/k/v/out are Atelier's default; the Flux script is given Atelier's
# (--lora_layers; its default adds the double blocks' feed-forwards, which it ran with until 2026-11-28).
#
# Env: PYTHON (default .venv/bin/python), OUT (results), STEPS (12; TINY 4), CASE_TIMEOUT (s, 200), PEAK_TFLOPS
# (the card's dense bf16 peak, 989 = H100 SXM), COMPILE (1; TINY 0), COMPILE_MODE (training.compile_mode of the
# compiled runs: default; reduce-overhead adds CUDA graphs, which validate refuses with gradient checkpointing, so the
# flux case, whose preset checkpoints, fails with it and says so), COMPILE_DYNAMIC (training.compile_dynamic of the
# compiled runs: auto; static or dynamic, the rows then say static-shapes or dynamic-shapes), COMPILE_SCOPE
# (training.compile_scope of the compiled runs: blocks; denoiser compiles the whole UNet or transformer as one graph,
# the rows then say whole-denoiser), FOLDERS_IN_RAM (auto:
# the examples' random folders go to /dev/shm when it has room and 64 GiB of RAM stay free; 0: on disk, under the
# workspace; 1: in /dev/shm regardless), DIFFUSERS_PYTHON (default PYTHON), KEEP_ATTENTION
# (1: Atelier's runs with training.checkpoint_keep_attention, which changes the checkpointed flux runs only),
# TORCHINDUCTOR_CPP_WRAPPER (torch's own switch, 1: inductor's compiled graphs launch their kernels from generated C++
# instead of Python; the compiled rows then say cpp-wrapper), OPTIMIZER (training.optimizer.name of Atelier's runs,
# e.g. prodigy, which then trains at learning rate 1; the rows say it; the examples keep AdamW), NORMS (autocast:
# Atelier's runs and profiles with training.norms_in_compute_dtype off, the denoiser's RMSNorms in autocast's fp32 as
# the example scripts run them; the rows say autocast-norms).
# Measured on an H200 (2026-11-27, 12 steps): SD 1.5 eager 23 s, its example 25 s (+ writing the folder), SDXL eager
# 25 s, its example 29 s, the profile ~40 s, Flux eager 75 s, SD 1.5 compiled 57 s, writing Flux's 34 GB folder
# ~2 min; on a second lease SDXL compiled 47 s, Flux compiled 115 s, SD 1.5 with COMPILE_MODE=reduce-overhead 74 s.
# Third lease (H200, 2026-11-28): flux-example with writing its folder ~2.5 min (the script's own run 50 s), Flux
# eager 78 s (bf16 base 84 s), Flux compiled 123 s.
# The whole default set does not fit one 10-minute call: name the single runs in two calls (the comparisons first).
# Its runs alone add up to ~8.3 minutes on those leases; the examples' folders, in RAM where /dev/shm has room
# (FOLDERS_IN_RAM), come on top.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
absolute() { case $1 in */*) echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" ;; *) echo "$1" ;; esac; }
PY=$(absolute "$PY")  # the example scripts run in their own folders
DPY=$(absolute "${DIFFUSERS_PYTHON:-$PY}")
TINY=${TINY:-0}
OUT=${OUT:-bench-side-by-side}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WS=${WORKSPACE:-$OUT/work}
mkdir -p "$WS"
RESULTS=$OUT/side_by_side.jsonl
if [ "$TINY" = 1 ]; then STEPS=${STEPS:-4}; COMPILE=${COMPILE:-0}; else STEPS=${STEPS:-12}; COMPILE=${COMPILE:-1}; fi
CASE_TIMEOUT=${CASE_TIMEOUT:-200}
COMPILE_MODE=${COMPILE_MODE:-default}
COMPILE_DYNAMIC=${COMPILE_DYNAMIC:-auto}
COMPILE_SCOPE=${COMPILE_SCOPE:-blocks}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TINY WS PEAK_TFLOPS
: > "$RESULTS"

helper() { "$PY" "$OUT/side_by_side_helper.py" "$@"; }
cat > "$OUT/side_by_side_helper.py" <<'EOF'
"""The side-by-side's Python parts: noise images, random-weight diffusers folders, one example-script run, FLOPs
of a Flux step, and the table."""
import json
import os
import sys
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
TINY = os.environ.get("TINY") == "1"
VARIANT = {"sd15": "sd15", "sdxl": "sdxl", "flux": "flux-dev"}
TINY_KIND = {"sd15": "tiny-sd", "sdxl": "tiny-sdxl", "flux": "tiny-flux"}


def images(dest, side, metadata):
    """Four noise images with one caption: .txt files (Atelier) and an imagefolder's metadata.jsonl (the SD/SDXL
    scripts' --train_data_dir); ``metadata`` "bare": the images alone (the Flux DreamBooth script opens every file of
    its --instance_data_dir as an image, and takes the caption as --instance_prompt)."""
    import numpy as np
    from PIL import Image
    d, side = Path(dest), int(side)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(4):
        Image.fromarray(np.random.RandomState(i).randint(0, 255, (side, side, 3), dtype=np.uint8)).save(d / f"{i}.png")
        if metadata != "bare":
            (d / f"{i}.txt").write_text("a photo of sks", encoding="utf-8")
        rows.append(json.dumps({"file_name": f"{i}.png", "text": "a photo of sks"}))
    if metadata == "1":
        (d / "metadata.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(d)


def folder(case, dest):
    """A diffusers folder of the case's model: the built-in tiny one (TINY), else the shipped full-size configs with
    random weights (initialised on the GPU), saved in bf16 (the VAE in fp32, as the scripts load it)."""
    import importlib
    import shutil
    import torch
    from trainer.families.common import full_size
    dest = Path(dest)
    if TINY:
        from trainer.families.common.sd_kit.tiny import ensure_tiny_model
        if case != "flux":
            ensure_tiny_model(TINY_KIND[case], dest.parent / "models")
            print(dest.parent / "models" / TINY_KIND[case])
            return
    src = full_size.config_folder(VARIANT[case], dest.parent / "cache")
    if TINY:  # the tiny Flux's folder is the configs' source: its configs are the full-size ones
        src = next(p for p in (dest.parent / "cache" / "models").rglob("model_index.json")
                   if "flux" in str(p).lower()).parent
        print(src)
        return
    dest = in_ram(case, dest)
    if (dest / ".done").exists():
        print(dest)
        return
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"), dirs_exist_ok=True)
    index = json.loads((src / "model_index.json").read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or not (src / name / "config.json").exists():
            continue
        cls = getattr(importlib.import_module(spec[0]), spec[1])
        dtype = torch.float32 if name == "vae" else torch.bfloat16
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls.from_config(cls.load_config(str(src / name))) if hasattr(cls, "load_config") \
                else cls(cls.config_class.from_pretrained(str(src / name)))
        torch.set_default_dtype(torch.float32)
        model.to(dtype).save_pretrained(str(dest / name), safe_serialization=True)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    (dest / ".done").write_text("")
    print(dest)


FOLDER_GB = {"sd15": 2.2, "sdxl": 7.2, "flux": 34.0}  # the random folders' size on disk (bf16, the VAE in fp32)
RAM_LEFT_GB = 64  # what the runs after the write still need in RAM (Flux: its 34 GB of random weights in CPU RAM)


def in_ram(case, dest):
    """Where the case's folder goes: /dev/shm when it has room and RAM is left for the runs (the example reads it
    from RAM, as it reads a folder written a minute earlier from the page cache; writing 34 GB to a disk took ~100 s
    of the Flux example's ~150 s on the leases), else ``dest``. FOLDERS_IN_RAM=0 keeps it on disk, =1 insists."""
    import shutil
    want = os.environ.get("FOLDERS_IN_RAM", "auto")
    shm = Path("/dev/shm")
    if want == "0" or not shm.is_dir():
        return dest
    need = FOLDER_GB[case] * 1e9
    try:
        free = shutil.disk_usage(shm).free
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = available = 0
    if want == "1" or (free > need + 1e9 and available - need > RAM_LEFT_GB * 2 ** 30):
        print(f"{case}: the random folder in RAM (/dev/shm: {free / 1e9:.0f} GB free, {available / 2 ** 30:.0f} GiB "
              f"of RAM available)", file=sys.stderr)
        return shm / "atelier-side-by-side" / dest.name
    print(f"{case}: the random folder on disk ({dest}; /dev/shm {free / 1e9:.0f} GB free, "
          f"{available / 2 ** 30:.0f} GiB of RAM available)", file=sys.stderr)
    return dest


def diffusers_run(case, script, model, data, steps, workdir, result_path):
    """One run of an example script on ``model`` and ``data`` with the case's settings; its figures as one JSON."""
    from diffusers_compare import measure_diffusers
    steps = int(steps)
    side, batch = {"sd15": (512, 4), "sdxl": (1024, 2), "flux": (1024, 1)}[case]
    if TINY:
        side = 64
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--pretrained_model_name_or_path", model, "--resolution", str(side), "--train_batch_size", str(batch),
              "--max_train_steps", str(steps), "--learning_rate", "1e-4", "--lr_scheduler", "constant",
              "--lr_warmup_steps", "0", "--rank", "16", "--mixed_precision", "bf16", "--seed", "0",
              "--dataloader_num_workers", "0", "--checkpointing_steps", str(steps + 1),
              "--output_dir", str(work / "out"), "--report_to", "tensorboard"]
    if case == "flux":  # the LoRA layers of Atelier's Flux preset (the script's default adds the feed-forwards)
        from bare_flux_step import ATELIER_TARGETS
        args = common + ["--instance_data_dir", data, "--instance_prompt", "a photo of sks", "--guidance_scale", "1",
                         "--gradient_checkpointing", "--cache_latents", "--lora_layers", ",".join(ATELIER_TARGETS)]
    else:
        args = common + ["--train_data_dir", data, "--image_column", "image", "--caption_column", "text",
                         "--cache_dir", str(work / "hf-cache")]
    r = measure_diffusers(os.environ.get("DPY", sys.executable), Path(script), args, work, f"diffusers-{case}")
    r["batch_size"] = batch
    r["model_folder_in_ram"] = str(model).startswith("/dev/shm/")
    Path(result_path).write_text(json.dumps(r))


def flux_step_tflops(side=1024, batch=1):
    """A Flux.1 [dev] LoRA step's FLOPs: 2x one transformer forward at ``side`` px (the frozen weights get no weight
    gradients), counted on the meta device from the shipped full-size config (512 text tokens)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode
    from trainer.families.common import full_size
    src = full_size.config_folder("flux-dev", Path(os.environ.get("WS", "/tmp")) / "cache")
    config = FluxTransformer2DModel.load_config(str(src / "transformer"))
    tokens = (side // 16) ** 2
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config).to(torch.bfloat16)
        x = torch.empty(batch, tokens, config["in_channels"], dtype=torch.bfloat16)
        text = torch.empty(batch, 512, config["joint_attention_dim"], dtype=torch.bfloat16)
        pooled = torch.empty(batch, config["pooled_projection_dim"], dtype=torch.bfloat16)
        ids = torch.zeros(tokens, 3)
        txt_ids = torch.zeros(512, 3)
        t = torch.ones(batch)
        g = torch.ones(batch) if config.get("guidance_embeds") else None
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t, img_ids=ids,
              txt_ids=txt_ids, guidance=g, return_dict=False)
    return 2 * counter.get_total_flops() / 1e12


def table(results, card, out_md):
    """The markdown table (appended to docs/performance.md by whoever runs this): one row per run, the ratio of each
    Atelier row's steady steps/s to the example script's."""
    rows = [json.loads(line) for line in Path(results).read_text().splitlines() if line.strip()]
    peak = float(os.environ.get("PEAK_TFLOPS", "989"))
    batch = {"sd15": 4, "sdxl": 2, "flux": 1}
    tflops = {}
    for r in rows:
        res = r.get("result") or {}
        if res.get("step_tflops"):
            tflops[r["case"]] = res["step_tflops"]
    if "flux" in {r["case"] for r in rows} and not TINY:
        try:
            tflops["flux"] = flux_step_tflops()
        except Exception as exc:  # the table still comes out
            print(f"flux FLOPs not counted: {exc}", file=sys.stderr)
    peer = {r["case"]: (r.get("result") or {}).get("steady_steps_per_s") for r in rows if r["mode"] == "diffusers"}
    lines = [f"Card: {card}", "",
             "| model | trainer | steady steps/s | images/s | peak VRAM alloc / reserved | first step | MFU | vs example |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r.get("result") or {}
        if r.get("failed") or not res:
            lines.append(f"| {r['case']} | {r['mode']} | failed (see the log) | | | | | |")
            continue
        sps = res.get("steady_steps_per_s") or res.get("loop_steps_per_s")
        ips = round(sps * batch[r["case"]], 2) if sps else None
        mfu = round(100 * tflops[r["case"]] * sps / peak, 2) if sps and r["case"] in tflops else None
        ratio = round(sps / peer[r["case"]], 2) if sps and peer.get(r["case"]) and r["mode"] != "diffusers" else None
        mem = f"{res.get('peak_vram_mib')} / {res.get('peak_vram_reserved_mib')} MiB"
        lines.append(f"| {r['case']} | {r['mode']} | {sps} | {ips} | {mem} | {res.get('time_to_first_step_s')} s | "
                     f"{'' if mfu is None else f'{mfu} %'} | {'' if ratio is None else f'{ratio}x'} |")
    starts = [f"- {r['case']} {r['mode']}: " + ", ".join(f"{k} {v} s" for k, v in res["startup"].items())
              + f", first step {res.get('time_to_first_step_s')} s"
              for r in rows for res in [r.get("result") or {}] if res.get("startup")]
    if starts:  # where Atelier's time to the first step went (bench_train's marks from each run's train.log)
        lines += ["", "Start-up, seconds from the process's start to the first log line of each phase:", *starts]
    text = "\n".join(lines) + "\n"
    Path(out_md).write_text(text)
    print(text)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    {"images": images, "folder": folder, "diffusers": diffusers_run, "table": table}[what](*args)
EOF

case_setup() {  # case_setup <case>: PRESET SIDE SETS (Atelier's settings for the case)
  case $1 in
    sd15) PRESET=sd15-lora; SIDE=512
          SETS=(training.batch_size=4 training.mixed_precision=bf16 parts.denoiser.dtype=bf16
                parts.text_encoder_1.dtype=bf16 training.gradient_checkpointing=false) ;;
    sdxl) PRESET=sdxl-lora; SIDE=1024
          SETS=(training.batch_size=2 training.mixed_precision=bf16 training.gradient_checkpointing=false) ;;
    flux) PRESET=flux-lora-24gb; SIDE=1024; SETS=(training.batch_size=1) ;;
  esac
  SETS+=(lora.rank=16 lora.alpha=16 training.learning_rate=1e-4 training.lr_scheduler=constant training.lr_warmup_steps=0
         training.optimizer.name=adamw)
  if [ "$TINY" = 1 ]; then
    SIDE=64
    local tiny; tiny=$(case $1 in sd15) echo builtin:tiny-sd ;; sdxl) echo builtin:tiny-sdxl ;; flux) echo builtin:tiny-flux ;; esac)
    SETS+=("model.path=$tiny")
    [ "$1" = flux ] && SETS+=(parts.denoiser.fp8=false)  # fp8 storage is a CUDA feature
  fi
  SETS+=("data.resolution=$SIDE")
}

atelier() {  # atelier <case> <mode: eager|compiled> [bf16: the denoiser stored in bf16, not the preset's fp8]
  local name=$1 mode=$2 imgs line
  case_setup "$name"
  [ "${3:-}" = bf16 ] && SETS+=(parts.denoiser.fp8=false)
  if [ -n "${OPTIMIZER:-}" ]; then  # another optimizer in Atelier's runs (Prodigy at its learning rate of 1)
    SETS+=("training.optimizer.name=$OPTIMIZER")
    case $OPTIMIZER in prodigy*|dadapt*) SETS+=(training.learning_rate=1) ;; esac
  fi
  imgs=$(helper images "$WS/images-$SIDE" "$SIDE" 1)
  local extra=()
  [ "$mode" = compiled ] && extra+=(--set training.compile=true --set "training.compile_mode=$COMPILE_MODE"
                                    --set "training.compile_dynamic=$COMPILE_DYNAMIC"
                                    --set "training.compile_scope=$COMPILE_SCOPE")
  [ "$mode" = compiled ] && [ "$COMPILE_MODE" != default ] && mode="compiled $COMPILE_MODE"
  [ "$mode" != eager ] && [ "$COMPILE_DYNAMIC" != auto ] && mode="$mode $COMPILE_DYNAMIC-shapes"
  [ "$mode" != eager ] && [ "$COMPILE_SCOPE" = denoiser ] && mode="$mode whole-denoiser"
  [ "$mode" != eager ] && [ "${TORCHINDUCTOR_CPP_WRAPPER:-0}" = 1 ] && mode="$mode cpp-wrapper"
  [ "${3:-}" = bf16 ] && mode="$mode bf16-base"
  [ -n "${OPTIMIZER:-}" ] && mode="$mode $OPTIMIZER"
  if [ "${KEEP_ATTENTION:-0}" = 1 ]; then  # checkpointed blocks keep their attention output (flux: the preset checkpoints)
    extra+=(--set training.checkpoint_keep_attention=true); mode="$mode keep-attention"
  fi
  if [ "${NORMS:-}" = autocast ]; then  # the denoiser's RMSNorms under autocast's fp32, as before 2026-11-29
    extra+=(--set training.norms_in_compute_dtype=false); mode="$mode autocast-norms"
  fi
  [ "$TINY" = 1 ] || extra+=(--random-weights)
  echo "=== atelier $name $mode" >&2
  local run=${mode// /-}
  line=$(timeout "$CASE_TIMEOUT" "$PY" bench/bench_train.py --no-warmup --workspace "$WS/atelier-$name-$run" \
      --preset "$PRESET" --peak-tflops "$PEAK_TFLOPS" "${extra[@]}" \
      --set "data.concepts=[{path: $imgs}]" --set training.max_steps="$STEPS" --set training.epochs=1000 \
      --set backup.every_n_epochs=0 --set sampling.every_n_epochs=0 --set sampling.prompts=[] \
      --set general.tensorboard=false $(printf -- '--set %s ' "${SETS[@]}") 2> "$WS/atelier-$name-$run.err" | head -1)
  if [ -n "$line" ] && [ "${line:0:1}" = "{" ]; then
    echo "{\"case\": \"$name\", \"mode\": \"atelier $mode\", \"result\": $line}" >> "$RESULTS"
  else
    echo "{\"case\": \"$name\", \"mode\": \"atelier $mode\", \"failed\": true}" >> "$RESULTS"
    tail -30 "$WS/atelier-$name-$run.err" >&2
  fi
  echo "=== done: ${line:0:300}" >&2
}

example() {  # example <case>: diffusers' example script for the case
  local name=$1 script
  case $name in
    sd15) script=text_to_image/train_text_to_image_lora.py ;;
    sdxl) script=text_to_image/train_text_to_image_lora_sdxl.py ;;
    flux) script=dreambooth/train_dreambooth_lora_flux.py ;;
  esac
  if [ -z "${DIFFUSERS_EXAMPLES:-}" ] || [ ! -f "$DIFFUSERS_EXAMPLES/$script" ]; then
    echo "=== diffusers $name: skipped (set DIFFUSERS_EXAMPLES to a diffusers checkout's examples/ folder; see the header)" >&2
    return
  fi
  if ! "$DPY" -c "import torchvision, datasets" 2>/dev/null; then
    echo "=== diffusers $name: skipped ($DPY lacks torchvision or datasets; see the header)" >&2
    return
  fi
  case_setup "$name"
  local model imgs
  model=$(helper folder "$name" "$WS/random-$name" | tail -1)
  if [ "$name" = flux ]; then imgs=$(helper images "$WS/images-$SIDE-bare" "$SIDE" bare)
  else imgs=$(helper images "$WS/images-$SIDE" "$SIDE" 1); fi
  echo "=== diffusers $name ($script)" >&2
  # cuDNN's SDPA kernel fails in Flux's backward (torch 2.11, cu130: "an illegal memory access"); the trainer turns it
  # off on CUDA, and the example scripts get the same switch through a sitecustomize, so both use the same kernels
  mkdir -p "$OUT/cudnn-sdpa-off"
  echo 'import torch; torch.backends.cuda.enable_cudnn_sdp(False)' > "$OUT/cudnn-sdpa-off/sitecustomize.py"
  if DPY=$DPY PYTHONPATH="$OUT/cudnn-sdpa-off${PYTHONPATH:+:$PYTHONPATH}" timeout "$CASE_TIMEOUT" "$PY" "$OUT/side_by_side_helper.py" diffusers "$name" "$DIFFUSERS_EXAMPLES/$script" \
      "$model" "$imgs" "$STEPS" "$WS/diffusers-$name" "$WS/diffusers-$name.json" 2> "$WS/diffusers-$name.err"; then
    echo "{\"case\": \"$name\", \"mode\": \"diffusers\", \"result\": $(cat "$WS/diffusers-$name.json")}" >> "$RESULTS"
  else
    echo "{\"case\": \"$name\", \"mode\": \"diffusers\", \"failed\": true}" >> "$RESULTS"
    tail -30 "$WS/diffusers-$name.err" >&2
  fi
  case $model in /dev/shm/*) rm -rf "$model" ;; esac  # the RAM it holds goes back to the runs after it
}

profile() {  # one Atelier SD 1.5 step under torch.profiler (bench/step_counts.py --profile; TINY: the demo's);
  # profile compiled: the same step with training.compile (COMPILE_MODE), after the warm-up steps that compile it
  # data.max_upscale=0: the 96 px demo images step_counts trains on fill the 512 px bucket (the default caps at 2x)
  local which=(sd15 --set data.resolution=512 --set data.max_upscale=0) name=profile_sd15
  [ "$TINY" = 1 ] && which=(demo --set training.mixed_precision=bf16)
  if [ "${1:-}" = flux ]; then  # Flux.1 [dev], the flux-eager row's settings (TINY: the demo's tiny Flux)
    which=(flux); name=profile_flux
    [ "$TINY" = 1 ] && which=(demo-flux --set training.mixed_precision=bf16)
  fi
  if [ "${1:-}" = compiled ]; then
    which+=(--set training.compile=true --set "training.compile_mode=$COMPILE_MODE"
            --set "training.compile_dynamic=$COMPILE_DYNAMIC" --set "training.compile_scope=$COMPILE_SCOPE")
    name=profile_sd15_compiled
    [ "$COMPILE_DYNAMIC" != auto ] && name=${name}_$COMPILE_DYNAMIC
    [ "$COMPILE_SCOPE" = denoiser ] && name=${name}_whole
    [ "${TORCHINDUCTOR_CPP_WRAPPER:-0}" = 1 ] && name=${name}_cpp_wrapper
  fi
  if [ "${NORMS:-}" = autocast ]; then
    which+=(--set training.norms_in_compute_dtype=false); name=${name}_autocast_norms
  fi
  echo "=== $name: one step under torch.profiler" >&2
  timeout "$CASE_TIMEOUT" "$PY" bench/step_counts.py "${which[@]}" --profile --warmup 3 --workspace "$WS/$name" \
      > "$OUT/$name.txt" 2> "$WS/$name.err" || tail -20 "$WS/$name.err" >&2
  grep -A22 "^== " "$OUT/$name.txt" >&2
}

cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(sd15 sdxl flux profile)
for c in "${cases[@]}"; do
  case $c in
    sd15|sdxl|flux)
      atelier "$c" eager
      [ "$COMPILE" = 1 ] && atelier "$c" compiled
      example "$c" ;;
    sd15-eager|sdxl-eager|flux-eager) atelier "${c%-*}" eager ;;
    sd15-compiled|sdxl-compiled|flux-compiled) atelier "${c%-*}" compiled ;;
    flux-bf16-eager|flux-bf16-compiled) atelier flux "${c##*-}" bf16 ;;
    sd15-example|sdxl-example|flux-example) example "${c%-*}" ;;
    profile) profile ;;
    profile-compiled) profile compiled ;;
    profile-flux) profile flux ;;
    *) echo "unknown case $c (sd15 sdxl flux profile, or one run of a case: sd15-eager sd15-compiled sd15-example …," \
            "flux-bf16-eager flux-bf16-compiled profile-compiled profile-flux)" >&2 ;;
  esac
done
card=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) + ', torch ' + torch.__version__ if torch.cuda.is_available() else 'CPU (dry run), torch ' + torch.__version__)")
helper table "$RESULTS" "$card" "$OUT/side_by_side.md"
echo "results: $RESULTS, $OUT/side_by_side.md, $OUT/profile_*.txt; logs under $WS" >&2
