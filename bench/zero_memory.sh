#!/usr/bin/env bash
# Model-state memory per rank, measured, against ZeRO's formulas: a GPT job
# under DDP and under ZeRO-1 at 1, 2 and 4 ranks (fp32 weights, gradients
# and AdamW's two buffers; Ψ parameters, N ranks):
#   DDP 16Ψ        ZeRO-1 8Ψ + 8Ψ/N
# "Measured" is the trainer's own count of the bytes it holds for the
# model's state (its log line "model state memory" and the step records'
# parameter_bytes, gradient_bytes, optimizer_state_bytes and buffer_bytes;
# the largest rank's), with the buckets' padding; beside it, the rank
# processes' peak resident memory (activations, data and libraries
# included).
#
#   bench/zero_memory.sh          # CONFIG=gpt-char: about 2 minutes
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
CONFIG=${CONFIG:-gpt-char}
PY=/usr/bin/python3
SLOTS=4 source "$ROOT/bench/local_cluster.sh" aidn-zero-memory

echo "$CONFIG: model-state bytes per rank (the largest rank's), against the formula"
printf '%-8s %2s %12s %12s %12s %8s %14s %14s %10s %9s\n' strategy N weights gradients \
  optimizer buffers measured formula "+padding" "peak RSS"
PSI=""
for strategy in ddp zero1; do
  for n in 1 2 4; do
    cat >"$RUN/spec-$strategy-$n.yaml" <<YAML
name: bench-zero-memory-$strategy-$n
strategy: $strategy
world_size: $n
model: {name: gpt, config: $CONFIG}
dataset: {kind: text, eval_windows: 1}
optimizer: {name: adamw, weight_decay: 0.1}
batch_size: 2
max_steps: 2
YAML
    job=$("$AIDNCTL" -o json submit -f "$RUN/spec-$strategy-$n.yaml" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4)
    "$AIDNCTL" watch "$job" >/dev/null 2>&1 || true
    line=$("$AIDNCTL" -o json metrics "$job" | $PY -c '
import json, sys
steps = [s for s in json.load(sys.stdin) if s["kind"] == "TRAIN"]
s = steps[-1]
print(s["parameter_bytes"], s["gradient_bytes"], s["optimizer_state_bytes"], s["buffer_bytes"],
      s["peak_memory_bytes"])')
    read -r w g o b peak <<<"$line"
    [[ -z $PSI ]] && PSI=$((w / 4))  # DDP on one rank: 4 bytes a parameter
    $PY - "$strategy" "$n" "$w" "$g" "$o" "$b" "$peak" "$PSI" <<'PY'
import sys
strategy, n = sys.argv[1], int(sys.argv[2])
w, g, o, b, peak, psi = map(int, sys.argv[3:9])
formula = 16 * psi if strategy == "ddp" else 8 * psi + 8 * psi // n
measured = w + g + o + b
mib = lambda x: f"{x / 2**20:.2f} MiB"
print(f"{strategy:<8} {n:2d} {mib(w):>12} {mib(g):>12} {mib(o):>12} {mib(b):>8} "
      f"{mib(measured):>14} {mib(formula):>14} {measured - formula:>10} {peak / 2**20:>5.0f} MiB")
PY
  done
done
echo "Ψ = $PSI parameters; +padding is measured - formula in bytes (bucket alignment, the loss slot)"
