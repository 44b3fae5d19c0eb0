#!/usr/bin/env bash
# Sets up, builds, starts a coordinator and two workers on localhost, submits
# the Fashion-MNIST MLP (2 ranks, DDP over Gloo), shows its progress to the
# end and the test accuracy it reached.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
echo "==> building (first time: a few minutes)"
./scripts/build.sh aidn-coordinator aidn-worker aidnctl >/dev/null
BIN=build
JOB_FILE=${1:-examples/fashion-mnist-mlp.yaml}

DEMO=$(mktemp -d /tmp/aidn-demo.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "==> logs and state kept in $DEMO"
}
trap cleanup EXIT

echo "==> starting aidn-coordinator (log: $DEMO/coordinator.log)"
"$BIN/coordinator/aidn-coordinator" --listen=127.0.0.1:0 --state-dir="$DEMO/state" \
  --addr-file="$DEMO/addr" >"$DEMO/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 200); do [ -s "$DEMO/addr" ] && break; sleep 0.1; done
[ -s "$DEMO/addr" ] || { echo "coordinator did not start"; cat "$DEMO/coordinator.log"; exit 1; }
export AIDN_ADDR; AIDN_ADDR=$(cat "$DEMO/addr")
export AIDN_TOKEN; AIDN_TOKEN=$(cat "$DEMO/state/admin.token")

for w in w1 w2; do
  echo "==> starting aidn-worker $w, 1 CPU slot (log: $DEMO/$w/worker.log)"
  mkdir -p "$DEMO/$w"
  "$BIN/worker/aidn-worker" --coordinator="$AIDN_ADDR" --token-file="$DEMO/state/worker.token" \
    --worker-id="$w" --cpu-slots=1 --work-dir="$DEMO/$w" >"$DEMO/$w/worker.log" 2>&1 &
  PIDS+=($!)
done

ctl() { "$BIN/aidnctl/aidnctl" "$@"; }
for _ in $(seq 1 100); do
  [ "$(ctl workers | grep -c ALIVE || true)" -ge 2 ] && break
  sleep 0.1
done
echo; echo "\$ aidnctl workers"; ctl workers
echo; echo "\$ aidnctl submit -f $JOB_FILE"
JOB=$(ctl submit -f "$JOB_FILE" | awk '{print $2}')
echo "submitted $JOB"

state() { ctl describe "$JOB" | sed -n 's/^State: *//p'; }
echo; echo "==> training (rank 0's progress lines)"
shown=0
while true; do
  s=$(state)
  log=$(ls "$DEMO"/w*/logs/"$JOB"/gen-*/rank-0.log 2>/dev/null | tail -1 || true)
  if [ -n "$log" ]; then
    total=$(grep -c -E '^(step|epoch) ' "$log" || true)
    if [ "$total" -gt "$shown" ]; then
      grep -E '^(step|epoch) ' "$log" | tail -n +"$((shown + 1))"
      shown=$total
    fi
  fi
  case "$s" in SUCCEEDED|FAILED|CANCELLED) break ;; esac
  sleep 0.5
done

echo; echo "\$ aidnctl list"; ctl list
echo; echo "\$ aidnctl events $JOB"; ctl events "$JOB"
accuracy=$(grep -E '^epoch ' "$log" | tail -1 | sed -n 's/.*test accuracy \([0-9.]*\).*/\1/p')
echo
if [ "$s" = SUCCEEDED ]; then
  echo "==> $JOB SUCCEEDED: final test accuracy $accuracy"
else
  echo "==> $JOB ended $s: $(ctl describe "$JOB" | sed -n 's/^Message: *//p')"
  exit 1
fi
