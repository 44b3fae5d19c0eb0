#!/usr/bin/env bash
# The GPU tests and the GPU step benchmark on a GPU machine that has CUDA,
# PyTorch and a driver but none of our build's libraries (no Abseil, GoogleTest,
# OpenBLAS or oneDNN, and no apt to install them): build here, run there.
#
#   scripts/gpu_device.sh pack     # here: engine-only build for sm_90 into
#                                  # build-gpu/, then .devcarry/carry.tar.xz =
#                                  # the GPU test binaries, gpu_step, gpu_gpt_step
#                                  # and the non-CUDA shared libraries they load
#   scripts/gpu_device.sh run      # there, from the repo root with .devcarry/
#                                  # carried: every GPU test, then bench/gpu_step.sh
#                                  # and bench/gpu_gpt.sh
#   scripts/gpu_device.sh pack-service   # here: the service binaries from build/
#                                  # (coordinator, aidn-worker-gpu, aidnctl), the
#                                  # GPU job test, their libraries, Debian's
#                                  # Fashion-MNIST and fortunes into .devcarry-service/
#   scripts/gpu_device.sh run-service    # there, with .devcarry-service/ carried:
#                                  # integration_gpu_job_test (a device: gpu job
#                                  # through a real coordinator and worker)
#   scripts/gpu_device.sh run-all  # there, with both carried: the GPU tests, the
#                                  # service's GPU jobs, bench/gpu_gpt.sh,
#                                  # bench/gpu_zero.sh and a bf16 + CUDA-graph
#                                  # bench/gpu_step.sh, each
#                                  # part time-limited (under 600 s in all)
#
# `run` finds cuDNN and NCCL in the toolkit or in PyTorch's nvidia-* wheels,
# writes logs under $OUT (or /tmp/aidn-gpu-out) and prints a short summary
# last. Knobs for run: TESTS=0, BENCH=0 (bench/gpu_step.sh) or GPT=0
# (bench/gpu_gpt.sh; GPT_STEPS, GPT_REPS, GPT_PRECISION and its CONFIG /
# BATCH / SEQ) to skip a part, REPS / MODELS /
# BATCHES / STEPS / CONV_MODES as bench/gpu_step.sh, GTEST_FILTER, PROFILE=1
# (per-kernel times of the CNN step from ncu, aidn and PyTorch; PROFILE_BATCH,
# PROFILE_CONV=deterministic|fast).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRY=$ROOT/.devcarry
SERVICE_CARRY=$ROOT/.devcarry-service
# Libraries a binary loads that the GPU machine must be given: all but
# glibc's, the C++ runtime's and CUDA's (it has its own, matching its driver).
NOT_CARRIED='/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so|/usr/local/cuda'

pack() {
  set -e
  local build=$ROOT/build-gpu
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAIDN_ENGINE_ONLY=ON \
    -DAIDN_BUILD_BENCHMARKS=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
  ninja -C "$build" >/dev/null
  rm -rf "$CARRY"
  mkdir -p "$CARRY/bin" "$CARRY/lib"
  cp "$build"/tests/gpu/gpu_*_test "$build/bench/gpu_step" "$build/bench/gpu_gpt_step" \
    "$CARRY/bin/"
  ldd "$CARRY"/bin/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev "$NOT_CARRIED" | while read -r lib; do cp -L "$lib" "$CARRY/lib/"; done
  # One compressed archive keeps the copy small.
  tar -C "$CARRY" -cJf "$CARRY/carry.tar.xz" bin lib
  rm -rf "$CARRY/bin" "$CARRY/lib"
  du -sh "$CARRY"
}

pack_service() {
  set -e
  local build=$ROOT/build
  ninja -C "$build" aidn-coordinator aidn-worker-gpu aidnctl integration_gpu_job_test >/dev/null
  rm -rf "$SERVICE_CARRY"
  mkdir -p "$SERVICE_CARRY/bin" "$SERVICE_CARRY/lib" "$SERVICE_CARRY/data"
  : >"$SERVICE_CARRY/paths"
  for t in coordinator/aidn-coordinator worker/aidn-worker-gpu aidnctl/aidnctl \
           tests/integration/integration_gpu_job_test; do
    strip --strip-debug -o "$SERVICE_CARRY/bin/$(basename "$t")" "$build/$t"
    # The test runs the binaries by the paths it was built with.
    echo "$build/$t" >>"$SERVICE_CARRY/paths"
  done
  # Libraries .devcarry/ already has (pack first) are not carried twice.
  local have=""
  [[ -f $CARRY/carry.tar.xz ]] && have=$(tar -tJf "$CARRY/carry.tar.xz" | sed -n 's|^lib/||p')
  ldd "$SERVICE_CARRY"/bin/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev "$NOT_CARRIED" | while read -r lib; do
      grep -qxF "$(basename "$lib")" <<<"$have" || cp -L "$lib" "$SERVICE_CARRY/lib/"
    done
  tar -C "$SERVICE_CARRY" -cJf "$SERVICE_CARRY/bin-lib.tar.xz" bin lib
  rm -rf "$SERVICE_CARRY/bin" "$SERVICE_CARRY/lib"
  # Fashion-MNIST with the first 20,000 training images (the GPU jobs train
  # a few hundred steps of 64), to keep the copy small.
  cp /usr/share/datasets/fashion-mnist/t10k-*.gz "$SERVICE_CARRY/data/"
  python3 - "$SERVICE_CARRY/data" <<'PY'
import gzip, struct, sys
src = "/usr/share/datasets/fashion-mnist/"
keep = 20000
for name, item in (("train-images-idx3-ubyte.gz", 784), ("train-labels-idx1-ubyte.gz", 1)):
    data = gzip.open(src + name).read()
    header = 16 if item > 1 else 8
    out = data[:4] + struct.pack(">I", keep) + data[8:header] + data[header:header + keep * item]
    with gzip.open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(out)
PY
  mkdir -p "$SERVICE_CARRY/data/fortunes"
  # The corpus of the GPT example and job test: the directory's regular files
  # (LoadText skips symbolic links).
  find /usr/share/games/fortunes -maxdepth 1 -type f -exec cp {} "$SERVICE_CARRY/data/fortunes/" \;
  du -sh "$SERVICE_CARRY"
}

# Sets AIDN_LIBRARY_PATH: `first` (our libraries), then cuDNN and NCCL from
# PyTorch's wheels (the cuDNN our headers came from, 9.19; a system one may
# be older), then the toolkit's. Only our binaries get this path: PyTorch
# refuses a cuDNN other than its own.
library_path() {
  local dirs=$1
  local site
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
  for so in libcudnn.so.9 libnccl.so.2 libcublas.so.13 libcudart.so.13; do
    local found=""
    if [[ -n $site && -d $site/nvidia ]]; then
      found=$(find "$site/nvidia" -name "$so" | head -1)
      [[ -n $found ]] && found=$(dirname "$found")
    fi
    if [[ -z $found ]]; then
      for d in /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
        [[ -e $d/$so ]] && found=$d && break
      done
    fi
    echo "$so: ${found:-NOT FOUND}"
    [[ -n $found ]] && dirs=$dirs:$found
  done
  export AIDN_LIBRARY_PATH=$dirs
}

run() {
  local out=${OUT:-/tmp/aidn-gpu-out}
  mkdir -p "$out" /tmp/aidn-carry
  tar -C /tmp/aidn-carry -xJf "$CARRY/carry.tar.xz"
  local bins=/tmp/aidn-carry/bin
  library_path /tmp/aidn-carry/lib
  local dirs=$AIDN_LIBRARY_PATH
  mkdir -p /tmp/aidn-bin
  for b in "$bins"/*; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$dirs" "$b" >"/tmp/aidn-bin/$(basename "$b")"
    chmod +x "/tmp/aidn-bin/$(basename "$b")"
  done
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())' 2>&1
  if LD_LIBRARY_PATH=$dirs ldd "$bins"/* | grep -q 'not found'; then
    LD_LIBRARY_PATH=$dirs ldd "$bins"/* | grep 'not found' | sort -u
  fi

  local summary=$out/summary.txt
  : >"$summary"
  if [[ ${TESTS:-1} == 1 ]]; then
    local tests=("$bins"/gpu_*_test)
    # TEST_BINARIES: only these (names, space-separated).
    if [[ -n ${TEST_BINARIES:-} ]]; then
      tests=()
      for name in $TEST_BINARIES; do tests+=("$bins/$name"); done
    fi
    for t in "${tests[@]}"; do
      local name start rc log
      name=$(basename "$t")
      log=/tmp/aidn-$name.log
      start=$(date +%s%N)
      timeout "${TEST_TIMEOUT:-100}" "/tmp/aidn-bin/$(basename "$t")" ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} >"$log" 2>&1
      rc=$?
      printf '%-22s rc=%-3s %6sms  %s\n' "$name" "$rc" "$(( ($(date +%s%N) - start) / 1000000 ))" \
        "$(grep -E '^\[  (PASSED|FAILED)  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test' "$log" |
           tr '\n' ' ')" >>"$summary"
      grep -E -A3 ': Failure$' "$log" | head -40 >>"$summary"
      { echo "==== $name (rc $rc)"; cat "$log"; } >>"$out/tests.log"
    done
  fi
  if [[ ${BENCH:-1} == 1 ]]; then
    GPU_STEP_BIN=/tmp/aidn-bin/gpu_step PYTHON=python3 "$ROOT/bench/gpu_step.sh" 2>&1 |
      tee "$out/gpu_step.log" | tail -12 >>"$summary"
  fi
  if [[ ${GPT:-1} == 1 ]]; then
    # GPT-2 124M in bf16 against torch eager and torch.compile.
    GPU_GPT_BIN=/tmp/aidn-bin/gpu_gpt_step PYTHON=python3 STEPS=${GPT_STEPS:-30} \
      REPS=${GPT_REPS:-1} PRECISION=${GPT_PRECISION:-bf16} "$ROOT/bench/gpu_gpt.sh" 2>&1 |
      tee "$out/gpu_gpt.log" | tail -5 >>"$summary"
  fi
  if [[ ${PROFILE:-0} == 1 ]]; then profile "$out" >>"$summary" 2>&1; fi
  if [[ ${PROFILE_GPT:-0} == 1 ]]; then profile_gpt "$out" >>"$summary" 2>&1; fi
  echo "==== summary"
  cat "$summary"
}

# Per-kernel GPU time of 10 steady-state steps of the CNN at batch
# PROFILE_BATCH (1024), aidn and PyTorch, from Nsight Compute (one metric,
# no cache flush, clocks as found; only the steps between the benchmarks'
# cudaProfilerStart and Stop): where the step's time goes.
profile() {
  local out=$1 batch=${PROFILE_BATCH:-1024}
  local ncu_flags=(--metrics gpu__time_duration.sum --csv --cache-control none
                   --clock-control none --profile-from-start off)
  echo "==== kernel profile, cnn batch $batch (${PROFILE_CONV:-deterministic})"
  local fast="" det="--deterministic"
  [[ ${PROFILE_CONV:-deterministic} == fast ]] && fast="--fast-conv" && det=""
  LD_LIBRARY_PATH=$AIDN_LIBRARY_PATH ncu "${ncu_flags[@]}" /tmp/aidn-carry/bin/gpu_step --model cnn \
    --batch "$batch" --steps 10 --warmup 50 --profile $fast >"$out/ncu_aidn.csv" 2>/dev/null
  ncu "${ncu_flags[@]}" python3 "$ROOT/bench/gpu_step_torch.py" --model cnn --batch "$batch" \
    --steps 10 --warmup 50 --profile $det >"$out/ncu_torch.csv" 2>/dev/null
  kernel_table 10 14 "$out/ncu_aidn.csv" "$out/ncu_torch.csv"
}

# The GPT-2 step in bf16 (batch 8 x 1024), aidn and PyTorch eager, kernel by
# kernel as `profile` does: PROFILE_GPT_STEPS (2) steps after 3 warm-ups.
profile_gpt() {
  local out=$1 steps=${PROFILE_GPT_STEPS:-2}
  local ncu_flags=(--metrics gpu__time_duration.sum --csv --cache-control none
                   --clock-control none --profile-from-start off)
  local common=(--config gpt2 --batch 8 --seq 1024 --steps $((steps + 3)) --warmup 3)
  echo "==== kernel profile, gpt2 bf16 batch 8 x 1024"
  LD_LIBRARY_PATH=$AIDN_LIBRARY_PATH timeout "${PROFILE_GPT_LIMIT:-150}" ncu "${ncu_flags[@]}" \
    /tmp/aidn-carry/bin/gpu_gpt_step "${common[@]}" --precision bf16 --profile \
    >"$out/ncu_gpt_aidn.csv" 2>/dev/null
  timeout "${PROFILE_GPT_LIMIT:-150}" ncu "${ncu_flags[@]}" python3 "$ROOT/bench/gpt_torch.py" \
    "${common[@]}" --device cuda --precision bf16 --profile >"$out/ncu_gpt_torch.csv" 2>/dev/null
  kernel_table "$steps" 24 "$out/ncu_gpt_aidn.csv" "$out/ncu_gpt_torch.csv"
}

# kernel_table STEPS TOP CSV...: each ncu CSV's kernels by their time a step.
kernel_table() {
  python3 - "$@" <<'PY'
import collections, csv, io, sys
steps, top = int(sys.argv[1]), int(sys.argv[2])
for path in sys.argv[3:]:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    total = collections.defaultdict(float)
    count = collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        v *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1.0)
        name = r["Kernel Name"][:90]
        total[name] += v
        count[name] += 1
    print(f"-- {path.split('/')[-1]}: {sum(count.values())} kernels in {steps} steps, "
          f"{sum(total.values()) / steps:.0f} us of kernels a step")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps:9.1f} us/step  x{count[name] // steps:<3} {name}")
PY
}

run_service() {
  local out=${OUT:-/tmp/aidn-gpu-out}
  mkdir -p "$out" /tmp/aidn-service
  tar -C /tmp/aidn-service -xJf "$SERVICE_CARRY/bin-lib.tar.xz"
  # The libraries it shares with .devcarry/ come from there.
  if [[ -f $CARRY/carry.tar.xz && ! -d /tmp/aidn-carry/lib ]]; then
    mkdir -p /tmp/aidn-carry && tar -C /tmp/aidn-carry -xJf "$CARRY/carry.tar.xz" lib
  fi
  library_path /tmp/aidn-service/lib:/tmp/aidn-carry/lib
  # The binaries where the test was built to find them, and the dataset
  # where Debian puts it.
  while read -r path; do
    [[ -e $path ]] && continue  # a machine with the build itself
    mkdir -p "$(dirname "$path")"
    ln -s "/tmp/aidn-service/bin/$(basename "$path")" "$path"
  done <"$SERVICE_CARRY/paths"
  mkdir -p /usr/share/datasets/fashion-mnist
  cp -n "$SERVICE_CARRY"/data/*.gz /usr/share/datasets/fashion-mnist/
  mkdir -p /usr/share/games/fortunes
  cp -n "$SERVICE_CARRY"/data/fortunes/* /usr/share/games/fortunes/
  local test_bin
  test_bin=$(grep integration_gpu_job_test "$SERVICE_CARRY/paths")
  LD_LIBRARY_PATH=$AIDN_LIBRARY_PATH timeout 900 "$test_bin" \
    ${SERVICE_FILTER:+--gtest_filter=$SERVICE_FILTER} 2>&1 | tee "$out/gpu_job_test.log" |
    grep -E '^\[ +(RUN|OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|Skipped'
}

# Everything a GPU machine should run, most important first, in one command
# of under 600 s: every GPU test, the service's GPU jobs, GPT-2
# against PyTorch, GPT-2 under ZeRO-2 and FSDP against the plain step
# (bench/gpu_zero.sh), the MLP and CNN steps in bf16 with CUDA graphs, the
# attention backward's two ways of summing dK and dV, and a per-kernel
# profile of the GPT-2 step. Each part has a time limit in seconds
# (TEST_LIMIT 140, SERVICE_LIMIT 110, GPT_LIMIT 120, ZERO_LIMIT 50,
# STEP_LIMIT 50, AB_LIMIT 30, PROFILE_LIMIT 60: 560 in all; a first run of
# the first five took 274 s on an H200); the summary and logs go under $OUT.
run_all() {
  local out=${OUT:-/tmp/aidn-gpu-out}
  mkdir -p "$out"
  local start=$SECONDS
  OUT=$out BENCH=0 GPT=0 timeout "${TEST_LIMIT:-140}" "$0" run 2>&1 | tail -40
  echo "==== tests done after $((SECONDS - start)) s"
  OUT=$out timeout "${SERVICE_LIMIT:-110}" "$0" run-service 2>&1 | tail -40
  echo "==== service done after $((SECONDS - start)) s"
  # The library path of `run` (set up by the first part).
  library_path /tmp/aidn-carry/lib >/dev/null
  GPU_GPT_BIN=/tmp/aidn-bin/gpu_gpt_step PYTHON=python3 STEPS=${GPT_STEPS:-20} REPS=1 \
    PRECISION=${GPT_PRECISION:-bf16} timeout "${GPT_LIMIT:-120}" "$ROOT/bench/gpu_gpt.sh" 2>&1 |
    tee "$out/gpu_gpt.log" | tail -8
  echo "==== gpt bench done after $((SECONDS - start)) s"
  GPU_GPT_BIN=/tmp/aidn-bin/gpu_gpt_step STEPS=12 WARMUP=3 timeout "${ZERO_LIMIT:-50}" \
    "$ROOT/bench/gpu_zero.sh" 2>&1 | tee "$out/gpu_zero.log" | tail -9
  echo "==== zero bench done after $((SECONDS - start)) s"
  GPU_STEP_BIN=/tmp/aidn-bin/gpu_step PYTHON=python3 REPS=1 STEPS=200 PRECISION=bf16 GRAPHS=1 \
    BATCHES="256" timeout "${STEP_LIMIT:-50}" "$ROOT/bench/gpu_step.sh" 2>&1 |
    tee "$out/gpu_step.log" | tail -8
  echo "==== step bench done after $((SECONDS - start)) s"
  # The attention backward's dK and dV sums in shared memory (AIDN_FLASH_KV_SMEM=1)
  # against the default (registers, head sizes up to 64): the fused-attention
  # test and the GPT-2 step under each.
  timeout "${AB_LIMIT:-30}" bash -c '
    AIDN_FLASH_KV_SMEM=1 /tmp/aidn-bin/gpu_gpt_test --gtest_filter="*Fused*" | grep -E "^\[  (PASSED|FAILED)"
    for smem in 0 1; do
      echo "AIDN_FLASH_KV_SMEM=$smem: $(AIDN_FLASH_KV_SMEM=$smem /tmp/aidn-bin/gpu_gpt_step --steps 15 \
        --warmup 5 | tail -1)"
    done' 2>&1 | tee "$out/flash_kv.log"
  # Where the GPT-2 step's time goes now, aidn only (PyTorch's: docs/benchmarks.md).
  local ncu_flags=(--metrics gpu__time_duration.sum --csv --cache-control none
                   --clock-control none --profile-from-start off)
  LD_LIBRARY_PATH=$AIDN_LIBRARY_PATH timeout "${PROFILE_LIMIT:-60}" ncu "${ncu_flags[@]}" \
    /tmp/aidn-carry/bin/gpu_gpt_step --steps 4 --warmup 3 --profile >"$out/ncu_gpt_aidn.csv" \
    2>/dev/null
  kernel_table 1 16 "$out/ncu_gpt_aidn.csv"
  echo "==== all done after $((SECONDS - start)) s"
}

case ${1:-} in
  pack) pack ;;
  run) run ;;
  pack-service) pack_service ;;
  run-service) run_service ;;
  run-all) run_all ;;
  *) echo "usage: $0 pack|run|pack-service|run-service|run-all" >&2; exit 2 ;;
esac
