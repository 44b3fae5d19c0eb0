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
  --addr-file="$DEMO/addr" --metrics-addr=127.0.0.1:0 --metrics-addr-file="$DEMO/metrics.addr" \
  --web-addr=127.0.0.1:0 --web-addr-file="$DEMO/web.addr" >"$DEMO/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 200); do [ -s "$DEMO/addr" ] && break; sleep 0.1; done
[ -s "$DEMO/addr" ] || { echo "coordinator did not start"; cat "$DEMO/coordinator.log"; exit 1; }
export AIDN_ADDR; AIDN_ADDR=$(cat "$DEMO/addr")
export AIDN_TOKEN; AIDN_TOKEN=$(cat "$DEMO/state/admin.token")
# TLS by default: the coordinator made a CA in its state directory, and the
# workers and aidnctl verify it with that CA.
export AIDN_TLS_CA=$DEMO/state/tls/ca.pem

for w in w1 w2; do
  echo "==> starting aidn-worker $w, 1 CPU slot (log: $DEMO/$w/worker.log)"
  mkdir -p "$DEMO/$w"
  # One checkpoint root for both, as nodes share checkpoint storage.
  "$BIN/worker/aidn-worker" --coordinator="$AIDN_ADDR" --token-file="$DEMO/state/worker.token" \
    --worker-id="$w" --cpu-slots=1 --work-dir="$DEMO/$w" --metrics-addr=127.0.0.1:0 \
    --checkpoint-root="$DEMO" >"$DEMO/$w/worker.log" 2>&1 &
  PIDS+=($!)
done

ctl() { "$BIN/aidnctl/aidnctl" "$@"; }
for _ in $(seq 1 100); do
  [ "$(ctl workers | grep -c ALIVE || true)" -ge 2 ] && break
  sleep 0.1
done
echo; echo "\$ aidnctl workers"; ctl workers
echo; echo "\$ aidnctl submit --watch -f $JOB_FILE"
set +e
ctl submit --watch -f "$JOB_FILE"
watched=$?
set -e
JOB=$(ctl -o json list | sed -n 's/.*"id": "\(job-[0-9]*\)".*/\1/p' | head -1)

echo; echo "\$ aidnctl list"; ctl list
echo; echo "\$ aidnctl events $JOB"; ctl events "$JOB"
echo; echo "\$ aidnctl metrics $JOB --from 1 --to 5"; ctl metrics "$JOB" --from 1 --to 5
echo; echo "\$ aidnctl plot $JOB -o $DEMO/loss.png"; ctl plot "$JOB" -o "$DEMO/loss.png"
echo; echo "\$ aidnctl checkpoints $JOB"; ctl checkpoints "$JOB"
echo; echo "\$ aidnctl export $JOB -o $DEMO/model.safetensors"
ctl export "$JOB" -o "$DEMO/model.safetensors" --force || true
echo; echo "==> Prometheus metrics of the coordinator: http://$(cat "$DEMO/metrics.addr")/metrics"
curl_metrics() {
  python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
    "http://$(cat "$DEMO/metrics.addr")/metrics"
}
curl_metrics | grep -E "^aidn_job_(step|loss|test_accuracy|samples_per_second)\{" || true
echo; echo "==> the web UI: http://$(cat "$DEMO/web.addr")/#/jobs/$JOB (its token: the admin"
echo "    token in $DEMO/state/admin.token; AIDN_DEMO_HOLD=1 keeps the cluster up for it)"
accuracy=$(ctl metrics "$JOB" -o csv | awk -F, '$1 == "EVAL" { a = $13 } END { print a }')
echo
if [ -n "${AIDN_DEMO_HOLD:-}" ]; then read -r -p "==> press Enter to stop the cluster " _; fi
if [ "$watched" -eq 0 ]; then
  echo "==> $JOB SUCCEEDED: final test accuracy $accuracy"
else
  echo "==> $JOB did not succeed: $(ctl describe "$JOB" | sed -n 's/^Message: *//p')"
  exit 1
fi
