#!/usr/bin/env bash
# Chaos against a real cluster: builds and runs bench/chaos.cc, which for
# MINUTES keeps jobs of every kind coming (MLP and CNN under DDP, a GPT under
# ZeRO-1 and FSDP, a torch.distributed command job, a command that fails by
# design) while trainers, workers and the coordinator are SIGKILLed, a
# worker's network link (a network namespace; needs root) is cut and mended,
# and jobs are cancelled, at random. Then it waits for every job and checks
# outcomes, step metrics, checkpoints, leftovers and the daemons' descriptors
# (see the top of chaos.cc); it exits non-zero when a check fails.
#
#   bench/chaos.sh                   # 10 minutes of faults
#   MINUTES=60 SEED=7 bench/chaos.sh
#   bench/chaos.sh --keep            # extra flags go to chaos (--in_flight, --fault_every_s)
#
# AIDN_BUILD names the build directory (default build/; it must be
# configured with -DAIDN_BUILD_TESTS=ON -DAIDN_BUILD_BENCHMARKS=ON).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}

ninja -C "$BUILD" chaos aidn-coordinator aidn-worker aidnctl >/dev/null
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"
LOG=$(mktemp /tmp/aidn-chaos-log.XXXXXX)
trap 'rm -f "$LOG"' EXIT
# The daemons' own log lines go to the log file; the bench's lines to the terminal.
if "$BUILD/bench/chaos" --minutes="${MINUTES:-10}" --seed="${SEED:-1}" "$@" >"$LOG" 2>&1; then
  status=0
else
  status=$?
fi
grep -v '^[0-9]\{4\}-[0-9][0-9]-' "$LOG" || true
exit $status
