#!/usr/bin/env bash
# Gradient compression under DDP on this machine's CPUs: each model trained
# by real aidn jobs on 2 ranks (one coordinator, one worker with 2 CPU
# slots) with ddp.compression none, fp16, bf16 and powersgd, the same seed
# and data. Prints each job's final test accuracy (GPT: validation loss),
# the bytes its gradient collectives carried a step (the metrics'
# gradient_comm_bytes, the last step's) against plain DDP's, the ratio of
# the two, and its throughput (Job.throughput).
#
#   bench/compression.sh                       # about 5 minutes on an idle 2-core machine
#   MODELS="cnn" POWERSGD_RANK=2 SEED=2 bench/compression.sh
#
# Models: MLP 784-256-256-10 (batch 64 per rank, 600 steps), the small CNN
# (64, 300), GPT gpt-mini on the fortunes corpus (8 windows of 128 bytes,
# 300 steps). PowerSGD: rank POWERSGD_RANK (4), plain allreduce for the
# first POWERSGD_START (50) steps, error feedback and warm start on.
#
# Needs build/ (scripts/build.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
PY=/usr/bin/python3
read -r -a MODEL_LIST <<<"${MODELS:-mlp cnn gpt}"
read -r -a KINDS <<<"${COMPRESSIONS:-none fp16 bf16 powersgd}"
SLOTS=2 source "$ROOT/bench/local_cluster.sh" aidn-compression

steps_of() { case $1 in mlp) echo 600 ;; cnn) echo 300 ;; gpt) echo 300 ;; esac; }

spec_of() {  # model compression
  local model=$1 kind=$2
  echo "name: compression-$model-$kind"
  echo "world_size: 2"
  echo "max_steps: $(steps_of "$model")"
  echo "seed: ${SEED:-1}"
  if [[ $kind == powersgd ]]; then
    echo "ddp: {compression: powersgd, powersgd_rank: ${POWERSGD_RANK:-4}, powersgd_start_step: ${POWERSGD_START:-50}}"
  else
    echo "ddp: {compression: $kind}"
  fi
  if [[ $model == gpt ]]; then
    cat <<EOF
batch_size: 8
model: {name: gpt, config: gpt-mini}
dataset: {kind: text, files: [/usr/share/games/fortunes], eval_windows: 64}
optimizer: {name: adamw, lr: 0.003, weight_decay: 0.1}
EOF
    return
  fi
  echo "batch_size: 64"
  echo "model: {name: $model}"
  echo "dataset: {kind: fashion-mnist}"
  echo "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}"
}

# One job: "quality bytes uncompressed samples_per_s" (quality: the last
# evaluation's test accuracy, GPT: its loss).
run() {  # model compression
  local spec=$RUN/$1-$2.yaml job state
  spec_of "$1" "$2" >"$spec"
  read -r job state <<<"$(run_job "$spec")"
  if [[ $state != SUCCEEDED ]]; then
    echo "$1 $2: job $job ended $state" >&2
    echo "- - - -"
    return
  fi
  local throughput
  throughput=$("$AIDNCTL" -o json describe "$job" |
    $PY -c 'import json, sys; print("%.1f" % json.load(sys.stdin).get("throughput", {}).get("samples_per_second", 0))')
  "$AIDNCTL" -o json metrics "$job" | $PY -c '
import json, sys
model, throughput = sys.argv[1], sys.argv[2]
steps = json.load(sys.stdin)
steps = steps.get("steps", steps) if isinstance(steps, dict) else steps
evals = [s for s in steps if s.get("kind") == "EVAL"]
train = [s for s in steps if s.get("kind", "TRAIN") == "TRAIN"]
last = evals[-1] if evals else {}
quality = last.get("test_loss" if model == "gpt" else "test_accuracy", 0)
t = train[-1] if train else {}
print("%.4f %d %d %s" % (quality, int(t.get("gradient_comm_bytes", 0)),
                         int(t.get("gradient_comm_bytes_uncompressed", 0)), throughput))
' "$1" "$throughput"
}

printf '%-5s %-9s %10s %12s %12s %8s %12s\n' model ddp "quality" "bytes/step" "plain bytes" ratio "samples/s"
for model in "${MODEL_LIST[@]}"; do
  for kind in "${KINDS[@]}"; do
    read -r quality bytes plain throughput <<<"$(run "$model" "$kind")"
    ratio="-"
    [[ $bytes != - && $plain != - && $plain != 0 ]] && ratio=$($PY -c "print('%.3f' % ($bytes / $plain))")
    printf '%-5s %-9s %10s %12s %12s %8s %12s\n' "$model" "$kind" "$quality" "$bytes" "$plain" "$ratio" "$throughput"
  done
done
echo "(quality: final test accuracy; gpt: final validation loss. ratio: bytes/step over plain DDP's)"
