#!/usr/bin/env bash
# Allreduce of 2 ranks on loopback, 4 KB to 256 MB, nccl-tests style rows for
# aidn's Communicators (aidn-shm: shared memory, what ranks on one host get;
# aidn: Gloo over TCP, what ranks on different hosts get), raw Gloo (all from
# build/bench/allreduce, interleaved in the same processes) and
# torch.distributed's gloo backend (bench/allreduce_torch.py), alternated
# PASSES times in one run; each row is the median over passes. Ends with the
# bus bandwidth ratios aidn/gloo, aidn/torch and aidn-shm/gloo.
#
#   cmake -S . -B build -DAIDN_BUILD_BENCHMARKS=ON && ninja -C build allreduce
#   bench/allreduce.sh              # PASSES=2 MAX_MB=256: about 2 minutes
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
PASSES=${PASSES:-2}
MAX_MB=${MAX_MB:-256}
ROUNDS=${ROUNDS:-3}
OUT=$(mktemp -d /tmp/aidn-allreduce-bench.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

[ -x "$BUILD/bench/allreduce" ] || { echo "build it: ninja -C $BUILD allreduce (AIDN_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
for pass in $(seq 1 "$PASSES"); do
  "$BUILD/bench/allreduce" --max-mb "$MAX_MB" --rounds "$ROUNDS" | tail -n +2 >>"$OUT/rows"
  port=$((29500 + RANDOM % 1000))
  for rank in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 OMP_NUM_THREADS=1 \
      /usr/bin/python3 "$ROOT/bench/allreduce_torch.py" "$MAX_MB" "$ROUNDS" >"$OUT/torch.$rank" 2>"$OUT/torch.$rank.err" &
  done
  wait
  cat "$OUT/torch.0" >>"$OUT/rows"
done
python3 - "$OUT/rows" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 6:
        rows[(int(f[0]), f[2])].append((float(f[3]), float(f[4]), float(f[5])))
sizes = sorted({s for s, _ in rows})
print(f"{'size(B)':>12} {'impl':<8} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
bus = {}
for s in sizes:
    for impl in ("aidn-shm", "aidn", "gloo", "torch"):
        if (s, impl) not in rows:
            continue
        t = statistics.median(r[0] for r in rows[(s, impl)])
        a = statistics.median(r[1] for r in rows[(s, impl)])
        b = statistics.median(r[2] for r in rows[(s, impl)])
        bus[(s, impl)] = b
        print(f"{s:12d} {impl:<8} {t:12.1f} {a:12.3f} {b:12.3f}")
print()
def ratio(s, a, b):
    return bus.get((s, a), 0) / bus[(s, b)] if bus.get((s, b)) else float("nan")
print(f"{'size(B)':>12} {'aidn/gloo':>10} {'aidn/torch':>11} {'aidn-shm/gloo':>14}")
for s in sizes:
    print(f"{s:12d} {ratio(s, 'aidn', 'gloo'):10.3f} {ratio(s, 'aidn', 'torch'):11.3f} "
          f"{ratio(s, 'aidn-shm', 'gloo'):14.3f}")
PY
