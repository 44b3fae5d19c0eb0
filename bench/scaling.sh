#!/usr/bin/env bash
# DDP scaling on this machine's CPUs: each model trained at 1 and 2 ranks as
# real aidn jobs (one coordinator, one worker with 2 CPU slots, shared
# memory between the ranks), each job's throughput and scaling efficiency
# as the coordinator reports them when it succeeds (Job.throughput, what
# `aidnctl describe` shows: samples summed over the ranks per second of
# step time, each generation's first step left out; efficiency =
# throughput at 2 ranks / (2 x throughput at 1 rank, the newest 1-rank job
# of the same spec)). Beside it, PyTorch 1.13's DDP (gloo) on the same model,
# batch and optimizer (bench/torch_peer.py; GPT: aidn only), and the ratio
# of the two throughputs at 2 ranks.
#
#   bench/scaling.sh                       # about 5 minutes on an idle 2-core machine
#   MODELS="mlp resnet18" bench/scaling.sh
#
# Weak scaling, as a DDP job runs: the batch is per rank, so 2 ranks train
# twice the samples a step. Models and steps: MLP 784-256-256-10 (batch 64,
# 300 steps), the small CNN (64, 60), ResNet-18 with the small-image stem
# (16, 12), GPT gpt-mini on the fortunes corpus (8 windows of 128 bytes, 30
# steps; tokens/s beside samples/s). SGD lr 0.05 momentum 0.9 (GPT: AdamW).
#
# Needs build/ (scripts/build.sh) and, for the peer, python3-torch and
# python3-torchvision (scripts/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
PY=/usr/bin/python3
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
TORCH_BLAS_DIR=${TORCH_BLAS_DIR:-/usr/lib/x86_64-linux-gnu/openblas-openmp}
read -r -a MODEL_LIST <<<"${MODELS:-mlp cnn resnet18 gpt}"
SLOTS=2 source "$ROOT/bench/local_cluster.sh" aidn-scaling

batch_of() { case $1 in mlp | cnn) echo 64 ;; resnet18) echo 16 ;; gpt) echo 8 ;; esac; }
steps_of() { case $1 in mlp) echo 300 ;; cnn) echo 60 ;; resnet18) echo 12 ;; gpt) echo 30 ;; esac; }

spec_of() {  # model world
  local model=$1 world=$2
  echo "name: scaling-$model-w$world"
  echo "world_size: $world"
  echo "batch_size: $(batch_of "$model")"
  echo "max_steps: $(steps_of "$model")"
  echo "seed: 1"
  if [[ $model == gpt ]]; then
    cat <<EOF
model: {name: gpt, config: gpt-mini}
dataset: {kind: text, files: [/usr/share/games/fortunes], eval_windows: 8}
optimizer: {name: adamw, lr: 0.003}
EOF
    return
  fi
  echo "model: {name: $model}"
  echo "dataset: {kind: fashion-mnist, dir: $DATA_DIR}"
  echo "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}"
  echo "eval_max_samples: 512"
}

# Runs the job to its end; prints Job.throughput as JSON ({} if it failed).
run_aidn() {  # model world
  local spec=$RUN/$1-w$2.yaml job state
  spec_of "$1" "$2" >"$spec"
  read -r job state <<<"$(run_job "$spec")"
  if [[ $state != SUCCEEDED ]]; then
    echo "aidn $1 at $2 ranks: job $job ended $state" >&2
    echo '{}'
    return
  fi
  "$AIDNCTL" -o json describe "$job" | $PY -c 'import json, sys; print(json.dumps(json.load(sys.stdin).get("throughput", {})))'
}

# PyTorch DDP at `world` ranks: its samples/s (empty if it failed).
run_torch() {  # model world
  local model=$1 world=$2 port r pids=() ok=1
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < world; r++)); do
    LD_LIBRARY_PATH=$TORCH_BLAS_DIR OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      WORLD_SIZE=$world RANK=$r $PY "$ROOT/bench/torch_peer.py" --model "$model" --world "$world" \
      --steps "$(steps_of "$model")" --batch "$(batch_of "$model")" --data "$DATA_DIR" \
      >"$RUN/torch-$model-w$world-rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || ok=0; done
  [[ $ok == 1 ]] || { tail -3 "$RUN/torch-$model-w$world-rank0.log" >&2; return; }
  grep -m1 '^RESULT ' "$RUN/torch-$model-w$world-rank0.log" | cut -d' ' -f2- |
    $PY -c 'import json, sys; print("%.1f" % json.load(sys.stdin)["samples_per_s"])'
}

field() { $PY -c 'import json, sys; v = json.loads(sys.argv[1]).get(sys.argv[2], 0); print("%.*f" % (int(sys.argv[3]), float(v)))' "$@"; }

printf '%-9s %12s %12s %8s %12s %12s %8s %10s\n' model "aidn 1r/s" "aidn 2r/s" "aidn eff" \
  "torch 1r/s" "torch 2r/s" "torch eff" "aidn/torch"
for model in "${MODEL_LIST[@]}"; do
  one=$(run_aidn "$model" 1)
  two=$(run_aidn "$model" 2)
  a1=$(field "$one" samples_per_second 1)
  a2=$(field "$two" samples_per_second 1)
  eff=$(field "$two" scaling_efficiency 2)
  t1="-" t2="-" teff="-" ratio="-"
  if [[ $model != gpt ]]; then
    t1=$(run_torch "$model" 1)
    t2=$(run_torch "$model" 2)
    if [[ -n $t1 && -n $t2 ]]; then
      teff=$($PY -c "print('%.2f' % ($t2 / (2 * $t1)))")
      ratio=$($PY -c "print('%.2f' % ($a2 / $t2))")
    fi
  fi
  printf '%-9s %12s %12s %8s %12s %12s %8s %10s\n' "$model" "$a1" "$a2" "$eff" "${t1:--}" \
    "${t2:--}" "$teff" "$ratio"
  if [[ $model == gpt ]]; then
    echo "          gpt tokens/s: $(field "$one" tokens_per_second 0) at 1 rank, $(field "$two" tokens_per_second 0) at 2"
  fi
done
echo "(samples/s summed over the ranks; efficiency = 2-rank / (2 x 1-rank); aidn/torch at 2 ranks)"
