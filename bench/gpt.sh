#!/usr/bin/env bash
# The GPT's training step on the CPU against the same model in PyTorch 1.13
# (bench/gpt_step.cc and bench/gpt_torch.py: nanoGPT's character-level shape
# over bytes, 10.8M parameters, context 256, AdamW with clipping), one rank,
# at 1 and 2 threads. Interleaved, REPS times each; prints every sample, the
# medians and the ratio, and each side's model GFLOP/s (6 N + attention per
# token) and model FLOPs utilisation against the cores' fp32 peak. Two
# ranks under DDP: bench/gpt_ddp.sh.
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
# The core's fp32 peak for MFU: FMA lanes x 2 FLOP x 2 FMA units x clock
# (AVX-512: 16 lanes, AVX2: 8), the clock from lscpu's max or cpuinfo.
PEAK=$(python3 - <<'PY'
import re, subprocess
flags = open("/proc/cpuinfo").read()
lanes = 16 if " avx512f" in flags else 8
mhz = None
try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    m = re.search(r"CPU max MHz:\s*([\d.]+)", out)
    mhz = float(m.group(1)) if m else None
except OSError:
    pass
if mhz is None:
    mhz = float(re.search(r"cpu MHz\s*:\s*([\d.]+)", flags).group(1))
print(f"{lanes * 2 * 2 * mhz / 1e3:.1f} {lanes} {mhz:.0f}")
PY
)
read -r PEAK_GFLOPS LANES MHZ <<<"$PEAK"
echo "core peak (fp32, assumed 2 FMA units): $LANES lanes x 2 x 2 x $MHZ MHz = $PEAK_GFLOPS GFLOP/s"
for threads in 1 2; do
  A=(); T=(); AG=(); TG=()
  for rep in $(seq 1 "$REPS"); do
    ar=$("$STEP" "${ARGS[@]}" --threads "$threads" --json | sed -n 's/^RESULT //p')
    tr=$(OMP_NUM_THREADS=$threads LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp \
      /usr/bin/python3 "$ROOT/bench/gpt_torch.py" "${ARGS[@]}" --threads "$threads" | sed -n 's/^RESULT //p')
    a=$(field tokens_per_s <<<"RESULT $ar"); t=$(field tokens_per_s <<<"RESULT $tr")
    A+=("$a"); T+=("$t")
    AG+=("$(field model_gflops_per_s <<<"RESULT $ar")"); TG+=("$(field model_gflops_per_s <<<"RESULT $tr")")
    printf 'threads %d rep %d: aidn %.0f tokens/s, torch %.0f tokens/s\n' "$threads" "$rep" "$a" "$t"
  done
  python3 - "$threads" "${A[*]}" "${T[*]}" "${AG[*]}" "${TG[*]}" "$PEAK_GFLOPS" <<'PY'
import statistics, sys
threads = int(sys.argv[1])
med = lambda s: statistics.median(float(x) for x in s.split())
a, t, ag, tg, peak = med(sys.argv[2]), med(sys.argv[3]), med(sys.argv[4]), med(sys.argv[5]), float(sys.argv[6])
print(f"threads {threads} median: aidn {a:.0f} tokens/s, torch {t:.0f} tokens/s, aidn/torch {a / t:.2f}x")
print(f"threads {threads} model FLOPs: aidn {ag:.1f} GFLOP/s = MFU {100 * ag / (peak * threads):.1f} %, "
      f"torch {tg:.1f} GFLOP/s = MFU {100 * tg / (peak * threads):.1f} %")
PY
done
