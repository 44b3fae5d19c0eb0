#!/usr/bin/env bash
# Training throughput, aidn against PyTorch, measured in the same run,
# interleaved.
#
#   bench/train.sh                  # ~10 minutes on an idle 2-core machine
#   CASES="mlp:2:1:shm mlp:2:1:gloo" REPS=5 bench/train.sh
#
# Cases (model:ranks:threads[:aidn transport]): Fashion-MNIST, batch 64 per
# rank, SGD lr 0.05 momentum 0.9, seed 1, flush-to-zero on both sides:
#   MLP 784-256-256-10 and the small CNN, each on 1 rank x 1 thread,
#   1 rank x 2 threads and 2 ranks x 1 thread (DDP on both sides). For two
#   ranks aidn runs its default transport (auto: shared memory, as both
#   ranks are on this host) and, as a case of its own, Gloo over TCP
#   (`comm_backend: gloo`), the same transport as the PyTorch peer.
#
# aidn: one real coordinator and one real worker with 2 CPU slots on
#   loopback, started once; each measurement is a job submitted with aidnctl.
#   Throughput comes from the job's per-step metrics (`aidnctl metrics -o
#   csv`, the coordinator's combination of the ranks' records): each step
#   carries the wall-clock time its last rank finished it. Throughput = global samples of the steps in
#   the window / wall time of the window, where the window is every step
#   after the first 10 %, and a step interval that crosses an epoch boundary
#   (it holds the test-set evaluation) is left out. The ~20 step lines of
#   rank 0's log give a cross-check (median of the logged step times) and,
#   with the records, the allreduce share of the step.
# torch: bench/torch_peer.py, the same model, optimizer, batch and window,
#   timed by a timestamp after every optimizer step; 2 ranks run as two
#   processes launched directly (torchrun is broken here), DDP/gloo.
#   OpenBLAS (OpenMP build) selected with LD_LIBRARY_PATH; flush-denormal on.
#
# Before every measurement the script waits until /proc/loadavg's 1-minute
# value is below LOAD_MAX (polling up to LOAD_WAIT_S, and at most
# WAIT_BUDGET_S over the whole run); a measurement that started on a busier
# machine is flagged in the output.
#
# Knobs (environment): CASES (see above), REPS (3), MLP_STEPS (600),
# CNN_STEPS (60), LOAD_MAX (1.0), LOAD_WAIT_S (120), WAIT_BUDGET_S (300),
# WARMUP_FRAC (0.1), AIDN_BUILD (<repo>/build), TORCH_BLAS_DIR
# (/usr/lib/x86_64-linux-gnu/openblas-openmp), RUN_DIR (a new /tmp dir),
# KEEP_RUN_DIR (0: delete RUN_DIR at the end unless something failed).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
REPS=${REPS:-3}
MLP_STEPS=${MLP_STEPS:-600}
CNN_STEPS=${CNN_STEPS:-60}
LOAD_MAX=${LOAD_MAX:-1.0}
LOAD_WAIT_S=${LOAD_WAIT_S:-120}
WAIT_BUDGET_S=${WAIT_BUDGET_S:-300}
WARMUP_FRAC=${WARMUP_FRAC:-0.1}
TORCH_BLAS_DIR=${TORCH_BLAS_DIR:-/usr/lib/x86_64-linux-gnu/openblas-openmp}
KEEP_RUN_DIR=${KEEP_RUN_DIR:-0}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-300}
DATA_DIR=/usr/share/datasets/fashion-mnist
BATCH=64
PY=/usr/bin/python3  # the python3 first on PATH has no torch

COORDINATOR=$BUILD/coordinator/aidn-coordinator
WORKER=$BUILD/worker/aidn-worker
AIDNCTL=$BUILD/aidnctl/aidnctl
for bin in "$COORDINATOR" "$WORKER" "$AIDNCTL"; do
  [[ -x $bin ]] || { echo "missing $bin (ninja -C $BUILD aidn-coordinator aidn-worker aidnctl)" >&2; exit 1; }
done
[[ -d $TORCH_BLAS_DIR ]] || { echo "missing $TORCH_BLAS_DIR (libopenblas0-openmp)" >&2; exit 1; }

RUN_DIR=${RUN_DIR:-$(mktemp -d /tmp/aidn-train.XXXXXX)}
mkdir -p "$RUN_DIR/specs" "$RUN_DIR/torch"
RESULTS=$RUN_DIR/results.jsonl
: >"$RESULTS"
FAILURES=0
SCRIPT_START=$SECONDS

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ------------------------------------------------------------------ cluster
# aidn's processes get no LD_LIBRARY_PATH: they use the BLAS they link.
PIDS=()
cleanup() {
  local pid
  for pid in "${TORCH_PIDS[@]:-}"; do [[ -n $pid ]] && kill "$pid" 2>/dev/null || true; done
  # Workers first (they stop their trainers), then the coordinator.
  for pid in "${PIDS[@]:1}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:1}"; do wait "$pid" 2>/dev/null || true; done
  if [[ ${#PIDS[@]} -gt 0 ]]; then
    kill "${PIDS[0]}" 2>/dev/null || true
    wait "${PIDS[0]}" 2>/dev/null || true
  fi
  if [[ $KEEP_RUN_DIR == 1 || $FAILURES -gt 0 ]]; then
    log "run directory kept: $RUN_DIR"
  else
    rm -rf "$RUN_DIR"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

STATE=$RUN_DIR/state
env -u LD_LIBRARY_PATH "$COORDINATOR" --listen=127.0.0.1:0 --state-dir="$STATE" \
  --addr-file="$RUN_DIR/addr" --metrics-addr=127.0.0.1:0 >"$RUN_DIR/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s $RUN_DIR/addr ]] && break; sleep 0.1; done
[[ -s $RUN_DIR/addr && -s $STATE/admin.token ]] || {
  FAILURES=1; echo "coordinator did not start; see $RUN_DIR/coordinator.log" >&2; exit 1; }
AIDN_ADDR=$(cat "$RUN_DIR/addr")
AIDN_TOKEN=$(cat "$STATE/admin.token")
# TLS: the worker and aidnctl verify the coordinator with the CA it made.
export AIDN_TLS_CA=$STATE/tls/ca.pem
export AIDN_ADDR AIDN_TOKEN
# One worker with both CPU slots: it runs a 1-rank x 2-thread job as well
# as both ranks of a 2-rank job.
env -u LD_LIBRARY_PATH "$WORKER" --coordinator="$AIDN_ADDR" --token-file="$STATE/worker.token" \
  --worker-id=w1 --cpu-slots=2 --work-dir="$RUN_DIR/w1" --metrics-addr=127.0.0.1:0 >"$RUN_DIR/worker-w1.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
  alive=$("$AIDNCTL" -o json workers 2>/dev/null | grep -c '"state": "ALIVE"' || true)
  [[ $alive -ge 1 ]] && break
  sleep 0.1
done
[[ $alive -ge 1 ]] || { FAILURES=1; echo "the worker did not register; see $RUN_DIR/worker-w1.log" >&2; exit 1; }
log "coordinator $AIDN_ADDR, worker w1 (2 CPU slots); run dir $RUN_DIR"

# ------------------------------------------------------------- load waiting
WAIT_SPENT=0
LOAD_AT_START=0
LOAD_OK=1
WAITED=0
wait_quiet() {
  local start=$SECONDS load
  while :; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    if awk -v l="$load" -v m="$LOAD_MAX" 'BEGIN { exit !(l < m) }'; then LOAD_OK=1; break; fi
    if (( SECONDS - start >= LOAD_WAIT_S || WAIT_SPENT + SECONDS - start >= WAIT_BUDGET_S )); then
      LOAD_OK=0
      break
    fi
    sleep 2
  done
  WAITED=$((SECONDS - start))
  WAIT_SPENT=$((WAIT_SPENT + WAITED))
  LOAD_AT_START=$load
  if [[ $LOAD_OK == 0 ]]; then
    log "load ${load} still >= ${LOAD_MAX} after ${WAITED}s (wait budget used ${WAIT_SPENT}s): measuring anyway"
  fi
}

# --------------------------------------------------------------------- aidn
# Reads the job's TRAIN steps of its latest generation (`aidnctl metrics -o
# csv` on stdin) and rank 0's log, and prints one JSON line.
AIDN_ANALYSIS=$(cat <<'PY'
import csv, datetime, json, re, statistics, sys
log_path, steps, world, batch, warm_frac = sys.argv[1:6]
steps, world, batch, warm_frac = int(steps), int(world), int(batch), float(warm_frac)

recs = []
for row in csv.DictReader(sys.stdin):
    if row["kind"] != "TRAIN":
        continue
    t = datetime.datetime.fromisoformat(row["time"].replace("Z", "+00:00")).timestamp()
    recs.append(dict(step=int(row["step"]), epoch=int(row["epoch"]), gen=int(row["generation"]),
                     step_s=float(row["step_seconds"]), allreduce_s=float(row["allreduce_seconds"]),
                     time=t))
gen = max(r["gen"] for r in recs)
by_step = {r["step"]: r for r in recs if r["gen"] == gen}
missing = [k for k in range(1, steps + 1) if k not in by_step]
if missing:
    raise SystemExit("%d of %d step records missing" % (len(missing), steps))
warm = min(steps - 1, max(1, round(warm_frac * steps)))
wall, n, dts, step_s, ar_s = 0.0, 0, [], [], []
for k in range(warm + 1, steps + 1):
    a, b = by_step[k - 1], by_step[k]
    step_s.append(b["step_s"]); ar_s.append(b["allreduce_s"])
    if a["epoch"] != b["epoch"]:
        continue  # holds the test-set evaluation after an epoch
    wall += b["time"] - a["time"]; n += 1; dts.append(b["time"] - a["time"])
res = dict(samples_per_s=n * batch * world / wall, window_steps=n, window_s=wall,
           median_step_ms=statistics.median(dts) * 1e3,
           median_samples_per_s=batch * world / statistics.median(dts),
           compute_step_ms=statistics.median(step_s) * 1e3,
           allreduce_ms=statistics.median(ar_s) * 1e3,
           allreduce_share=sum(ar_s) / sum(step_s), generation=gen)
# Cross-check from the log lines: "step N/M | loss L | T ms | S samples/s | allreduce A ms".
logged = []
with open(log_path) as lf:
    for line in lf:
        m = re.match(r"step (\d+)/\d+ \| loss \S+ \| ([\d.]+) ms \| \S+ samples/s \| allreduce ([\d.]+) ms", line)
        if m and int(m.group(1)) > warm:
            logged.append((float(m.group(2)), float(m.group(3))))
if logged:
    med = statistics.median(t for t, _ in logged)
    res["log_lines"] = len(logged)
    res["log_median_samples_per_s"] = batch * world / (med / 1e3)
print(json.dumps(res))
PY
)

run_aidn() {  # model world threads transport steps rep case
  local model=$1 world=$2 threads=$3 transport=$4 steps=$5 rep=$6 case=$7
  local spec=$RUN_DIR/specs/$model-w$world-t$threads-$transport-r$rep.yaml
  cat >"$spec" <<EOF
name: bench-$model-w$world-t$threads-$transport-r$rep
world_size: $world
threads_per_rank: $threads
comm_backend: $transport
device: cpu
strategy: ddp
model:
  name: $model
$([[ $model == mlp ]] && echo "  hidden_sizes: [256, 256]")
dataset:
  kind: fashion-mnist
  dir: $DATA_DIR
optimizer:
  name: sgd
  lr: 0.05
  momentum: 0.9
batch_size: $BATCH
max_steps: $steps
seed: 1
EOF
  wait_quiet
  local job
  job=$("$AIDNCTL" -o json submit -f "$spec" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4) || {
    FAILURES=$((FAILURES + 1))
    echo "aidnctl submit -f $spec failed" >&2
    exit 1
  }
  local deadline=$((SECONDS + JOB_TIMEOUT_S)) state=""
  while :; do
    state=$("$AIDNCTL" -o json describe "$job" | grep -m1 -o '"state": "[A-Z_]*"' | cut -d'"' -f4 || true)
    case $state in SUCCEEDED | FAILED | CANCELLED) break ;; esac
    if ((SECONDS >= deadline)); then
      "$AIDNCTL" cancel "$job" >/dev/null 2>&1 || true
      state="TIMEOUT"
      break
    fi
    sleep 0.5
  done
  local gen rank0_log
  gen=$("$AIDNCTL" -o json describe "$job" | grep -m1 -o '"generation": "[0-9]*"' | cut -d'"' -f4 || true)
  rank0_log=$(ls "$RUN_DIR"/w*/logs/"$job"/gen-"$gen"/rank-0.log 2>/dev/null | head -1 || true)
  local stats=""
  if [[ $state == SUCCEEDED ]]; then
    stats=$("$AIDNCTL" metrics "$job" -o csv |
      $PY -c "$AIDN_ANALYSIS" "$rank0_log" "$steps" "$world" "$BATCH" "$WARMUP_FRAC") || stats=""
  fi
  if [[ -z $stats ]]; then
    FAILURES=$((FAILURES + 1))
    log "aidn $case rep $rep: job $job ended $state; see $rank0_log"
    [[ -n $rank0_log ]] && tail -5 "$rank0_log" >&2
    stats='{}'
  fi
  printf '{"system": "aidn", "case": "%s", "rep": %d, "job": "%s", "state": "%s", "load1": %s, "load_ok": %d, "waited_s": %d, "stats": %s}\n' \
    "$case" "$rep" "$job" "$state" "$LOAD_AT_START" "$LOAD_OK" "$WAITED" "$stats" >>"$RESULTS"
  log "aidn  $case rep $rep: $(extract_rate "$stats") samples/s (job $job, load $LOAD_AT_START)"
}

# -------------------------------------------------------------------- torch
TORCH_PIDS=()
run_torch() {  # model world threads steps rep case
  local model=$1 world=$2 threads=$3 steps=$4 rep=$5 case=$6
  local port r ok=1
  wait_quiet
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  TORCH_PIDS=()
  for ((r = 0; r < world; r++)); do
    LD_LIBRARY_PATH=$TORCH_BLAS_DIR OMP_NUM_THREADS=$threads MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      WORLD_SIZE=$world RANK=$r timeout "$JOB_TIMEOUT_S" $PY "$ROOT/bench/torch_peer.py" \
      --model "$model" --world "$world" --steps "$steps" --threads "$threads" --batch "$BATCH" \
      --lr 0.05 --momentum 0.9 --seed 1 --warmup-frac "$WARMUP_FRAC" --data "$DATA_DIR" \
      >"$RUN_DIR/torch/$model-w$world-t$threads-r$rep-rank$r.log" 2>&1 &
    TORCH_PIDS+=($!)
  done
  for r in "${TORCH_PIDS[@]}"; do wait "$r" || ok=0; done
  TORCH_PIDS=()
  local stats
  stats=$(grep -m1 '^RESULT ' "$RUN_DIR/torch/$model-w$world-t$threads-r$rep-rank0.log" | cut -d' ' -f2- || true)
  if [[ $ok == 0 || -z $stats ]]; then
    FAILURES=$((FAILURES + 1))
    log "torch $case rep $rep failed; see $RUN_DIR/torch/$model-w$world-t$threads-r$rep-rank*.log"
    tail -5 "$RUN_DIR/torch/$model-w$world-t$threads-r$rep-rank0.log" >&2 || true
    stats='{}'
  fi
  printf '{"system": "torch", "case": "%s", "rep": %d, "load1": %s, "load_ok": %d, "waited_s": %d, "stats": %s}\n' \
    "$case" "$rep" "$LOAD_AT_START" "$LOAD_OK" "$WAITED" "$stats" >>"$RESULTS"
  log "torch $case rep $rep: $(extract_rate "$stats") samples/s (load $LOAD_AT_START)"
}

extract_rate() { grep -o '"samples_per_s": [0-9.]*' <<<"$1" | head -1 | awk '{printf "%.0f", $2}'; }

# --------------------------------------------------------------------- runs
read -r -a CASE_LIST <<<"${CASES:-mlp:1:1 mlp:1:2 mlp:2:1 mlp:2:1:gloo cnn:1:1 cnn:1:2 cnn:2:1 cnn:2:1:gloo}"
for ((rep = 1; rep <= REPS; rep++)); do
  declare -A TORCH_DONE=()
  for c in "${CASE_LIST[@]}"; do
    IFS=: read -r model world threads transport <<<"$c"
    transport=${transport:-auto}
    steps=$MLP_STEPS
    [[ $model == cnn ]] && steps=$CNN_STEPS
    peer="$model ${world}r x ${threads}t"
    name=$peer
    [[ $transport != auto ]] && name="$peer $transport"
    # Alternate which side goes first, so a drift in background load does
    # not always favour the same side. The peer runs once per rep and
    # configuration, however many aidn transports are measured against it.
    if ((rep % 2 == 0)) && [[ -z ${TORCH_DONE[$peer]:-} ]]; then
      run_torch "$model" "$world" "$threads" "$steps" "$rep" "$peer"
      TORCH_DONE[$peer]=1
    fi
    run_aidn "$model" "$world" "$threads" "$transport" "$steps" "$rep" "$name"
    if [[ -z ${TORCH_DONE[$peer]:-} ]]; then
      run_torch "$model" "$world" "$threads" "$steps" "$rep" "$peer"
      TORCH_DONE[$peer]=1
    fi
  done
  unset TORCH_DONE
done

# ------------------------------------------------------------------ summary
AIDN_BLAS=$(env -u LD_LIBRARY_PATH ldd "$WORKER" | awk '/blas|lapack|dnnl/ { print $3 }' |
  xargs -r readlink -f | sort -u | paste -sd' ')
$PY - "$RESULTS" "$AIDN_BLAS" "$REPS" "$MLP_STEPS" "$CNN_STEPS" "$WARMUP_FRAC" \
  "$LOAD_MAX" "$((SECONDS - SCRIPT_START))" <<'PY'
import json, statistics, sys
path, aidn_blas, reps, mlp_steps, cnn_steps, warm, load_max, elapsed = sys.argv[1:9]
runs = [json.loads(l) for l in open(path)]
cases = []
for r in runs:
    if r["system"] == "aidn" and r["case"] not in cases:
        cases.append(r["case"])

def peer(case):  # "mlp 2r x 1t gloo" -> "mlp 2r x 1t"
    return " ".join(case.split()[:4])

def rates(system, case, key="samples_per_s"):
    return [r["stats"][key] for r in runs
            if r["system"] == system and r["case"] == case and key in r["stats"]]

def med(xs):
    return statistics.median(xs) if xs else float("nan")

print()
print("Training throughput, global samples/s (median of %s runs; batch 64/rank; MLP %s steps, "
      "CNN %s steps; first %.0f %% of steps left out)" % (reps, mlp_steps, cnn_steps, 100 * float(warm)))
print()
hdr = "%-19s | %14s | %15s | %10s" % ("case", "aidn samples/s", "torch samples/s", "aidn/torch")
print(hdr)
print("-" * len(hdr))
for c in cases:
    a, t = med(rates("aidn", c)), med(rates("torch", peer(c)))
    print("%-19s | %14.0f | %15.0f | %10.2f" % (c, a, t, a / t if t else float("nan")))
print()
# The targets, where this run measured the cases they need.
targets = [("mlp 1r x 1t", None, 1.5), ("cnn 1r x 1t", None, 1.5),
           ("mlp 2r x 1t", None, 2.0), ("cnn 2r x 1t", None, 1.3),
           ("mlp 2r x 1t", "mlp 1r x 2t", 0.9), ("cnn 2r x 1t", "cnn 1r x 2t", 0.9)]
lines = []
for case, own, want in targets:
    a = med(rates("aidn", case))
    if own is None:
        b, what = med(rates("torch", case)), "torch " + case
    else:
        b, what = med(rates("aidn", own)), "aidn " + own
    if a != a or b != b:
        continue
    ratio = a / b
    lines.append("  aidn %-12s / %-18s = %5.2f (target >= %.1f) %s"
                 % (case, what, ratio, want, "PASS" if ratio >= want else "MISS"))
if lines:
    print("Targets:")
    print("\n".join(lines))
    print()
print("Runs (samples/s, in order):")
for c in cases:
    print("  %-19s aidn %s | torch %s" % (
        c, " ".join("%.0f" % x for x in rates("aidn", c)),
        " ".join("%.0f" % x for x in rates("torch", peer(c)))))
print("Cross-checks (medians):")
for c in cases:
    a_med = med(rates("aidn", c, "median_samples_per_s"))
    a_log = med(rates("aidn", c, "log_median_samples_per_s"))
    t_med = med(rates("torch", peer(c), "median_samples_per_s"))
    share = med(rates("aidn", c, "allreduce_share"))
    ar = med(rates("aidn", c, "allreduce_ms"))
    st = med(rates("aidn", c, "compute_step_ms"))
    line = ("  %-19s from the median step: aidn %.0f (log lines: %.0f), torch %.0f"
            % (c, a_med, a_log, t_med))
    if "2r" in c:
        line += "; aidn allreduce %.2f ms of a %.2f ms step (%.0f %%)" % (ar, st, 100 * share)
    print(line)
torch_blas = next((r["stats"].get("blas") for r in runs
                   if r["system"] == "torch" and r["stats"].get("blas")), [])
conv = next((r["stats"].get("conv_backend") for r in runs
             if r["system"] == "torch" and r["stats"].get("conv_backend")), "?")
tver = next((r["stats"].get("torch") for r in runs
             if r["system"] == "torch" and r["stats"].get("torch")), "?")
print()
print("BLAS: aidn   %s (linear: oneDNN's sgemm where every dimension is >= 32 on one thread, else OpenBLAS; im2col conv: OpenBLAS)" % (aidn_blas or "?"))
print("      torch  %s %s (linear); conv backend %s (oneDNN); flush-denormal on"
      % (tver, " ".join(torch_blas) or "?", conv))
busy = [r for r in runs if not r["load_ok"]]
loads = [r["load1"] for r in runs]
print("Load: 1-min loadavg at measurement start %.2f-%.2f; %d of %d measurements started at or "
      "above %s after waiting; script ran %s s"
      % (min(loads), max(loads), len(busy), len(runs), load_max, elapsed))
failed = [r for r in runs if "samples_per_s" not in r["stats"]]
if failed:
    print("FAILED runs: %d (see the log above)" % len(failed))
PY
exit $((FAILURES > 0))
