#!/usr/bin/env bash
# Pipeline parallelism on the CPU (bench/pipeline_step.cc): a GPT cut into
# STAGES stages, threads of one process over shared memory, GPipe against
# 1F1B at 1, 4 and 8 micro-batches, beside one rank accumulating the same
# micro-batches. Prints the measured bubble (the stages' idle share)
# against the ideal (P - 1) / (m + P - 1), the forwards each stage ran
# again, and the activations each stage kept (the inputs of the
# micro-batches in flight: m under GPipe, P - s under 1F1B).
#
#   bench/pipeline.sh        # CONFIG=gpt-mini STAGES=2: about a minute
#   TENSOR=2 bench/pipeline.sh   # the GPT over 2 tensor-parallel ranks instead:
#                                # its step against one rank's, and its
#                                # communication share
#
# Needs build-bench/bench/pipeline_step (AIDN_BUILD_BENCHMARKS=ON):
#   AIDN_BUILD_DIR=build-bench AIDN_CMAKE_ARGS=-DAIDN_BUILD_BENCHMARKS=ON scripts/build.sh pipeline_step
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build-bench}
STEP=$BUILD/bench/pipeline_step
[[ -x $STEP ]] || { echo "build it: AIDN_BUILD_DIR=build-bench AIDN_CMAKE_ARGS=-DAIDN_BUILD_BENCHMARKS=ON scripts/build.sh pipeline_step" >&2; exit 1; }
exec "$STEP" --config "${CONFIG:-gpt-mini}" --stages "${STAGES:-2}" --micro "${MICRO:-1,4,8}" \
  --batch "${BATCH:-4}" --seq "${SEQ:-128}" --steps "${STEPS:-6}" --warmup 2 \
  --checkpointing "${CHECKPOINTING:-0}" --tensor "${TENSOR:-1}"
