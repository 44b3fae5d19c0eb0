#!/usr/bin/env bash
# ThreadSanitizer pass over the unit tests that exercise aidn's own threads:
# the engine and its communicators, the coordinator core (fake clock), the
# worker's supervisor, reporter and c10d store server, the trainer.
#
# Debian's libabsl is not built with -fsanitize=thread, so TSan would not see
# absl::Mutex and reports every access guarded by one as a race. This script
# builds the same Abseil (Debian's source package of the installed version,
# its patches applied) with -fsanitize=thread, once, into a cache outside the
# repository, and runs the tests with that copy first on the library path:
# same SONAMEs, so our code, gRPC and protobuf all use the instrumented one.
#
#   ./scripts/tsan.sh              # build build-tsan/, run the TSan set
#   AIDN_CACHE_DIR=/somewhere ./scripts/tsan.sh
# Logs: build-tsan/tsan-logs/<test>.log. To run one test by hand, put the
# Abseil it prints (lib/) first on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/parallel.sh
. scripts/parallel.sh
./scripts/setup.sh

BUILD=${AIDN_TSAN_BUILD_DIR:-build-tsan}
CACHE=${AIDN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/aidn}
ABSL_VERSION=$(dpkg-query -W -f='${Version}' libabsl-dev)
ABSL=$CACHE/absl-tsan-$ABSL_VERSION

build_absl() {
  local work
  work=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" RETURN
  # deb-src entries for the mirrors this machine already uses, in apt
  # directories of our own (the system's apt state is not touched); apt checks
  # the files against the archive's signed index.
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
  mkdir -p "$work/parts"
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] && sed 's/^Types: *deb$/Types: deb-src/' "$f"
    echo
  done >"$work/parts/src.sources"
  local list=$work/src.list
  if [ -s /etc/apt/sources.list ]; then sed -n 's/^deb /deb-src /p' /etc/apt/sources.list; fi >"$list"
  local apt=(apt-get -qq -o "Dir::Etc::SourceList=$list" -o "Dir::Etc::SourceParts=$work/parts"
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
  echo "tsan.sh: building Abseil $ABSL_VERSION with -fsanitize=thread into $ABSL (once)"
  "${apt[@]}" update
  (cd "$work/src" && "${apt[@]}" source --download-only "abseil=$ABSL_VERSION" >/dev/null)
  dpkg-source --no-check -x "$work"/src/abseil_*.dsc "$work/abseil" >/dev/null
  # Debian's own configuration (debian/rules): C++17, shared libraries with
  # Debian's SONAMEs.
  cmake -S "$work/abseil" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_PREFIX="$ABSL" \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" >/dev/null
  ninja -C "$work/build" install >/dev/null
  touch "$ABSL/.complete"
}
[ -f "$ABSL/.complete" ] || build_absl
ABSL_LIB=$(dirname "$(find "$ABSL" -name 'libabsl_synchronization.so.*' | head -1)")

# The tests, each a binary and an optional gtest filter. Left out: what
# drives gRPC (the server, TLS, aidnctl, reporter and coordinator link tests,
# the integration tests): Debian's gRPC is not instrumented, and the
# absl::Status objects its threads hand over are reported now and then (see
# docs/testing.md). And trainer_stop_signal_test: TSan intercepts sigaction,
# and its check that the default dispositions come back did not hold once.
TESTS=(
  common_test test_support_test
  engine_device_test engine_nn_test engine_train_test engine_comm_test engine_cpu_session_test
  engine_zero_test engine_parallel_test engine_compression_test
  coordinator_spec_test coordinator_store_test coordinator_core_test metrics_test rpc_test
  "trainer_test -ReporterTest.*" "worker_supervisor_test -CoordinatorLinkTest.*"
  worker_c10d_store_test
)

# gcc, as the other builds; no CUDA (nothing here runs a GPU).
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAIDN_TSAN=ON \
  -DAIDN_ENABLE_CUDA=OFF ${AIDN_CMAKE_ARGS:-} >/dev/null
targets=()
for t in "${TESTS[@]}"; do targets+=("${t%% *}"); done
ninja -C "$BUILD" "${targets[@]}" tsan_canary

# The instrumented Abseil comes first for every process the tests start
# (children inherit it). A report fails its test (exit code 66).
export LD_LIBRARY_PATH=$ABSL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp second_deadlock_stack=1 exitcode=66"
# OpenBLAS's worker threads and oneDNN's OpenMP ones are not instrumented:
# they hand results back through their own spin flags, which TSan cannot
# see, so a GEMM split across them reads as a race with its caller (seen on
# CPUs where OpenBLAS picks its Cooper Lake kernels). One thread each: they
# compute in the calling thread, and aidn's own threads are what is checked.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
LOGS=$BUILD/tsan-logs
rm -rf "$LOGS" && mkdir -p "$LOGS"

# First, that this pass can fail at all, and that it sees absl::Mutex.
canary=$BUILD/tests/support/tsan_canary
if "$canary" race >"$LOGS/canary-race.log" 2>&1 || ! grep -q "data race" "$LOGS/canary-race.log"; then
  echo "tsan: an unguarded counter went unreported: TSan is not working here" >&2
  exit 1
fi
if ! "$canary" mutex >"$LOGS/canary-mutex.log" 2>&1; then
  echo "tsan: a race reported under absl::Mutex: is the instrumented Abseil ($ABSL_LIB) used?" >&2
  cat "$LOGS/canary-mutex.log" >&2
  exit 1
fi
echo "tsan canary: a race reported, absl::Mutex seen"
run() {
  local name=${1%% *} filter=${1#* }
  [ "$filter" = "$1" ] && filter=""
  local bin
  bin=$(find "$(cd "$BUILD" && pwd)/tests" -name "$name" -type f -perm -u+x | head -1)
  local start=$SECONDS
  if (cd "$BUILD" && "$bin" ${filter:+--gtest_filter="$filter"}) >"$LOGS/$name.log" 2>&1; then
    echo "tsan $name: passed, no reports ($((SECONDS - start)) s)"
  else
    echo "tsan $name: FAILED ($(grep -c 'WARNING: ThreadSanitizer' "$LOGS/$name.log") reports); the end of $LOGS/$name.log:" >&2
    tail -60 "$LOGS/$name.log" >&2
    return 1
  fi
}
each_in_parallel run "${TESTS[@]}"
