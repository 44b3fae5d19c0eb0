#!/usr/bin/env bash
# Configures and builds aidn. Environment:
#   AIDN_BUILD_DIR   build directory (default: build, or build-asan with AIDN_SANITIZE=1)
#   AIDN_SANITIZE=1  Debug build with AddressSanitizer + UndefinedBehaviorSanitizer
#   AIDN_CMAKE_ARGS  extra arguments for cmake
# Extra arguments are passed to ninja (targets).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${AIDN_SANITIZE:-0}" = 1 ]; then
  BUILD_DIR=${AIDN_BUILD_DIR:-build-asan}
  # No CUDA targets: the plain build compiles them, and without a GPU their
  # tests only skip.
  TYPE_ARGS=(-DCMAKE_BUILD_TYPE=Debug -DAIDN_SANITIZE=ON -DAIDN_ENABLE_CUDA=OFF)
else
  BUILD_DIR=${AIDN_BUILD_DIR:-build}
  TYPE_ARGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
fi
# shellcheck disable=SC2206
EXTRA=(${AIDN_CMAKE_ARGS:-})
cmake -S . -B "$BUILD_DIR" -G Ninja "${TYPE_ARGS[@]}" "${EXTRA[@]}" >/dev/null
ninja -C "$BUILD_DIR" "$@"
