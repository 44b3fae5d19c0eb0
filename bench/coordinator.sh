#!/usr/bin/env bash
# The coordinator at scale: builds and runs coordinator_load (bench/coordinator/)
# against one real aidn-coordinator. Arguments go to coordinator_load.
#
#   bench/coordinator.sh                          # 10,000 workers, 1,000 ranks, 300 s window
#   bench/coordinator.sh --duration=60s           # a quicker look
#   bench/coordinator.sh --workers=1000 --ranks=100 --rendezvous-world=256 --duration=30s
#
# PERF_SECONDS=20 also records a call-graph profile of the coordinator
# (perf record -g) for that long once the measurement window opens and
# prints its top entries; the data stays in $PERF_DATA
# (default /tmp/coordinator-load.perf.data).
#
# AIDN_BUILD names the build directory (default build/; it must be
# configured with -DAIDN_BUILD_TESTS=ON -DAIDN_BUILD_BENCHMARKS=ON).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
PERF_SECONDS=${PERF_SECONDS:-0}
PERF_DATA=${PERF_DATA:-/tmp/coordinator-load.perf.data}

ninja -C "$BUILD" coordinator_load aidn-coordinator >/dev/null
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"

if [[ $PERF_SECONDS == 0 ]]; then
  exec "$BUILD/bench/coordinator_load" "$@"
fi

# With a profile: follow the output, attach perf once the window opens.
OUT=$(mktemp /tmp/coordinator-load.XXXXXX.out)
"$BUILD/bench/coordinator_load" "$@" >"$OUT" 2>&1 &
BENCH=$!
trap 'kill $BENCH 2>/dev/null || true; rm -f "$OUT"' EXIT
tail -f --pid=$BENCH "$OUT" &
until grep -q "measurement window opened" "$OUT" 2>/dev/null; do
  kill -0 $BENCH 2>/dev/null || { wait $BENCH; exit $?; }
  sleep 1
done
PID=$(sed -n 's/.*aidn-coordinator (pid \([0-9]*\),.*/\1/p' "$OUT" | head -1)
perf record -g -p "$PID" -o "$PERF_DATA" -- sleep "$PERF_SECONDS" >/dev/null 2>&1 || true
wait $BENCH || true
echo
echo "---- perf report (coordinator pid $PID, $PERF_SECONDS s from the window's start; $PERF_DATA)"
perf report -i "$PERF_DATA" --no-children --percent-limit 1 --stdio 2>/dev/null |
  grep -v '^$' | grep -E '^ +[0-9]' | head -40
