#!/usr/bin/env bash
# The GPU training step, aidn against PyTorch eager on the same GPU, in the
# same run, interleaved. For a GPU machine: builds the engine alone (no gRPC
# needed) and runs build-gpu/bench/gpu_step beside bench/gpu_step_torch.py.
#
#   bench/gpu_step.sh                        # mlp and cnn at batch 64, 256, 1024; REPS=3
#   MODELS=mlp BATCHES="64" REPS=5 bench/gpu_step.sh
#
# The CNN runs twice: deterministic convolution algorithms (aidn's default;
# torch with cudnn.deterministic) and any algorithm (gpu_step --fast-conv;
# torch's default). Both sides pick per shape by timing (cudnn.benchmark).
#
# Knobs: MODELS ("mlp cnn"), BATCHES ("64 256 1024"), REPS (3), STEPS (500),
# CONV_MODES ("deterministic fast"),
# WARMUP (50), TF32 (0), PRECISION (fp32; bf16, fp16), GRAPHS (0), PYTHON (python3: needs torch with CUDA),
# AIDN_BUILD (<repo>/build-gpu; configured here if missing), GPU_STEP_BIN (a
# gpu_step built elsewhere: nothing is built; scripts/gpu_device.sh uses it).
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
# PRECISION=bf16 or fp16: both sides in that mixed precision. GRAPHS=1:
# aidn replays CUDA graphs (torch stays eager).
PRECISION_FLAG="--precision ${PRECISION:-fp32}"
GRAPHS_FLAG=""
[[ ${GRAPHS:-0} == 1 ]] && GRAPHS_FLAG="--cuda-graphs"

GPU_STEP=${GPU_STEP_BIN:-$BUILD/bench/gpu_step}
if [[ -z ${GPU_STEP_BIN:-} ]]; then
  if [[ ! -f $BUILD/build.ninja ]]; then
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAIDN_ENGINE_ONLY=ON \
      -DAIDN_BUILD_BENCHMARKS=ON >/dev/null
  fi
  ninja -C "$BUILD" gpu_step >/dev/null
fi

echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1);" \
  "torch $($PYTHON -c 'import torch; print(torch.__version__)')"
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
summarize() {
  "$PYTHON" -c 'import json, sys
r = json.loads(sys.argv[1])
print("%.0f samples/s, median step %.3f ms, loss %.4f"
      % (r["samples_per_s"], r["median_step_ms"], r["final_loss"]))' "$1"
}
for rep in $(seq 1 "$REPS"); do
  for model in $MODELS; do
    # The MLP has no convolutions: one mode. The CNN in both: deterministic
    # algorithms (aidn's default) and any algorithm (PyTorch's default).
    modes="deterministic"
    [[ $model == cnn ]] && modes=${CONV_MODES:-deterministic fast}
    for mode in $modes; do
      for batch in $BATCHES; do
        # Alternate which goes first, so neither always meets a warmer GPU.
        if (( rep % 2 )); then order="aidn torch"; else order="torch aidn"; fi
        for impl in $order; do
          if [[ $impl == aidn ]]; then
            flag=""
            [[ $mode == fast ]] && flag="--fast-conv"
            line=$("$GPU_STEP" --model "$model" --batch "$batch" --steps "$STEPS" \
                     --warmup "$WARMUP" $TF32_FLAG $PRECISION_FLAG $GRAPHS_FLAG $flag --json |
                     grep '^RESULT ')
          else
            flag=""
            [[ $mode == deterministic ]] && flag="--deterministic"
            line=$("$PYTHON" "$ROOT/bench/gpu_step_torch.py" --model "$model" --batch "$batch" \
                     --steps "$STEPS" --warmup "$WARMUP" $TF32_FLAG $PRECISION_FLAG $flag |
                     grep '^RESULT ')
          fi
          line=${line#RESULT }
          echo "$line" >>"$RESULTS"
          echo "rep $rep $impl $model $mode batch $batch: $(summarize "$line")"
        done
      done
    done
  done
done

"$PYTHON" - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cases = sorted({(r["model"], r["conv"], r["batch"]) for r in rows})
print()
print(f"{'case':<26} | {'aidn samples/s':>14} | {'torch samples/s':>15} | {'aidn/torch':>10}")
print("-" * 76)
for model, conv, batch in cases:
    med = {}
    for impl in ("aidn", "torch"):
        v = [r["samples_per_s"] for r in rows
             if (r["model"], r["conv"], r["batch"], r["impl"]) == (model, conv, batch, impl)]
        med[impl] = statistics.median(v) if v else float("nan")
    label = f"{model} b{batch}" + (f" {conv}" if model == "cnn" else "")
    print(f"{label:<26} | {med['aidn']:>14.0f} | {med['torch']:>15.0f} | {med['aidn'] / med['torch']:>10.2f}")
cudnn = {r.get("cudnn") for r in rows if r["impl"] == "torch"}
print()
print(f"torch's cuDNN: {sorted(cudnn)}; targets: aidn/torch >= 1.0 everywhere, >= 2.0 at batch 64 (medians over reps)")
PY
