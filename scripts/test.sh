#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite through
# ctest. GPU tests skip themselves on machines without a GPU.
#   AIDN_SANITIZE=1 ./scripts/test.sh   the same under ASan + UBSan (build-asan/),
#       less the tests labelled long: each long scenario runs in the plain
#       pass, and the code it drives runs under ASan in shorter tests; run
#       them too with: AIDN_SANITIZE=1 ./scripts/test.sh -L long
# Arguments go to ctest (-R NAME, -L LABEL, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/build.sh
if [ "${AIDN_SANITIZE:-0}" = 1 ]; then
  BUILD_DIR=${AIDN_BUILD_DIR:-build-asan}
  # Every process the tests start inherits it (tests/lsan.supp says why).
  export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
else
  BUILD_DIR=${AIDN_BUILD_DIR:-build}
fi

args=("$@")
if [ "${AIDN_SANITIZE:-0}" = 1 ] && [ "${#args[@]}" -eq 0 ]; then args=(-LE long); fi
jobs=$(nproc)
[ "$jobs" -gt 4 ] && jobs=4
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$jobs" "${args[@]}"
