#!/usr/bin/env bash
# The GPU training step, aidn against PyTorch eager on the same GPU, in the
# same run, interleaved (issue 7's figures). For a GPU machine: builds the
# engine alone (no gRPC needed) and runs build-gpu/bench/gpu_step beside
# bench/gpu_step_torch.py.
#
#   bench/gpu_step.sh                        # mlp and cnn at batch 64, 256, 1024; REPS=3
#   MODELS=mlp BATCHES="64" REPS=5 bench/gpu_step.sh
#
# Knobs: MODELS ("mlp cnn"), BATCHES ("64 256 1024"), REPS (3), STEPS (500),
# WARMUP (50), TF32 (0), PYTHON (python3: needs torch with CUDA),
# AIDN_BUILD (<repo>/build-gpu; configured here if missing).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build-gpu}
MODELS=${MODELS:-mlp cnn}
BATCHES=${BATCHES:-64 256 1024}
REPS=${REPS:-3}
STEPS=${STEPS:-500}
WARMUP=${WARMUP:-50}
PYTHON=${PYTHON:-python3}
TF32_FLAG=""
[[ ${TF32:-0} == 1 ]] && TF32_FLAG="--tf32"

if [[ ! -f $BUILD/build.ninja ]]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAIDN_ENGINE_ONLY=ON \
    -DAIDN_BUILD_BENCHMARKS=ON >/dev/null
fi
ninja -C "$BUILD" gpu_step >/dev/null

echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1);" \
  "torch $($PYTHON -c 'import torch; print(torch.__version__)')"
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
for rep in $(seq 1 "$REPS"); do
  for model in $MODELS; do
    for batch in $BATCHES; do
      # Alternate which goes first, so neither always meets a warmer GPU.
      if (( rep % 2 )); then order="aidn torch"; else order="torch aidn"; fi
      for impl in $order; do
        if [[ $impl == aidn ]]; then
          line=$("$BUILD/bench/gpu_step" --model "$model" --batch "$batch" --steps "$STEPS" \
                   --warmup "$WARMUP" $TF32_FLAG --json | grep '^RESULT ')
        else
          line=$("$PYTHON" "$ROOT/bench/gpu_step_torch.py" --model "$model" --batch "$batch" \
                   --steps "$STEPS" --warmup "$WARMUP" $TF32_FLAG | grep '^RESULT ')
        fi
        echo "${line#RESULT }" >>"$RESULTS"
        echo "rep $rep $impl $model batch $batch: $(echo "${line#RESULT }" |
          "$PYTHON" -c 'import json,sys; r=json.load(sys.stdin); print(f"{r[\"samples_per_s\"]:.0f} samples/s, median step {r[\"median_step_ms\"]:.3f} ms, loss {r[\"final_loss\"]:.4f}")')"
      done
    done
  done
done

"$PYTHON" - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cases = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda c: (c[0], c[1]))
print()
print(f"{'case':<16} | {'aidn samples/s':>14} | {'torch samples/s':>15} | {'aidn/torch':>10}")
print("-" * 66)
for model, batch in cases:
    med = {}
    for impl in ("aidn", "torch"):
        v = [r["samples_per_s"] for r in rows if r["model"] == model and r["batch"] == batch and r["impl"] == impl]
        med[impl] = statistics.median(v) if v else float("nan")
    print(f"{model} b{batch:<11} | {med['aidn']:>14.0f} | {med['torch']:>15.0f} | {med['aidn'] / med['torch']:>10.2f}")
print()
print("targets (issue 7): aidn/torch >= 1.0 everywhere, >= 2.0 at batch 64 (medians over reps)")
PY
