#!/usr/bin/env bash
# The GPT's training step on the CPU against the same model in PyTorch 1.13
# (bench/gpt_step.cc and bench/gpt_torch.py: nanoGPT's character-level shape
# over bytes, 10.8M parameters, context 256, AdamW with clipping), one rank,
# at 1 and 2 threads. Interleaved, REPS times each; prints every sample, the
# medians and the ratio, and each side's model GFLOP/s (6 N + attention per
# token).
#
#   bench/gpt.sh            # REPS=3 STEPS=8 BATCH=8: a few minutes
#
# Needs build-bench/bench/gpt_step (AIDN_BUILD_BENCHMARKS=ON):
#   AIDN_BUILD_DIR=build-bench AIDN_CMAKE_ARGS=-DAIDN_BUILD_BENCHMARKS=ON scripts/build.sh gpt_step
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build-bench}
REPS=${REPS:-3}
STEPS=${STEPS:-8}
BATCH=${BATCH:-8}
CONFIG=${CONFIG:-gpt-char}
STEP=$BUILD/bench/gpt_step
[[ -x $STEP ]] || { echo "build it: AIDN_BUILD_DIR=build-bench AIDN_CMAKE_ARGS=-DAIDN_BUILD_BENCHMARKS=ON scripts/build.sh gpt_step" >&2; exit 1; }
ARGS=(--config "$CONFIG" --batch "$BATCH" --steps "$STEPS" --warmup 2)
field() { sed -n 's/^RESULT //p' | python3 -c "import json, sys; print(json.load(sys.stdin)['$1'])"; }
echo "config $CONFIG batch $BATCH steps $STEPS (2 of warm-up); $("$STEP" --steps 2 --warmup 1 --batch 1 --seq 8 | sed 's/.*| //')"
for threads in 1 2; do
  A=(); T=()
  for rep in $(seq 1 "$REPS"); do
    a=$("$STEP" "${ARGS[@]}" --threads "$threads" --json | field tokens_per_s)
    t=$(OMP_NUM_THREADS=$threads LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp \
      /usr/bin/python3 "$ROOT/bench/gpt_torch.py" "${ARGS[@]}" --threads "$threads" | field tokens_per_s)
    A+=("$a"); T+=("$t")
    printf 'threads %d rep %d: aidn %.0f tokens/s, torch %.0f tokens/s\n' "$threads" "$rep" "$a" "$t"
  done
  python3 - "$threads" "${A[*]}" "${T[*]}" <<'PY'
import statistics, sys
threads = sys.argv[1]
a = statistics.median(float(x) for x in sys.argv[2].split())
t = statistics.median(float(x) for x in sys.argv[3].split())
print(f"threads {threads} median: aidn {a:.0f} tokens/s, torch {t:.0f} tokens/s, aidn/torch {a / t:.2f}x")
PY
done
