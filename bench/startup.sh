#!/usr/bin/env bash
# Start-up latency: time from `aidnctl submit` to the first completed
# training step of a 2-rank MLP job on idle workers, beside the time from
# launching two PyTorch DDP ranks (bench/torch_peer.py, gloo) to their first
# step. Interleaved, REPS times each; prints every sample, the medians and
# the ratio.
#
#   bench/startup.sh        # REPS=5: about a minute; KEEP_RUN_DIR=1 keeps the logs
#
# aidn's first step ends when the last rank's record of step 1 was made (the
# `time` of step 1 in `aidnctl metrics -o csv`); the clock starts just before
# aidnctl runs, so aidnctl's own start-up counts. torch's ends at rank 0's
# first optimizer step (ranks are lock-stepped by the allreduce).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
REPS=${REPS:-5}
RUN_DIR=$(mktemp -d /tmp/aidn-startup.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]:1}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:1}"; do wait "$pid" 2>/dev/null || true; done
  [[ ${#PIDS[@]} -gt 0 ]] && { kill "${PIDS[0]}" 2>/dev/null || true; wait "${PIDS[0]}" 2>/dev/null || true; }
  if [[ ${KEEP_RUN_DIR:-0} == 1 ]]; then echo "run directory kept: $RUN_DIR"; else rm -rf "$RUN_DIR"; fi
}
trap cleanup EXIT
AIDNCTL=$BUILD/aidnctl/aidnctl
STATE=$RUN_DIR/state
"$BUILD/coordinator/aidn-coordinator" --listen=127.0.0.1:0 --state-dir="$STATE" \
  --addr-file="$RUN_DIR/addr" --metrics-addr= >"$RUN_DIR/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s $RUN_DIR/addr ]] && break; sleep 0.1; done
export AIDN_ADDR; AIDN_ADDR=$(cat "$RUN_DIR/addr")
export AIDN_TOKEN; AIDN_TOKEN=$(cat "$STATE/admin.token")
# TLS: the worker and aidnctl verify the coordinator with the CA it made.
export AIDN_TLS_CA=$STATE/tls/ca.pem
for w in 1 2; do
  "$BUILD/worker/aidn-worker" --coordinator="$AIDN_ADDR" --token-file="$STATE/worker.token" \
    --worker-id="w$w" --cpu-slots=1 --work-dir="$RUN_DIR/w$w" --metrics-addr= \
    >"$RUN_DIR/worker-w$w.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 100); do
  [[ $("$AIDNCTL" -o json workers 2>/dev/null | grep -c '"state": "ALIVE"' || true) -ge 2 ]] && break
  sleep 0.1
done
cat >"$RUN_DIR/job.yaml" <<YAML
name: startup
world_size: 2
model: {name: mlp, hidden_sizes: [256, 256]}
dataset: {kind: fashion-mnist, dir: /usr/share/datasets/fashion-mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
batch_size: 64
max_steps: 20
seed: 1
YAML

aidn_once() {
  local t0 job t1
  t0=$(date +%s.%N)
  job=$("$AIDNCTL" -o json submit -f "$RUN_DIR/job.yaml" | sed -n 's/.*"id": "\(job-[0-9]*\)".*/\1/p' | head -1)
  for _ in $(seq 600); do
    t1=$("$AIDNCTL" metrics "$job" --from 1 --to 1 -o csv 2>/dev/null | awk -F, '$1 == "TRAIN" { print $16 }')
    [[ -n $t1 ]] && break
    sleep 0.05
  done
  for _ in $(seq 600); do
    "$AIDNCTL" describe "$job" | grep -q -E 'SUCCEEDED|FAILED|CANCELLED' && break
    sleep 0.1
  done
  python3 -c 'import sys, datetime as d
t1 = sys.argv[2].replace("Z", "+00:00")
print(f"{d.datetime.fromisoformat(t1).timestamp() - float(sys.argv[1]):.3f}")' "$t0" "$t1"
}

torch_once() {
  local t0 port
  port=$((29500 + RANDOM % 1000))
  t0=$(date +%s.%N)
  for rank in 0 1; do
    LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 OMP_NUM_THREADS=1 \
      /usr/bin/python3 "$ROOT/bench/torch_peer.py" --model mlp --world 2 --steps 20 \
      >"$RUN_DIR/torch.$rank" 2>"$RUN_DIR/torch.$rank.err" &
  done
  wait %1 %2 2>/dev/null || wait
  python3 -c 'import json, sys
r = json.loads(open(sys.argv[2]).read().split("RESULT ", 1)[1])
print("%.3f" % (r["first_step_unix"] - float(sys.argv[1])))' "$t0" "$RUN_DIR/torch.0"
}

A=(); T=()
for rep in $(seq 1 "$REPS"); do
  a=$(aidn_once); t=$(torch_once)
  A+=("$a"); T+=("$t")
  echo "rep $rep: aidn submit->first step ${a}s, torch launch->first step ${t}s"
done
python3 - "${A[*]}" "${T[*]}" <<'PY'
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
t = [float(x) for x in sys.argv[2].split()]
ma, mt = statistics.median(a), statistics.median(t)
print(f"median: aidn {ma:.3f} s, torch {mt:.3f} s, torch/aidn {mt / ma:.2f}x")
PY
