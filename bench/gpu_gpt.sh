#!/usr/bin/env bash
# The GPT training step on one GPU: aidn's decoder (bench/gpu_gpt_step.cc)
# against the same model in PyTorch on the same GPU in the same run, eager
# and torch.compile (bench/gpt_torch.py --device cuda: flash attention
# through scaled_dot_product_attention, bf16 under autocast), interleaved
# REPS times. Prints tokens/s, MFU, peak memory and aidn's ratio to each.
#
#   bench/gpu_gpt.sh                       # gpt2 (124M), bf16, batch 8 x 1024
#   CONFIG=gpt-char BATCH=64 SEQ=256 PRECISION=fp32 bench/gpu_gpt.sh
#
# Knobs: CONFIG (gpt2), BATCH (8), SEQ (1024), PRECISION (bf16; fp32),
# STEPS (30), WARMUP (5; torch.compile compiles in its first step), REPS (1),
# PEAK_TFLOPS (the GPU's dense peak for MFU: 989 for bf16 on an H100/H200
# SXM, 67 for fp32), COMPILE (1: also torch.compile), PYTHON (python3: a
# torch with CUDA), AIDN_BUILD (<repo>/build-gpu, configured if missing),
# GPU_GPT_BIN (a gpu_gpt_step built elsewhere: nothing is built).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build-gpu}
CONFIG=${CONFIG:-gpt2}
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
PRECISION=${PRECISION:-bf16}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
REPS=${REPS:-1}
PYTHON=${PYTHON:-python3}
if [[ -z ${PEAK_TFLOPS:-} ]]; then
  PEAK_TFLOPS=989
  [[ $PRECISION == fp32 ]] && PEAK_TFLOPS=67
fi
BIN=${GPU_GPT_BIN:-$BUILD/bench/gpu_gpt_step}
if [[ -z ${GPU_GPT_BIN:-} ]]; then
  if [[ ! -f $BUILD/build.ninja ]]; then
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAIDN_ENGINE_ONLY=ON \
      -DAIDN_BUILD_BENCHMARKS=ON >/dev/null
  fi
  ninja -C "$BUILD" gpu_gpt_step >/dev/null
fi

echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1);" \
  "torch $($PYTHON -c 'import torch; print(torch.__version__)')"
echo "model $CONFIG, $PRECISION, batch $BATCH x $SEQ tokens, $((STEPS - WARMUP)) timed steps," \
  "MFU against $PEAK_TFLOPS TFLOP/s"
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
common=(--config "$CONFIG" --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --warmup "$WARMUP")
for rep in $(seq 1 "$REPS"); do
  line=$("$BIN" "${common[@]}" --precision "$PRECISION" --json | grep '^RESULT ' || true)
  echo "aidn ${line#RESULT }" >>"$RESULTS"
  echo "rep $rep aidn: ${line#RESULT }"
  line=$("$PYTHON" "$ROOT/bench/gpt_torch.py" "${common[@]}" --device cuda \
    --precision "$PRECISION" | grep '^RESULT ' || true)
  echo "eager ${line#RESULT }" >>"$RESULTS"
  echo "rep $rep torch eager: ${line#RESULT }"
  if [[ ${COMPILE:-1} == 1 ]]; then
    line=$("$PYTHON" "$ROOT/bench/gpt_torch.py" "${common[@]}" --device cuda \
      --precision "$PRECISION" --compile | grep '^RESULT ' || true)
    echo "compile ${line#RESULT }" >>"$RESULTS"
    echo "rep $rep torch.compile: ${line#RESULT }"
  fi
done
"$PYTHON" - "$RESULTS" "$PEAK_TFLOPS" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    text = text.strip()
    if text:
        runs.setdefault(who, []).append(json.loads(text))
peak = float(sys.argv[2])
def median(who, key):
    return statistics.median(r[key] for r in runs[who]) if runs.get(who) else float("nan")
def flops(r):
    return r.get("model_tflops_per_s", r.get("model_gflops_per_s", 0) / 1e3)
print(f"{'':16}{'tokens/s':>12}{'step ms':>10}{'MFU':>8}{'peak GiB':>10}{'aidn / it':>11}")
ours = median("aidn", "tokens_per_s")
for who, name in (("aidn", "aidn"), ("eager", "torch eager"), ("compile", "torch.compile")):
    if not runs.get(who):
        print(f"{name:16}{'(no result)':>12}")
        continue
    tps = median(who, "tokens_per_s")
    mfu = statistics.median(flops(r) for r in runs[who]) / peak
    print(f"{name:16}{tps:12.0f}{median(who, 'median_step_ms'):10.1f}{100 * mfu:7.1f}%"
          f"{median(who, 'peak_gib'):10.2f}{ours / tps:11.2f}")
PY
