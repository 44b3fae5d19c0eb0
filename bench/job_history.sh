#!/usr/bin/env bash
# A coordinator that has run many short jobs: builds and runs job_history
# (bench/job_history.cc) twice against a real aidn-coordinator, once with
# finished jobs kept in memory for the whole run (--job-retention=1000h: how
# every job was kept before the retention existed) and once with
# --job-retention=10s, and prints resident memory and list latency side by
# side at the end.
#
#   bench/job_history.sh                 # 100,000 jobs per run
#   JOBS=20000 bench/job_history.sh      # a quicker look
#
# AIDN_BUILD names the build directory (default build/; it must be
# configured with -DAIDN_BUILD_TESTS=ON -DAIDN_BUILD_BENCHMARKS=ON).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
JOBS=${JOBS:-100000}

ninja -C "$BUILD" job_history aidn-coordinator >/dev/null
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"
OUT=$(mktemp -d /tmp/job-history.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
"$BUILD/bench/job_history" --jobs="$JOBS" --job_retention=1000h --label=kept | tee "$OUT/kept"
"$BUILD/bench/job_history" --jobs="$JOBS" --job_retention=10s --label=retained | tee "$OUT/retained"

# The last line of each run, side by side.
python3 - "$OUT/kept" "$OUT/retained" "$JOBS" <<'PY'
import sys
def last(path):
    return [l.split() for l in open(path) if l.strip()][-1]
kept, retained = last(sys.argv[1]), last(sys.argv[2])
rows = (("coordinator RSS (MiB)", lambda f: float(f[f.index("rss") + 1])),
        ("jobs in memory", lambda f: float(f[f.index("memory") + 1])),
        ("ListJobs, page of 100 (ms, median)", lambda f: float(f[f.index("list") + 1])),
        ("GetJob of the first job (ms, median)", lambda f: float(f[f.index("get") + 1])),
        ("jobs/s over the last tenth", lambda f: float(f[-2])))
print(f"after {sys.argv[3]} jobs:")
for name, get in rows:
    a, b = get(kept), get(retained)
    print(f"  {name:38s} kept {a:10.2f}   retained {b:10.2f}   kept/retained {a / b if b else float('inf'):6.2f}")
PY
