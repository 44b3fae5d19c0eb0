#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: safetensors, checkpoint manifests,
# IDX files, text corpora, the c10d store protocol, job specs, the
# coordinator's gRPC services, the web UI's API) with clang,
# ASan and UBSan in build-fuzz/, and runs each for SECONDS (default 30) from
# its seed corpus, as many at once as there are cores. Fails on any crash,
# sanitizer report, leak or timeout; prints each target's executions.
#   ./scripts/fuzz.sh          # 30 s a target (what CI runs)
#   ./scripts/fuzz.sh 3600     # a long run; new inputs stay in build-fuzz/corpus/
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/parallel.sh
. scripts/parallel.sh
SECONDS_EACH=${1:-30}
BUILD=${AIDN_FUZZ_BUILD_DIR:-build-fuzz}

./scripts/setup.sh
# The whole tree is configured (the spec target links aidnctl's parser and
# the coordinator's validation); only the targets are built.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DAIDN_ENABLE_CUDA=OFF \
  -DAIDN_ENGINE_ONLY=OFF -DAIDN_BUILD_TESTS=OFF -DAIDN_SANITIZE=ON -DAIDN_FUZZ=ON >/dev/null
targets=(safetensors manifest idx text c10d spec grpc web)
# Ninja writes compiler errors to stdout: kept in a log, shown on failure.
if ! ninja -C "$BUILD" "${targets[@]/%/_fuzz}" >"$BUILD/build.log" 2>&1; then
  echo "fuzz: building the targets failed; the end of $BUILD/build.log:" >&2
  tail -60 "$BUILD/build.log" >&2
  exit 1
fi

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target: its status line on stdout, or on failure the end of its log on
# stderr (and a non-zero status).
fuzz_one() {
  local t=$1
  local corpus=$BUILD/corpus/$t
  mkdir -p "$corpus" "$BUILD/crashes/$t"
  local log=$BUILD/$t.log
  if "$BUILD/tests/fuzz/${t}_fuzz" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -artifact_prefix="$BUILD/crashes/$t/" -print_final_stats=1 \
      "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    local runs
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "fuzz $t: ${SECONDS_EACH}s, $runs executions, no failures"
  else
    echo "fuzz $t: FAILED (input in $BUILD/crashes/$t/); the end of $log:" >&2
    tail -40 "$log" >&2
    return 1
  fi
}
# Each target is one process on one core: as many at once as there are
# cores (at most 4), each still for its full SECONDS.
each_in_parallel fuzz_one "${targets[@]}"
