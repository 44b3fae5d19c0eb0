#!/usr/bin/env bash
# Command jobs against the same PyTorch ranks launched by hand (MASTER_ADDR,
# MASTER_PORT, RANK, WORLD_SIZE set per process, as under Slurm):
#  1. start-up: `aidnctl submit` -> first optimizer step of a 2-rank gloo
#     program (bench/torch_peer.py, MLP), against launch -> first step by
#     hand; the difference is what aidn adds (placement, the agents'
#     rendezvous, the store, fork/exec, nothing else);
#  2. throughput: examples/pytorch-ddp/train.py (2 ranks, CNN) under aidn
#     and by hand: the median samples/s of its log intervals after the first.
# Interleaved (odd repetitions aidn first, even ones by hand first), REPS
# times each; prints every sample, the medians and ratios.
#
#   bench/commands.sh      # REPS=5: a few minutes; KEEP_RUN_DIR=1 keeps the logs
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
REPS=${REPS:-5}
STEPS=${STEPS:-300}
PY=/usr/bin/python3
RUN_DIR=$(mktemp -d /tmp/aidn-commands.XXXXXX)
chmod 755 "$RUN_DIR"
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
USER_FLAG=()
[[ $(id -u) == 0 ]] && USER_FLAG=(--command-user=nobody)
"$BUILD/coordinator/aidn-coordinator" --listen=127.0.0.1:0 --state-dir="$STATE" \
  --addr-file="$RUN_DIR/addr" --metrics-addr= >"$RUN_DIR/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s $RUN_DIR/addr ]] && break; sleep 0.1; done
export AIDN_ADDR; AIDN_ADDR=$(cat "$RUN_DIR/addr")
export AIDN_TOKEN; AIDN_TOKEN=$(cat "$STATE/admin.token")
for w in 1 2; do
  "$BUILD/worker/aidn-worker" --coordinator="$AIDN_ADDR" --token-file="$STATE/worker.token" \
    --worker-id="w$w" --cpu-slots=1 --work-dir="$RUN_DIR/w$w" --metrics-addr= "${USER_FLAG[@]}" \
    >"$RUN_DIR/worker-w$w.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 100); do
  [[ $("$AIDNCTL" -o json workers 2>/dev/null | grep -c '"state": "ALIVE"' || true) -ge 2 ]] && break
  sleep 0.1
done

PEER_ARGS=(--model mlp --world 2 --steps 20)
TRAIN_ARGS=(--max-steps "$STEPS" --seed 1 --log-every 50 --threads 1)
yaml_list() { local out="" a; for a in "$@"; do out+="\"$a\", "; done; echo "[${out%, }]"; }
cat >"$RUN_DIR/startup.yaml" <<YAML
name: command-startup
world_size: 2
command: {argv: $(yaml_list "$PY" "$ROOT/bench/torch_peer.py" "${PEER_ARGS[@]}")}
YAML
cat >"$RUN_DIR/train.yaml" <<YAML
name: command-train
world_size: 2
command: {argv: $(yaml_list "$PY" "$ROOT/examples/pytorch-ddp/train.py" "${TRAIN_ARGS[@]}")}
YAML

# Submits a spec and waits for the job's end; prints the job id.
submit_and_wait() {
  local job
  job=$("$AIDNCTL" -o json submit -f "$1" | sed -n 's/.*"id": "\(job-[0-9]*\)".*/\1/p' | head -1)
  for _ in $(seq 3000); do
    "$AIDNCTL" describe "$job" | grep -q -E 'SUCCEEDED|FAILED|CANCELLED' && break
    sleep 0.1
  done
  echo "$job"
}
# Rank 0's output of a job (on whichever worker ran it).
rank0_log() { cat "$RUN_DIR"/w*/logs/"$1"/gen-1/rank-0.log 2>/dev/null; }
first_step() {  # start time, output file
  python3 -c 'import json, sys
r = json.loads(open(sys.argv[2]).read().split("RESULT ", 1)[1].splitlines()[0])
print("%.3f" % (r["first_step_unix"] - float(sys.argv[1])))' "$1" "$2"
}
samples_per_s() {  # output file: median of the log intervals after the first
  python3 -c 'import re, statistics, sys
v = [float(x) for x in re.findall(r"\| ([0-9.]+) samples/s", open(sys.argv[1]).read())][1:]
print("%.0f" % statistics.median(v))' "$1"
}
by_hand() {  # output file, program args...
  local out=$1 port; shift
  local ranks=()
  port=$((29500 + RANDOM % 1000))
  for rank in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 OMP_NUM_THREADS=1 \
      PYTHONUNBUFFERED=1 "$PY" "$@" >"$out.$rank" 2>&1 &
    ranks+=($!)
  done
  wait "${ranks[@]}"
}

SA=(); SH=(); TA=(); TH=()
aidn_startup() {
  local t0 job; t0=$(date +%s.%N); job=$(submit_and_wait "$RUN_DIR/startup.yaml")
  rank0_log "$job" >"$RUN_DIR/startup-aidn.$rep"; sa=$(first_step "$t0" "$RUN_DIR/startup-aidn.$rep")
}
hand_startup() {
  local t0; t0=$(date +%s.%N)
  by_hand "$RUN_DIR/startup-hand.$rep" "$ROOT/bench/torch_peer.py" "${PEER_ARGS[@]}"
  sh=$(first_step "$t0" "$RUN_DIR/startup-hand.$rep.0")
}
aidn_train() {
  local job; job=$(submit_and_wait "$RUN_DIR/train.yaml")
  rank0_log "$job" >"$RUN_DIR/train-aidn.$rep"; ta=$(samples_per_s "$RUN_DIR/train-aidn.$rep")
}
hand_train() {
  by_hand "$RUN_DIR/train-hand.$rep" "$ROOT/examples/pytorch-ddp/train.py" "${TRAIN_ARGS[@]}"
  th=$(samples_per_s "$RUN_DIR/train-hand.$rep.0")
}
for rep in $(seq 1 "$REPS"); do
  # Odd repetitions run aidn first, even ones by hand first.
  if (( rep % 2 )); then aidn_startup; hand_startup; aidn_train; hand_train
  else hand_startup; aidn_startup; hand_train; aidn_train; fi
  SA+=("$sa"); SH+=("$sh"); TA+=("$ta"); TH+=("$th")
  echo "rep $rep: submit->first step aidn ${sa}s, by hand ${sh}s; train.py aidn ${ta} samples/s, by hand ${th} samples/s"
done
python3 - "${SA[*]}" "${SH[*]}" "${TA[*]}" "${TH[*]}" <<'PY'
import statistics, sys
sa, sh, ta, th = ([float(x) for x in arg.split()] for arg in sys.argv[1:5])
ma, mh = statistics.median(sa), statistics.median(sh)
print(f"start-up median: aidn {ma:.3f} s, by hand {mh:.3f} s, aidn adds {1000 * (ma - mh):.0f} ms")
ta_m, th_m = statistics.median(ta), statistics.median(th)
print(f"throughput median: aidn {ta_m:.0f} samples/s, by hand {th_m:.0f} samples/s, "
      f"aidn/by hand {ta_m / th_m:.3f}x")
PY
