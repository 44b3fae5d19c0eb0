#!/usr/bin/env bash
# Model-state memory per rank, measured, against the sharded strategies'
# formulas: a GPT job under DDP, ZeRO-1, ZeRO-2 and FSDP (full_shard) at 1,
# 2 and 4 ranks (fp32 weights, gradients and AdamW's two buffers; Ψ
# parameters, N ranks):
#   DDP 16Ψ    ZeRO-1 8Ψ + 8Ψ/N    ZeRO-2 4Ψ + 12Ψ/N    FSDP 16Ψ/N
# plus, for ZeRO-2 and FSDP, the buffers of whole units a step holds for a
# while (named below).
# "Measured" is the trainer's own count of the bytes it holds for the
# model's state (its log line "model state memory" and the step records'
# parameter_bytes, gradient_bytes, optimizer_state_bytes and buffer_bytes;
# the largest rank's), with the layout's padding; beside it, the rank
# processes' peak resident memory (activations, data and libraries
# included).
#
# Then the same GPT in 2 pipeline stages x 2 replicas (world 4) under DDP
# and under ZeRO-1 within the stages: each stage's AdamW state is split
# between its two replicas (the tied wte, stepped whole on each replica
# of both ends, is not).
#
#   bench/zero_memory.sh          # CONFIG=gpt-char: about half a minute
#   PIPELINE_ONLY=1 bench/zero_memory.sh   # only the pipeline's table
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
CONFIG=${CONFIG:-gpt-char}
PY=/usr/bin/python3
SLOTS=4 source "$ROOT/bench/local_cluster.sh" aidn-zero-memory

# The step records' bytes of job $1 (its last training step; the largest
# rank's): weights gradients optimizer buffers peak.
record_bytes() {
  "$AIDNCTL" -o json metrics "$1" | $PY -c '
import json, sys
steps = [s for s in json.load(sys.stdin) if s["kind"] == "TRAIN"]
s = steps[-1]
print(s["parameter_bytes"], s["gradient_bytes"], s["optimizer_state_bytes"], s["buffer_bytes"],
      s["peak_memory_bytes"])'
}
# A gpt job NAME under STRATEGY on WORLD ranks (with the spec line EXTRA),
# 2 steps; prints its record_bytes.
two_steps() {
  local name=$1 strategy=$2 world=$3 extra=${4:-}
  cat >"$RUN/spec-$name.yaml" <<YAML
name: bench-zero-memory-$name
strategy: $strategy
world_size: $world
$extra
model: {name: gpt, config: $CONFIG}
dataset: {kind: text, eval_windows: 1}
optimizer: {name: adamw, weight_decay: 0.1}
batch_size: 2
max_steps: 2
YAML
  local job
  job=$("$AIDNCTL" -o json submit -f "$RUN/spec-$name.yaml" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4)
  "$AIDNCTL" watch "$job" >/dev/null 2>&1 || true
  record_bytes "$job"
}
if [[ ${PIPELINE_ONLY:-0} != 1 ]]; then
echo "$CONFIG: model-state bytes per rank (the largest rank's), against the formula"
printf '%-8s %2s %11s %11s %11s %14s %14s %9s %11s %9s\n' strategy N weights gradients \
  optimizer persistent formula "+padding" buffers "peak RSS"
PSI=""
for strategy in ddp zero1 zero2 fsdp; do
  for n in 1 2 4; do
    read -r w g o b peak <<<"$(two_steps "$strategy-$n" "$strategy" "$n")"
    [[ -z $PSI ]] && PSI=$((w / 4))  # DDP on one rank: 4 bytes a parameter
    $PY - "$strategy" "$n" "$w" "$g" "$o" "$b" "$peak" "$PSI" <<'PY'
import sys
strategy, n = sys.argv[1], int(sys.argv[2])
w, g, o, b, peak, psi = map(int, sys.argv[3:9])
formula = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi // n, "zero2": 4 * psi + 12 * psi // n,
           "fsdp": 16 * psi // n}[strategy]
measured = w + g + o
mib = lambda x: f"{x / 2**20:.2f} MiB"
print(f"{strategy:<8} {n:2d} {mib(w):>11} {mib(g):>11} {mib(o):>11} "
      f"{mib(measured):>14} {mib(formula):>14} {measured - formula:>9} {mib(b):>11} "
      f"{peak / 2**20:>5.0f} MiB")
PY
  done
done
$PY - "$CONFIG" <<'PY'
import sys
names = {"gpt-char": (6, 384, 256, 256), "gpt-mini": (4, 128, 128, 256), "gpt-nano": (2, 32, 32, 256)}
layers, c, t, v = names.get(sys.argv[1], (0, 0, 0, 0))
pad = lambda x: (x + 15) // 16 * 16
root = pad(v * c) + pad(t * c) + 2 * pad(c)
block = sum(pad(x) for x in (c, c, 3 * c * c, 3 * c, c * c, c, c, c, 4 * c * c, 4 * c, 4 * c * c, c))
psi = v * c + t * c + 2 * c + layers * (12 * c * c + 13 * c)
print(f"Ψ = {psi} parameters; "
      f"+padding is persistent - formula in bytes (16-float alignment of every tensor, each bucket or "
      f"unit a multiple of 16 N floats; ZeRO-1's loss slot)")
print(f"buffers: ZeRO-2 the gradients of the root unit (embeddings and ln_f, {4 * root / 2**20:.2f} MiB) "
      f"and of at most two blocks ({4 * block / 2**20:.2f} MiB each) while their reduce-scatter runs; "
      f"FSDP those and the gathered weights of the root and at most two blocks")
PY
fi

echo
echo "$CONFIG in 2 pipeline stages x 2 replicas (world 4): bytes per rank (the largest rank's)"
printf '%-8s %11s %11s %11s %9s\n' strategy weights gradients optimizer "peak RSS"
declare -A OPT
for strategy in ddp zero1; do
  read -r w g o b peak <<<"$(two_steps "pipeline-$strategy" "$strategy" 4 \
    "parallel: {pipeline: 2, micro_batches: 2}")"
  OPT[$strategy]=$o
  $PY -c 'import sys; w, g, o, peak = map(int, sys.argv[2:6]); m = lambda x: f"{x / 2**20:.2f} MiB"
print(f"{sys.argv[1]:<8} {m(w):>11} {m(g):>11} {m(o):>11} {peak / 2**20:>5.0f} MiB")' \
    "$strategy" "$w" "$g" "$o" "$peak"
done
$PY -c 'import sys; d, z = map(int, sys.argv[1:3])
print(f"optimizer state: zero1 / ddp = {z / d:.3f} (the stage blocks halved; the tied wte whole on both ends)")' \
  "${OPT[ddp]}" "${OPT[zero1]}"
