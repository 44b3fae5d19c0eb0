# Sourced by the benchmarks that run real aidn jobs: a coordinator and one
# worker with SLOTS CPU slots on loopback, in a fresh RUN directory (kept
# with KEEP=1), both stopped on exit. Needs BUILD set; exports AIDN_ADDR
# and AIDN_TOKEN, sets AIDNCTL, waits until the worker is ALIVE, and
# defines run_job (below).
#   SLOTS=2 source "$ROOT/bench/local_cluster.sh" aidn-name
AIDNCTL=$BUILD/aidnctl/aidnctl
for bin in "$BUILD/coordinator/aidn-coordinator" "$BUILD/worker/aidn-worker" "$AIDNCTL"; do
  [[ -x $bin ]] || { echo "missing $bin (scripts/build.sh aidn-coordinator aidn-worker aidnctl)" >&2; exit 1; }
done
RUN=$(mktemp -d "/tmp/${1:-aidn-bench}.XXXXXX")
PIDS=()
cleanup() {
  for pid in "${PIDS[@]:1}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:1}"; do wait "$pid" 2>/dev/null || true; done
  [[ ${#PIDS[@]} -gt 0 ]] && { kill "${PIDS[0]}" 2>/dev/null || true; wait "${PIDS[0]}" 2>/dev/null || true; }
  [[ ${KEEP:-0} == 1 ]] || rm -rf "$RUN"
}
trap cleanup EXIT

env -u LD_LIBRARY_PATH "$BUILD/coordinator/aidn-coordinator" --listen=127.0.0.1:0 \
  --state-dir="$RUN/state" --addr-file="$RUN/addr" >"$RUN/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s $RUN/addr && -s $RUN/state/admin.token ]] && break; sleep 0.1; done
export AIDN_ADDR AIDN_TOKEN
AIDN_ADDR=$(cat "$RUN/addr")
AIDN_TOKEN=$(cat "$RUN/state/admin.token")
# TLS: the worker and aidnctl verify the coordinator with the CA it made.
export AIDN_TLS_CA=$RUN/state/tls/ca.pem
env -u LD_LIBRARY_PATH "$BUILD/worker/aidn-worker" --coordinator="$AIDN_ADDR" \
  --token-file="$RUN/state/worker.token" --worker-id=w1 --cpu-slots="${SLOTS:-2}" \
  --work-dir="$RUN/w1" >"$RUN/worker.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do "$AIDNCTL" workers 2>/dev/null | grep -q ALIVE && break; sleep 0.1; done

# Submits the spec file $1 and waits (up to an hour) for the job to end;
# prints "JOB STATE".
run_job() {
  local job state=""
  job=$("$AIDNCTL" -o json submit -f "$1" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4)
  for _ in $(seq 7200); do
    state=$("$AIDNCTL" -o json describe "$job" | grep -m1 -o '"state": "[A-Z_]*"' | cut -d'"' -f4)
    case $state in SUCCEEDED | FAILED | CANCELLED) break ;; esac
    sleep 0.5
  done
  echo "$job $state"
}
