#!/usr/bin/env bash
# ZeRO-2 and FSDP on one GPU against the unsharded step, in the same run:
# bench/gpu_gpt_step.cc's GPT training step plain (`ddp`: one rank has
# nothing to average), then under zero2, shard_grad_op and full_shard over
# an NCCL communicator of one rank (cuda/gpu_fsdp.h: every unit gathered and
# reduce-scattered on the NCCL stream, as a one-GPU job runs), and
# full_shard with bf16 gathers and reduce-scatters. Prints tokens/s, each
# strategy's ratio to the plain step, the allocator's peak, and the model
# state the step holds (weights, gradients, AdamW state: 16 bytes a
# parameter plus the layout's padding at N = 1) with the pools' buffers.
# One GPU shows the cost of the sharded step's collectives and bookkeeping,
# not the memory saving, which needs N > 1 ranks (docs/strategies.md gives
# the formulas).
#
#   bench/gpu_zero.sh                      # gpt2 (124M), bf16, batch 8 x 1024
#   CONFIG=gpt2-medium BATCH=4 bench/gpu_zero.sh
#
# Knobs: CONFIG (gpt2), BATCH (8), SEQ (1024), PRECISION (bf16), STEPS (20),
# WARMUP (5), AIDN_BUILD (<repo>/build-gpu), GPU_GPT_BIN (a gpu_gpt_step
# built elsewhere: nothing is built).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build-gpu}
BIN=${GPU_GPT_BIN:-$BUILD/bench/gpu_gpt_step}
if [[ -z ${GPU_GPT_BIN:-} ]]; then
  if [[ ! -f $BUILD/build.ninja ]]; then
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAIDN_ENGINE_ONLY=ON \
      -DAIDN_BUILD_BENCHMARKS=ON >/dev/null
  fi
  # Quiet unless it fails (ninja prints compiler errors on stdout).
  log=$(ninja -C "$BUILD" gpu_gpt_step 2>&1) || { echo "$log" >&2; exit 1; }
fi
common=(--config "${CONFIG:-gpt2}" --batch "${BATCH:-8}" --seq "${SEQ:-1024}"
  --precision "${PRECISION:-bf16}" --steps "${STEPS:-20}" --warmup "${WARMUP:-5}" --json)
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
for run in "ddp" "zero2" "shard_grad_op" "full_shard" "full_shard --param-dtype bf16 --reduce-dtype bf16"; do
  # shellcheck disable=SC2086
  line=$("$BIN" "${common[@]}" --strategy $run | grep '^RESULT ' || true)
  if [[ -z $line ]]; then
    echo "$run: no result" >&2
    continue
  fi
  echo "$run|${line#RESULT }" >>"$RESULTS"
done
python3 - "$RESULTS" <<'PY'
import json, sys
rows = []
for line in open(sys.argv[1]):
    name, _, payload = line.rstrip("\n").partition("|")
    rows.append((name.replace(" --param-dtype bf16 --reduce-dtype bf16", " (bf16 gathers)"),
                 json.loads(payload)))
if not rows:
    sys.exit("no results")
base = rows[0][1]["tokens_per_s"] if rows[0][0] == "ddp" else None
r = rows[0][1]
print(f"model {r['config']} ({r['parameters'] / 1e6:.1f}M parameters), {r['precision']}, "
      f"batch {r['batch']} x {r['seq']}, one rank")
print(f"{'strategy':<28} {'tokens/s':>10} {'vs ddp':>7} {'peak GiB':>9} {'state MiB':>10} "
      f"{'16 B/param':>10} {'buffers MiB':>11}")
for name, r in rows:
    state = r["weights_mib"] + r["gradients_mib"] + r["optimizer_mib"]
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
    print(f"{name:<28} {r['tokens_per_s']:>10.0f} {ratio:>7} {r['peak_gib']:>9.2f} "
          f"{state:>10.1f} {r['formula_mib']:>10.1f} {r['buffers_mib']:>11.1f}")
PY
