#!/usr/bin/env bash
# Real-size LoRA steps on one GPU with random weights (nothing downloaded): the memory presets of the big
# families and the SD lineage, each measured by bench/bench_train.py --random-weights (steps/s, time to
# first step, peak VRAM allocated and reserved). One JSON line per case goes to $RESULTS (default
# bench-gpu.jsonl), each run's log to the workspace.
#
#   bash bench/gpu_families.sh                     # every case below
#   bash bench/gpu_families.sh flux-fp8 sd15       # some of them
#   PYTHON=.venv/bin/python STEPS=20 bash bench/gpu_families.sh
#   SETS="data.offload_text_encoders=false training.batch_size=2" bash bench/gpu_families.sh flux-fp8  # overrides
#
# Cases: flux-fp8 (flux-lora-24gb as shipped), flux-nf4 (the same with an NF4 transformer), flux-16gb, flux-12gb
# (block swapping), flux-48gb and flux-80gb (bf16 transformer; every second block checkpointed / none), qwen-nf4 (qwen-image-lora-24gb), qwen-16gb (fp8 Qwen2.5-VL, block swapping), klein-12gb,
# flux2-dev-32gb / flux2-dev-24gb (Flux.2 [dev], fp8 / NF4 Mistral; ~90 GB of CPU RAM for the random bf16 weights), sd15 (sd15-lora,
# 512 px, bf16; with MFU), sdxl-8gb (sdxl-lora-8gb). Default: the cases measured so far and the new tiers.
# Four noise images of the preset's size with one caption; each case samples once at the end (4 steps) so the
# sample's VAE decode counts in the peak, as in the presets' estimates. Per-case limit: CASE_TIMEOUT seconds.
# Edit models (kontext-24gb, qwen-edit-2509-24gb; demo-pairs checks them on the tiny Kontext on any machine) train
# on pairs: the four images with four control images of the same names, and sample by editing a control.
# Wan cases (wan21-12gb, wan21-24gb, wan21-14b-24gb, wan22-5b-24gb/-16gb/-12gb, wan22-a14b-24gb/-16gb/-12gb,
# the image-to-video wan21-i2v-24gb and wan22-i2v-a14b-24gb; demo-wan and demo-wan-i2v on any machine) train on four
# noise clips of FRAMES frames (default 49) at the preset's size, 16 fps H.264; an image-to-video case samples from a
# noise image.
# The 2026 families at 1024 px: krea2-24gb (krea2-lora: fp8 transformer, Qwen3-VL offloaded), krea2-16gb, krea2-12gb,
# ideogram4-24gb (ideogram4-lora: the transformer stored in fp8, as from Ideogram's fp8 release), ideogram4-16gb (NF4),
# hidream-24gb (hidream-lora: NF4 transformer and Llama, encoders offloaded), hidream-16gb; demo-krea2, demo-ideogram4
# and demo-hidream on any machine. All three 24 GB cases in one call: bash bench/gpu_families.sh krea2-24gb
# ideogram4-24gb hidream-24gb (the random bf16 weights of each model are built in CPU RAM first, as a loaded file's are).
# Chroma and HunyuanImage 2.1 at 1024 px: chroma-24gb (chroma-lora), chroma-16gb, hunyuan-24gb (hunyuan-image-lora:
# fp8 transformer, Qwen2.5-VL offloaded), hunyuan-16gb (+ block swapping); their steps hand the transformer each
# caption's own tokens, not the cache's padding (docs/performance.md, "Every family's step").
# The big cards' tiers without gradient checkpointing (docs/performance.md, "A full preset's own card"): chroma-80gb
# (chroma-lora-80gb) and zimage-80gb (zimage-lora-80gb), each against its estimate.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${STEPS:-12}
RESULTS=${RESULTS:-bench-gpu.jsonl}
WS=${WORKSPACE:-$(mktemp -d -t atelier-gpu-XXXX)}
CASE_TIMEOUT=${CASE_TIMEOUT:-240}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$WS"

images() {  # images <side>: a folder of 4 noise images with captions, made once
  local dir="$WS/images-$1"
  [ -d "$dir" ] || "$PY" - "$dir" "$1" <<'EOF'
import sys
from pathlib import Path
import numpy as np
from PIL import Image
d, side = Path(sys.argv[1]), int(sys.argv[2])
d.mkdir(parents=True)
for i in range(4):
    Image.fromarray(np.random.RandomState(i).randint(0, 255, (side, side, 3), dtype=np.uint8)).save(d / f"{i}.png")
    (d / f"{i}.txt").write_text("a photo of sks, a noisy picture", encoding="utf-8")
EOF
  echo "$dir"
}

controls() {  # controls <side>: control images for images <side>'s four (same file names, other noise)
  local dir="$WS/controls-$1"
  [ -d "$dir" ] || "$PY" - "$dir" "$1" <<'EOF'
import sys
from pathlib import Path
import numpy as np
from PIL import Image
d, side = Path(sys.argv[1]), int(sys.argv[2])
d.mkdir(parents=True)
for i in range(4):
    Image.fromarray(np.random.RandomState(100 + i).randint(0, 255, (side, side, 3), dtype=np.uint8)).save(d / f"{i}.png")
EOF
  echo "$dir"
}

pairs() {  # pairs <side> [n_controls]: --set arguments for a pair concept and a sample that edits a control
  local imgs ctl list; imgs=$(images "$1"); ctl=$(controls "$1")
  list=$ctl; for _ in $(seq 2 "${2:-1}"); do list="$list, $ctl"; done
  printf '%s\n' --set "data.concepts=[{path: $imgs, control_paths: [$list]}]" \
    --set "sampling.prompts=[{prompt: 'make it blue', steps: 4, width: $1, height: $1, control_images: [$ctl/0.png]}]"
}

clips() {  # clips <width> <height> <frames>: --set arguments for a concept of 4 noise clips (16 fps H.264, captions)
  local dir="$WS/clips-$1x$2x$3"
  [ -d "$dir" ] || "$PY" - "$dir" "$1" "$2" "$3" <<'EOF'
import sys
from pathlib import Path
import av
import numpy as np
d, w, h, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d.mkdir(parents=True)
for i in range(4):
    with av.open(str(d / f"{i}.mp4"), "w") as out:
        stream = out.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        rng = np.random.RandomState(i)
        for _ in range(n):
            frame = av.VideoFrame.from_ndarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    (d / f"{i}.txt").write_text("a video of sks, moving noise", encoding="utf-8")
EOF
  printf '%s\n' --set "data.concepts=[{path: $dir, target_frames: '$3', frame_extraction: head}]" \
    --set "data.resolution=$1x$2"
}

configs() {  # configs <variant>: a diffusers folder with the variant's full-size configs (no weights)
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); \
from trainer.families.common import full_size; print(full_size.config_folder('$1', Path('$WS') / 'cache'))"
}

bench() {  # bench <case> <preset> <side> [--set …]: one measured run
  local name=$1 preset=$2 side=$3; shift 3
  local imgs; imgs=$(images "$side")
  local sample=(--set sampling.prompts.0.steps=4)
  case " $* " in *"sampling.prompts="*) sample=() ;; esac  # a case that brings its own prompt (edit models)
  echo "=== $name: $preset $*" >&2
  local line
  line=$(timeout "$CASE_TIMEOUT" "$PY" bench/bench_train.py --random-weights --no-warmup --workspace "$WS/$name" \
      --preset "$preset" --peak-tflops "$PEAK_TFLOPS" \
      --set "data.concepts=[{path: $imgs}]" --set training.max_steps="$STEPS" --set training.epochs=1000 \
      --set backup.every_n_epochs=0 --set sampling.every_n_epochs=0 --set sampling.at_end=true \
      "${sample[@]}" "$@" ${SETS:+$(printf -- '--set %s ' $SETS)} | head -1)
  local rc=$?
  if [ -n "$line" ] && [ "${line:0:1}" = "{" ]; then
    echo "{\"case\": \"$name\", \"result\": $line}" >> "$RESULTS"
  else
    echo "{\"case\": \"$name\", \"failed\": true}" >> "$RESULTS"
    tail -40 "$WS/$name"/*.log >&2 2>/dev/null
  fi
  echo "=== $name done (rc $rc): ${line:0:400}" >&2
}

run_case() {
  case $1 in
    flux-fp8) bench flux-fp8 flux-lora-24gb 1024 --set "model.path=$(configs flux-dev)" ;;
    flux-nf4) bench flux-nf4 flux-lora-24gb 1024 --set "model.path=$(configs flux-dev)" \
                --set parts.denoiser.fp8=false --set parts.denoiser.nf4=true ;;
    qwen-nf4) bench qwen-nf4 qwen-image-lora-24gb 1024 --set "model.path=$(configs qwen-image)" ;;
    qwen-16gb) bench qwen-16gb qwen-image-lora-16gb 1024 --set "model.path=$(configs qwen-image)" ;;
    flux-12gb) bench flux-12gb flux-lora-12gb 1024 --set "model.path=$(configs flux-dev)" ;;
    flux-16gb) bench flux-16gb flux-lora-16gb 1024 --set "model.path=$(configs flux-dev)" ;;
    flux-48gb) bench flux-48gb flux-lora-48gb 1024 --set "model.path=$(configs flux-dev)" ;;
    flux-80gb) bench flux-80gb flux-lora-80gb 1024 --set "model.path=$(configs flux-dev)" ;;
    klein-12gb) bench klein-12gb flux2-klein-lora-12gb 1024 --set "model.path=$(configs flux2-klein)" ;;
    flux2-dev-32gb) bench flux2-dev-32gb flux2-dev-lora-32gb 1024 --set "model.path=$(configs flux2-dev)" ;;
    flux2-dev-24gb) bench flux2-dev-24gb flux2-dev-lora-24gb 1024 --set "model.path=$(configs flux2-dev)" ;;
    sd15) bench sd15 sd15-lora 512 --set training.mixed_precision=bf16 ;;
    sdxl-8gb) bench sdxl-8gb sdxl-lora-8gb 1024 ;;
    kontext-24gb) mapfile -t p < <(pairs 1024)
                  bench kontext-24gb kontext-lora-24gb 1024 --set "model.path=$(configs flux-kontext)" "${p[@]}" ;;
    qwen-edit-2509-24gb) mapfile -t p < <(pairs 1024 "${REFS:-1}")  # one reference; REFS=3 for three
                  bench qwen-edit-2509-24gb qwen-image-edit-2509-lora-24gb 1024 \
                    --set "model.path=$(configs qwen-image-edit-2509)" "${p[@]}" ;;
    wan21-12gb) mapfile -t c < <(clips 832 480 "${FRAMES:-49}")  # Wan 2.1 T2V 1.3B, 480p clips
                bench wan21-12gb wan21-t2v-lora-12gb 832 --set "model.path=$(configs wan21-t2v)" "${c[@]}" ;;
    wan22-5b-24gb) mapfile -t c < <(clips 1280 704 "${FRAMES:-49}")
                   bench wan22-5b-24gb wan22-ti2v-5b-lora-24gb 1280 --set "model.path=$(configs wan22-ti2v-5b)" \
                     "${c[@]}" ;;
    wan22-a14b-24gb) mapfile -t c < <(clips 832 480 "${FRAMES:-49}")  # one expert (the high-noise one)
                     bench wan22-a14b-24gb wan22-t2v-a14b-lora-24gb 832 \
                       --set "model.path=$(configs wan22-t2v-a14b)" "${c[@]}" ;;
    wan21-14b-24gb) mapfile -t c < <(clips 832 480 "${FRAMES:-49}")  # Wan 2.1 T2V 14B
                bench wan21-14b-24gb wan21-t2v-14b-lora-24gb 832 \
                  --set "model.path=$(configs wan21-t2v-14b)" "${c[@]}" ;;
    wan21-24gb) mapfile -t c < <(clips 832 480 "${FRAMES:-49}")
                bench wan21-24gb wan21-t2v-lora-24gb 832 --set "model.path=$(configs wan21-t2v)" "${c[@]}" ;;
    wan22-5b-16gb|wan22-5b-12gb) mapfile -t c < <(clips 1280 704 "${FRAMES:-49}")  # samples: the bench's own
                   bench "$1" "wan22-ti2v-5b-lora-${1##*-}" 1280 \
                     --set "model.path=$(configs wan22-ti2v-5b)" "${c[@]}" ;;
    wan22-a14b-16gb) mapfile -t c < <(clips 640 368 "${FRAMES:-49}")
                     bench wan22-a14b-16gb wan22-t2v-a14b-lora-16gb 640 \
                       --set "model.path=$(configs wan22-t2v-a14b)" "${c[@]}" ;;
    wan22-a14b-12gb) mapfile -t c < <(clips 480 272 "${FRAMES:-49}")
                     bench wan22-a14b-12gb wan22-t2v-a14b-lora-12gb 480 \
                       --set "model.path=$(configs wan22-t2v-a14b)" "${c[@]}" ;;
    wan21-i2v-24gb|wan22-i2v-a14b-24gb)  # image-to-video: each clip's first frame is its condition
              mapfile -t c < <(clips 832 480 "${FRAMES:-49}")
              v=${1%-24gb}  # the variant: wan21-i2v or wan22-i2v-a14b
              bench "$1" "$v-lora-24gb" 832 --set "model.path=$(configs "$v")" "${c[@]}" \
                --set "sampling.prompts=[{prompt: a clip of sks, image: $(images 832)/0.png, width: 832, height: 480,
                       steps: 4}]" ;;
    demo-wan-i2v) mapfile -t c < <(clips 64 64 9)  # the tiny Wan 2.1 I2V on any machine
              bench demo-wan-i2v demo-wan21-i2v 64 "${c[@]}" --set sampling.frames=5 \
                --set "sampling.prompts=[{prompt: a clip of sks, image: $(images 64)/0.png, width: 64, height: 64,
                       steps: 4}]" ;;
    demo-wan) mapfile -t c < <(clips 64 64 9)  # the tiny Wan on any machine: checks the clip cases
              bench demo-wan demo-wan 64 "${c[@]}" --set sampling.frames=5 ;;
    krea2-24gb) bench krea2-24gb krea2-lora 1024 --set "model.path=$(configs krea2)" ;;
    krea2-16gb|krea2-12gb) bench "$1" "krea2-lora-${1##*-}" 1024 --set "model.path=$(configs krea2)" ;;
    ideogram4-24gb) bench ideogram4-24gb ideogram4-lora 1024 --set "model.path=$(configs ideogram4)" ;;
    ideogram4-16gb) bench ideogram4-16gb ideogram4-lora-16gb 1024 --set "model.path=$(configs ideogram4)" ;;
    hidream-24gb) bench hidream-24gb hidream-lora 1024 --set "model.path=$(configs hidream-full)" ;;
    hidream-16gb) bench hidream-16gb hidream-lora-16gb 1024 --set "model.path=$(configs hidream-full)" ;;
    chroma-24gb) bench chroma-24gb chroma-lora 1024 --set "model.path=$(configs chroma)" ;;
    chroma-80gb) bench chroma-80gb chroma-lora-80gb 1024 --set "model.path=$(configs chroma)" ;;
    zimage-80gb) bench zimage-80gb zimage-lora-80gb 1024 --set "model.path=$(configs z-image)" ;;
    chroma-16gb) bench chroma-16gb chroma-lora-16gb 1024 --set "model.path=$(configs chroma)" ;;
    hunyuan-24gb) bench hunyuan-24gb hunyuan-image-lora 1024 --set "model.path=$(configs hunyuan-image)" ;;
    hunyuan-16gb) bench hunyuan-16gb hunyuan-image-lora-16gb 1024 --set "model.path=$(configs hunyuan-image)" ;;
    demo-krea2|demo-ideogram4|demo-hidream|demo-chroma|demo-hunyuan-image) bench "$1" "$1" 64 ;;  # tiny, any machine
    demo) bench demo demo-flux 64 ;;  # the tiny Flux on any machine: checks this script
    demo-pairs) mapfile -t p < <(pairs 64)  # the tiny Kontext on any machine: checks the pair cases
                bench demo-pairs demo-flux 64 --set model.path=builtin:tiny-flux-kontext "${p[@]}" ;;
    *) echo "unknown case $1" >&2; return 1 ;;
  esac
}

cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(flux-fp8 flux-16gb flux-12gb sd15 sdxl-8gb qwen-16gb klein-12gb)
for c in "${cases[@]}"; do run_case "$c"; done
echo "results: $RESULTS; logs under $WS" >&2
