#!/usr/bin/env bash
# GPT training on 2 ranks x 1 thread (DDP): an aidn job against PyTorch
# 1.13's DistributedDataParallel over gloo, the same model and settings,
# interleaved REPS times; prints every sample, the medians and the ratio.
#
#   bench/gpt_ddp.sh          # REPS=3 STEPS=10 BATCH=8: about 12 minutes
#
# Each rep also runs the aidn job under `strategy: zero1`, `zero2` and
# `fsdp` (full_shard; docs/strategies.md), and the summary gives their
# throughput against aidn's DDP (ZERO=0 leaves them out).
#
# Model: nanoGPT's character-level shape (CONFIG=gpt-char: 6 layers, 6
# heads, 384 wide, context 256, bytes; 10.8M parameters), BATCH sequences
# of 256 per rank per step, AdamW (lr 1e-3, decay 0.1 on matrices and
# embeddings only, clipping at 1.0), fp32, one thread per rank.
#
# aidn: a real coordinator and one worker with 2 CPU slots on loopback; each
#   sample is a job (model gpt on Debian's fortunes corpus) submitted with
#   aidnctl and followed with `aidnctl watch`. Tokens/s is taken from the
#   job's step records (`aidnctl metrics -o csv`): the tokens of the steps
#   after WARMUP over the wall-clock time between the records of step
#   WARMUP and the last step (everything between two steps counts: the
#   batch's windows, the allreduce, the update, the records).
# torch: bench/gpt_torch.py --world 2, two processes (DDP over gloo, 25 MB
#   buckets), random bytes as tokens, the same window, OpenBLAS (OpenMP
#   build) through LD_LIBRARY_PATH.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AIDN_BUILD:-$ROOT/build}
REPS=${REPS:-3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
BATCH=${BATCH:-8}
CONFIG=${CONFIG:-gpt-char}
ZERO=${ZERO:-1}
TORCH_BLAS_DIR=${TORCH_BLAS_DIR:-/usr/lib/x86_64-linux-gnu/openblas-openmp}
PY=/usr/bin/python3
SLOTS=2 source "$ROOT/bench/local_cluster.sh" aidn-gpt-ddp

cat >"$RUN/spec.yaml" <<YAML
name: bench-gpt-ddp
strategy: STRATEGY
world_size: 2
threads_per_rank: 1
model: {name: gpt, config: $CONFIG}
dataset: {kind: text, eval_windows: 1}
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.1, beta2: 0.95, grad_clip_norm: 1.0}
batch_size: $BATCH
max_steps: $STEPS
seed: 1
YAML

aidn_sample() {  # strategy
  local job
  sed "s/STRATEGY/$1/" "$RUN/spec.yaml" >"$RUN/spec-$1.yaml"
  job=$("$AIDNCTL" -o json submit -f "$RUN/spec-$1.yaml" | grep -m1 -o '"id": "[^"]*"' | cut -d'"' -f4)
  "$AIDNCTL" watch "$job" >/dev/null 2>&1 || true
  "$AIDNCTL" metrics "$job" -o csv | $PY -c '
import csv, datetime, sys
warm, steps = int(sys.argv[1]), int(sys.argv[2])
rows = {int(r["step"]): r for r in csv.DictReader(sys.stdin) if r["kind"] == "TRAIN"}
t = lambda k: datetime.datetime.fromisoformat(rows[k]["time"].replace("Z", "+00:00")).timestamp()
tokens = sum(int(rows[k]["tokens"]) for k in range(warm + 1, steps + 1))
print("%.1f %d" % (tokens / (t(steps) - t(warm)), max(int(r["peak_memory_bytes"]) for r in rows.values())))
' "$WARMUP" "$STEPS"
}

torch_sample() {
  local port r
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local pids=()
  for r in 0 1; do
    LD_LIBRARY_PATH=$TORCH_BLAS_DIR OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r \
      $PY "$ROOT/bench/gpt_torch.py" --config "$CONFIG" --world 2 --batch "$BATCH" \
      --steps "$STEPS" --warmup "$WARMUP" --threads 1 >"$RUN/torch-rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r"; done
  sed -n 's/^RESULT //p' "$RUN/torch-rank0.log" |
    $PY -c 'import json, sys; r = json.load(sys.stdin); print("%.1f %.0f" % (r["tokens_per_s"], r["flops_per_token"]))'
}

echo "$CONFIG, 2 ranks x 1 thread, batch $BATCH x 256 per rank, steps $((WARMUP + 1))..$STEPS timed"
A=(); T=(); Z1=(); Z2=(); F=()
for rep in $(seq 1 "$REPS"); do
  if ((rep % 2 == 1)); then read -r a mem < <(aidn_sample ddp); read -r t FLOPS < <(torch_sample)
  else read -r t FLOPS < <(torch_sample); read -r a mem < <(aidn_sample ddp); fi
  A+=("$a"); T+=("$t")
  printf 'rep %d: aidn %.0f tokens/s (peak %.0f MiB a rank), torch DDP %.0f tokens/s\n' \
    "$rep" "$a" "$(echo "$mem / 1048576" | bc -l)" "$t"
  if [[ $ZERO == 1 ]]; then
    for strategy in zero1 zero2 fsdp; do
      read -r z zmem < <(aidn_sample $strategy)
      case $strategy in zero1) Z1+=("$z") ;; zero2) Z2+=("$z") ;; fsdp) F+=("$z") ;; esac
      printf 'rep %d: aidn %s %.0f tokens/s (peak %.0f MiB a rank)\n' \
        "$rep" "$strategy" "$z" "$(echo "$zmem / 1048576" | bc -l)"
    done
  fi
done
$PY - "${A[*]}" "${T[*]}" "$FLOPS" "${Z1[*]:-}" "${Z2[*]:-}" "${F[*]:-}" <<'PY'
import re, statistics, sys
a = statistics.median(float(x) for x in sys.argv[1].split())
t = statistics.median(float(x) for x in sys.argv[2].split())
flops = float(sys.argv[3])  # per token: 6 N + 6 n_layer T n_embd
for name, arg, target in (("zero1", 4, 0.9), ("zero2", 5, 0.9), ("fsdp", 6, None)):
    if not sys.argv[arg].strip():
        continue
    z = statistics.median(float(x) for x in sys.argv[arg].split())
    verdict = f" (target >= {target}: {'PASS' if z / a >= target else 'MISS'})" if target else ""
    print(f"median: aidn {name} {z:.0f} tokens/s, aidn/ddp {z / a:.2f}x{verdict}")
cpuinfo = open("/proc/cpuinfo").read()
lanes = 16 if " avx512f" in cpuinfo else 8
mhz = float(re.search(r"cpu MHz\s*:\s*([\d.]+)", cpuinfo).group(1))
peak = 2 * lanes * 2 * 2 * mhz / 1e3  # two cores, 2 FMA units each
print(f"median: aidn {a:.0f} tokens/s, torch DDP {t:.0f} tokens/s, aidn/torch {a / t:.2f}x "
      f"(target >= 2.0: {'PASS' if a / t >= 2.0 else 'MISS'})")
print(f"model FLOPs: aidn {a * flops / 1e9:.1f} GFLOP/s = MFU {100 * a * flops / 1e9 / peak:.1f} %, "
      f"torch {t * flops / 1e9:.1f} GFLOP/s = MFU {100 * t * flops / 1e9 / peak:.1f} % "
      f"(2 cores, {peak:.0f} GFLOP/s fp32 peak at {mhz:.0f} MHz)")
PY
