#!/usr/bin/env bash
# Command jobs against the same PyTorch ranks launched by hand (MASTER_ADDR,
# MASTER_PORT, RANK, WORLD_SIZE set per process, as under Slurm):
#  1. start-up: `aidnctl submit` -> first optimizer step of a 2-rank gloo
#     program (bench/torch_peer.py, MLP), against launch -> first step by
#     hand; the difference is what aidn adds (placement, the agents'
#     rendezvous, the store, fork/exec, nothing else). Each sample also says
#     when the ranks' interpreter started, and how long init_process_group
#     took: by hand it is sometimes a second longer, when rank 1 reaches
#     rank 0's MASTER_PORT before rank 0 listens and torch's store client
#     backs off. "aidn adds" is taken against the by-hand runs without that
#     back-off (the most favourable to the by-hand side).
#  2. throughput: examples/pytorch-ddp/train.py (2 ranks, CNN) under aidn
#     and by hand: the median samples/s of its log intervals after the first,
#     and per repetition the ratio of the two runs side by side (this
#     machine's speed drifts over minutes; adjacent runs see the same drift).
# Interleaved (odd repetitions aidn first, even ones by hand first), REPS
# times each; prints every sample, the medians and ratios. The bench waits
# for a job as a user does, with one `aidnctl watch` (a stream, idle until
# the job ends), so that it takes no CPU from the ranks while they run.
#
#   bench/commands.sh      # REPS=8: about 5 minutes; KEEP_RUN_DIR=1 keeps the logs
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
REPS=${REPS:-8}
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
# TLS: the worker and aidnctl verify the coordinator with the CA it made.
export AIDN_TLS_CA=$STATE/tls/ca.pem
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
command: {argv: $(yaml_list "$PY" "$ROOT/bench/rusage.py" "$PY" "$ROOT/examples/pytorch-ddp/train.py" "${TRAIN_ARGS[@]}")}
YAML

# Submits a spec and waits for the job's end (a failed job fails the bench);
# prints the job id.
submit_and_wait() {
  local job
  job=$("$AIDNCTL" -o json submit -f "$1" | sed -n 's/.*"id": "\(job-[0-9]*\)".*/\1/p' | head -1)
  [[ -n $job ]] || { echo "submit of $1 failed" >&2; return 1; }
  "$AIDNCTL" watch "$job" >"$RUN_DIR/watch-$job.log" 2>&1 ||
    { echo "$job did not succeed:" >&2; tail -5 "$RUN_DIR/watch-$job.log" >&2; return 1; }
  echo "$job"
}
# A rank's output (on whichever worker ran it): job id, rank.
rank_log() { cat "$RUN_DIR"/w*/logs/"$1"/gen-1/rank-"$2".log 2>/dev/null; }
# "first step, started, init_process_group" of rank 0's RESULT line: the
# first two in seconds after the start time, the last in seconds.
first_step() {  # start time, output file
  python3 -c 'import json, sys
r = json.loads(open(sys.argv[2]).read().split("RESULT ", 1)[1].splitlines()[0])
t0 = float(sys.argv[1])
print("%.3f %.3f %.3f" % (r["first_step_unix"] - t0, r["started_unix"] - t0, r["init_process_group_s"]))' "$1" "$2"
}
# "samples/s faults": the median samples/s of rank 0's log intervals after
# the first, and the most minor page faults of a rank (bench/rusage.py).
samples_per_s() {  # rank 0's output file, rank 1's
  python3 -c 'import json, re, statistics, sys
v = [float(x) for x in re.findall(r"\| ([0-9.]+) samples/s", open(sys.argv[1]).read())][1:]
faults = max(json.loads(open(f).read().split("RUSAGE ", 1)[1].splitlines()[0])["minor_faults"]
             for f in sys.argv[1:])
print("%.0f %d" % (statistics.median(v), faults))' "$1" "$2"
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
  rank_log "$job" 0 >"$RUN_DIR/startup-aidn.$rep"; sa=$(first_step "$t0" "$RUN_DIR/startup-aidn.$rep")
}
hand_startup() {
  local t0; t0=$(date +%s.%N)
  by_hand "$RUN_DIR/startup-hand.$rep" "$ROOT/bench/torch_peer.py" "${PEER_ARGS[@]}"
  sh=$(first_step "$t0" "$RUN_DIR/startup-hand.$rep.0")
}
aidn_train() {
  local job; job=$(submit_and_wait "$RUN_DIR/train.yaml")
  rank_log "$job" 0 >"$RUN_DIR/train-aidn.$rep.0"; rank_log "$job" 1 >"$RUN_DIR/train-aidn.$rep.1"
  ta=$(samples_per_s "$RUN_DIR/train-aidn.$rep.0" "$RUN_DIR/train-aidn.$rep.1")
}
hand_train() {
  by_hand "$RUN_DIR/train-hand.$rep" "$ROOT/bench/rusage.py" "$PY" \
    "$ROOT/examples/pytorch-ddp/train.py" "${TRAIN_ARGS[@]}"
  th=$(samples_per_s "$RUN_DIR/train-hand.$rep.0" "$RUN_DIR/train-hand.$rep.1")
}
for rep in $(seq 1 "$REPS"); do
  # Odd repetitions run aidn first, even ones by hand first.
  if (( rep % 2 )); then aidn_startup; hand_startup; aidn_train; hand_train
  else hand_startup; aidn_startup; hand_train; aidn_train; fi
  SA+=("${sa// /,}"); SH+=("${sh// /,}"); TA+=("${ta// /,}"); TH+=("${th// /,}")
  read -r sa_first sa_started sa_init <<<"$sa"
  read -r sh_first sh_started sh_init <<<"$sh"
  read -r ta_sps ta_faults <<<"$ta"
  read -r th_sps th_faults <<<"$th"
  echo "rep $rep: submit->first step aidn ${sa_first}s (ranks started at ${sa_started}s," \
    "init_process_group ${sa_init}s), by hand ${sh_first}s (${sh_started}s, ${sh_init}s);" \
    "train.py aidn ${ta_sps} samples/s (${ta_faults} minor faults), by hand ${th_sps} samples/s" \
    "(${th_faults})"
done
"$PY" - "${SA[*]}" "${SH[*]}" "${TA[*]}" "${TH[*]}" <<'PY'
import statistics, sys

import numpy as np
sa, sh = ([[float(v) for v in x.split(",")] for x in arg.split()] for arg in sys.argv[1:3])
ta, th = ([[float(v) for v in x.split(",")] for x in arg.split()] for arg in sys.argv[3:5])
med = statistics.median
# By hand, torch's store client backs off for a second when it comes before
# the server: those runs spend far longer in init_process_group.
fast = [s for s in sh if s[2] < 0.5]
ma, mh = med(s[0] for s in sa), med(s[0] for s in sh)
print(f"start-up median: aidn {ma:.3f} s, by hand {mh:.3f} s "
      f"({len(sh) - len(fast)} of {len(sh)} by-hand runs had torch's store back-off)")
if fast:
    mf = med(s[0] for s in fast)
    print(f"  by hand without the back-off {mf:.3f} s: aidn adds {1000 * (ma - mf):.0f} ms")
print(f"  ranks' interpreter started after: aidn {1000 * med(s[1] for s in sa):.0f} ms, "
      f"by hand {1000 * med(s[1] for s in sh):.0f} ms")
ta_m, th_m = med(t[0] for t in ta), med(t[0] for t in th)
print(f"throughput median: aidn {ta_m:.0f} samples/s, by hand {th_m:.0f} samples/s "
      f"({ta_m / th_m:.3f}x); median of the per-repetition ratios "
      f"{med(a[0] / h[0] for a, h in zip(ta, th)):.3f}x")
# A rank whose allocator gives memory back and faults it in again, step
# after step, runs far slower whoever launched it; which runs do is chance.
# So besides the raw figures: samples/s fitted against the run's page faults
# and the launcher (least squares), and aidn's term as a share of the fitted
# by-hand speed at the fewest faults seen, with its standard error.
fewest = min(t[1] for t in ta + th)
storm = lambda t: t[1] > 1.5 * fewest
print(f"  runs with a page-fault storm (over 1.5x the fewest faults): aidn {sum(map(storm, ta))} "
      f"of {len(ta)}, by hand {sum(map(storm, th))} of {len(th)}")
rows = [(t[0], t[1] / 1e6, 1.0) for t in ta] + [(t[0], t[1] / 1e6, 0.0) for t in th]
X = np.array([[1.0, f, a] for _, f, a in rows])
y = np.array([s for s, _, _ in rows])
coef = np.linalg.lstsq(X, y, rcond=None)[0]
resid = y - X @ coef
se = np.sqrt(np.diag((resid @ resid / (len(y) - 3)) * np.linalg.inv(X.T @ X)))
base = coef[0] + coef[1] * fewest / 1e6
print(f"  at equal page faults: aidn/by hand {1 + coef[2] / base:.3f}x "
      f"(+/- {se[2] / base:.3f}); each million faults costs {-coef[1]:.0f} samples/s")
PY
