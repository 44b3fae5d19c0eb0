#!/usr/bin/env bash
# The largest GPT each strategy trains with every rank's peak resident
# memory under a cap (CAP_MIB, default 1024), at N ranks (default 2), and
# its speed there. The model grows in depth at GPT-2's width (n_embd 768,
# 12 heads, context 256, bytes); batch 2 a rank, AdamW, fp32.
#
# For each strategy the peak at 1 and 2 layers gives the bytes a layer
# costs; the depth that fits is then run, and the next one, to show it
# does not. "Peak" is the largest rank's peak resident set (VmHWM: the
# model state, activations, buffers, data and libraries), as the step
# records' peak_memory_bytes report it: what an OOM killer or a cgroup
# limit would meet.
#
#   bench/zero_capacity.sh        # about 10 minutes on 2 vCPUs
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
CAP_MIB=${CAP_MIB:-1024}
N=${N:-2}
PY=/usr/bin/python3
SLOTS=$N source "$ROOT/bench/local_cluster.sh" aidn-zero-capacity

# run STRATEGY LAYERS CKPT -> "peak_bytes tokens_per_s parameters"
run() {
  local strategy=$1 layers=$2 ckpt=$3 name="cap-$1-$2-$3"
  cat >"$RUN/$name.yaml" <<YAML
name: $name
strategy: $strategy
world_size: $N
model: {name: gpt, n_layer: $layers, n_head: 12, n_embd: 768, block_size: 256,
        activation_checkpointing: $ckpt}
dataset: {kind: text, eval_windows: 1}
optimizer: {name: adamw, weight_decay: 0.1}
batch_size: 2
max_steps: 3
YAML
  local job
  job=$("$AIDNCTL" -o json submit -f "$RUN/$name.yaml" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4)
  "$AIDNCTL" watch "$job" >/dev/null 2>&1 || true
  "$AIDNCTL" -o json metrics "$job" | $PY -c '
import json, sys
steps = [s for s in json.load(sys.stdin) if s["kind"] == "TRAIN"]
if not steps:
    print(0, 0)
else:
    print(max(int(s["peak_memory_bytes"]) for s in steps), steps[-1].get("tokens_per_second", 0))'
}

params() {  # GPT parameters at depth $1 (vocab 256, context 256, width 768)
  echo $(( 256 * 768 + 256 * 768 + 2 * 768 + $1 * (12 * 768 * 768 + 13 * 768) ))
}

echo "largest GPT (n_embd 768, 12 heads, context 256) with every rank's peak RSS under $CAP_MIB MiB, $N ranks"
printf '%-14s %7s %12s %12s %14s %12s %14s\n' strategy n_layer parameters "peak RSS" "next: peak" tokens/s "model GFLOP/s"
cap=$((CAP_MIB * 1048576))
for variant in ddp zero1 zero2 fsdp fsdp+ckpt; do
  strategy=${variant%+ckpt}
  ckpt=false; [[ $variant == *+ckpt ]] && ckpt=true
  read -r p1 _ < <(run "$strategy" 1 $ckpt)
  read -r p2 _ < <(run "$strategy" 2 $ckpt)
  per=$((p2 - p1)); ((per > 0)) || per=1
  layers=$((1 + (cap - p1) / per))
  ((layers >= 1)) || layers=1
  read -r peak tps < <(run "$strategy" "$layers" $ckpt)
  while ((peak > cap && layers > 1)); do
    layers=$((layers - 1)); read -r peak tps < <(run "$strategy" "$layers" $ckpt)
  done
  read -r next _ < <(run "$strategy" $((layers + 1)) $ckpt)
  while ((next <= cap)); do
    layers=$((layers + 1)); peak=$next
    read -r _ tps < <(run "$strategy" "$layers" $ckpt)
    read -r next _ < <(run "$strategy" $((layers + 1)) $ckpt)
  done
  psi=$(params "$layers")
  $PY - "$variant" "$layers" "$psi" "$peak" "$next" "$tps" <<'PY'
import sys
variant, layers, psi, peak, nxt, tps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
flops = 6 * psi + 6 * layers * 256 * 768  # per token, with attention
print(f"{variant:<14} {layers:>7} {psi / 1e6:>11.1f}M {peak / 2**20:>8.0f} MiB {nxt / 2**20:>10.0f} MiB "
      f"{tps:>12.0f} {tps * flops / 1e9:>14.1f}")
PY
done
echo "next: the peak one layer deeper (over the cap); tokens/s of every rank together, last of 3 steps"
