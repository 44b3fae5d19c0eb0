#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite through
# ctest. GPU tests skip themselves on machines without a GPU.
#   AIDN_SANITIZE=1 ./scripts/test.sh   the same under ASan + UBSan (build-asan/)
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

jobs=$(nproc)
[ "$jobs" -gt 4 ] && jobs=4
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$jobs" "$@"
