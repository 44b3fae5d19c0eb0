#!/usr/bin/env bash
# Rendezvous of N c10d store clients: aidn's store against PyTorch's own
# TCPStore server (bench/store/rendezvous.cc). Usage:
#   bench/store/rendezvous.sh [clients] [reps]     (default 1000 5)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${AIDN_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAIDN_BUILD_BENCHMARKS=ON \
  ${AIDN_CMAKE_ARGS:-} >/dev/null
ninja -C "$BUILD_DIR" store_rendezvous >/dev/null
exec "$BUILD_DIR/bench/store_rendezvous" --clients "${1:-1000}" --reps "${2:-5}" \
  --torch_master bench/store/torch_master.py
