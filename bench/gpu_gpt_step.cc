// One rank's GPT training step on the GPU, in process: the engine's side of
// bench/gpu_gpt.sh, which times the same step in PyTorch (bench/gpt_torch.py
// --device cuda, eager and torch.compile). Each step: random tokens, zeroed
// gradients, forward (loss), backward, AdamW (lr 1e-3, betas 0.9/0.95, decay
// 0.1 on matrices, clipping at 1.0), the loss read back (the step's one
// host wait).
//
//   gpu_gpt_step [--config gpt2] [--batch 8] [--seq 1024] [--steps 30]
//                [--warmup 5] [--precision bf16] [--json]
//                [--strategy ddp|zero2|shard_grad_op|full_shard]
//                [--param-dtype fp32|bf16] [--reduce-dtype fp32|bf16] [--profile]
//
// Prints tokens/s over the steps after the warm-up, the median step, the
// model's FLOPs per second (6 N per token plus 6 n_layer T n_embd for
// attention, as bench/gpt_step.cc counts them) and the allocator's peak
// bytes. With --json one line "RESULT {json}". --profile brackets the timed
// steps with cudaProfilerStart/Stop (ncu --profile-from-start off).
//
// --strategy other than ddp (the plain step: one rank has nothing to
// average) runs ZeRO-2 or FSDP (cuda/gpu_fsdp.h) over an NCCL communicator
// of one rank, as a one-GPU job does: the units gathered and
// reduce-scattered on the NCCL stream, the optimizer over the shards. It
// prints the model-state bytes the reducer and optimizer hold (weights,
// gradients, AdamW state, pool buffers) beside the one-rank formula, 16
// bytes a parameter plus the layout's padding (bench/gpu_zero.sh).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/gpt.h"
#include "worker/engine/optimizer.h"
#if AIDN_HAVE_NCCL
#include <cuda_runtime.h>

#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/gpu_fsdp.h"
#include "worker/engine/host_shards.h"
#endif

namespace {

using aidn::engine::Gpt;
using aidn::engine::GptConfig;
namespace cuda = aidn::engine::cuda;

struct Options {
  std::string config = "gpt2";
  int batch = 8;
  int seq = 1024;
  int steps = 30;
  int warmup = 5;
  std::string precision = "bf16";
  bool json = false;
  std::string strategy = "ddp";
  std::string param_dtype = "fp32";
  std::string reduce_dtype = "fp32";
  bool profile = false;
};

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--config gpt2] [--batch 8] [--seq 1024] [--steps 30] [--warmup 5] "
               "[--precision fp32|bf16|fp16] [--json] "
               "[--strategy ddp|zero2|shard_grad_op|full_shard] [--param-dtype fp32|bf16] "
               "[--reduce-dtype fp32|bf16] [--profile]\n",
               argv0);
  return 2;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "gpu_gpt_step: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--config" && (v = next())) {
      o.config = v;
    } else if (a == "--batch" && (v = next())) {
      o.batch = std::atoi(v);
    } else if (a == "--seq" && (v = next())) {
      o.seq = std::atoi(v);
    } else if (a == "--steps" && (v = next())) {
      o.steps = std::atoi(v);
    } else if (a == "--warmup" && (v = next())) {
      o.warmup = std::atoi(v);
    } else if (a == "--precision" && (v = next())) {
      o.precision = v;
    } else if (a == "--strategy" && (v = next())) {
      o.strategy = v;
    } else if (a == "--param-dtype" && (v = next())) {
      o.param_dtype = v;
    } else if (a == "--reduce-dtype" && (v = next())) {
      o.reduce_dtype = v;
    } else if (a == "--profile") {
      o.profile = true;
    } else {
      return Usage(argv[0]);
    }
  }
  absl::StatusOr<GptConfig> config = aidn::engine::NamedGptConfig(o.config);
  if (!config.ok()) return Fail(config.status());
  if (o.batch < 1 || o.seq < 1 || o.seq > config->block_size || o.steps <= o.warmup ||
      o.warmup < 0) {
    return Usage(argv[0]);
  }
  cuda::GpuContextOptions co;
  if (o.precision == "bf16") {
    co.precision = cuda::Precision::kBf16;
  } else if (o.precision == "fp16") {
    co.precision = cuda::Precision::kFp16;
  } else if (o.precision != "fp32") {
    return Usage(argv[0]);
  }
  absl::StatusOr<std::unique_ptr<cuda::GpuContext>> ctx = cuda::GpuContext::Create(co);
  if (!ctx.ok()) return Fail(ctx.status());
  absl::StatusOr<std::unique_ptr<Gpt>> cpu = Gpt::Create(*config, 1);
  if (!cpu.ok()) return Fail(cpu.status());
  absl::StatusOr<std::unique_ptr<cuda::GpuGpt>> gpt = cuda::GpuGpt::Create(ctx->get(), **cpu);
  if (!gpt.ok()) return Fail(gpt.status());
  aidn::engine::OptimizerConfig oc;
  oc.name = "adamw";
  oc.lr = 1e-3;
  oc.beta2 = 0.95;
  oc.weight_decay = 0.1;
  oc.decay_matrices_only = true;
  oc.grad_clip_norm = 1.0;
  // ZeRO-2 / FSDP over one NCCL rank: the units' hooks and the optimizer
  // over the shards.
  std::vector<cuda::GpuParameter*> optimized = (*gpt)->Parameters();
#if AIDN_HAVE_NCCL
  aidn::engine::InMemoryKeyValueStore store;
  std::unique_ptr<aidn::engine::NcclCommunicator> nccl;
  std::unique_ptr<aidn::engine::HostShards> layout;
  std::unique_ptr<cuda::GpuFsdpReducer> reducer;
  cudaEvent_t done = nullptr;
  if (o.strategy != "ddp") {
    cuda::GpuFsdpOptions fo;
    if (o.strategy == "zero2") {
      fo.sharding = aidn::engine::Sharding::kGradients;
    } else if (o.strategy == "shard_grad_op") {
      fo.sharding = aidn::engine::Sharding::kShardGradOp;
    } else if (o.strategy == "full_shard") {
      fo.sharding = aidn::engine::Sharding::kFullShard;
    } else {
      return Usage(argv[0]);
    }
    for (const std::string* dtype : {&o.param_dtype, &o.reduce_dtype}) {
      if (*dtype != "fp32" && *dtype != "bf16") return Usage(argv[0]);
    }
    if (o.param_dtype == "bf16") fo.param_half = aidn::engine::HalfFormat::kBf16;
    if (o.reduce_dtype == "bf16") fo.reduce_half = aidn::engine::HalfFormat::kBf16;
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);  // one rank: nothing leaves the host
    absl::StatusOr<std::unique_ptr<aidn::engine::NcclCommunicator>> comm =
        aidn::engine::NcclCommunicator::Create(aidn::engine::NcclOptions{}, &store);
    if (!comm.ok()) return Fail(comm.status());
    nccl = *std::move(comm);
    absl::StatusOr<std::unique_ptr<aidn::engine::HostShards>> shards =
        aidn::engine::HostShards::ForUnits((*cpu)->Units(), (*cpu)->Parameters(), 0, 1);
    if (!shards.ok()) return Fail(shards.status());
    layout = *std::move(shards);
    absl::StatusOr<std::unique_ptr<cuda::GpuFsdpReducer>> r = cuda::GpuFsdpReducer::Create(
        ctx->get(), nccl.get(), layout->map(), (*gpt)->Parameters(), fo);
    if (!r.ok()) return Fail(r.status());
    reducer = *std::move(r);
    if (absl::Status st = (*gpt)->SetUnitHooks(reducer.get()); !st.ok()) return Fail(st);
    optimized = reducer->shard_parameters();
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
      return Fail(absl::InternalError("cudaEventCreate"));
    }
  }
#else
  if (o.strategy != "ddp") return Fail(absl::UnimplementedError("this build has no NCCL"));
#endif
  if (o.strategy == "ddp" && (o.param_dtype != "fp32" || o.reduce_dtype != "fp32")) {
    return Usage(argv[0]);  // nothing is gathered or reduced
  }
  absl::StatusOr<std::unique_ptr<cuda::GpuOptimizer>> optimizer =
      cuda::GpuOptimizer::Create(ctx->get(), oc, optimized);
  if (!optimizer.ok()) return Fail(optimizer.status());
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) {
    cuda::GpuContext* c = ctx->get();
    aidn::engine::NcclCommunicator* comm = nccl.get();
    (*optimizer)->SetNormAllReduce([c, comm](double* total) {
      return comm->AllReduceDoubleSumOn(c->stream(), total, 1);
    });
  }
#endif

  std::mt19937_64 rng(3);
  const size_t n = static_cast<size_t>(o.batch) * static_cast<size_t>(o.seq);
  std::vector<int32_t> x(n), y(n);
  std::vector<double> step_seconds;
  double loss = 0.0;
  auto window_start = std::chrono::steady_clock::now();
  for (int s = 0; s < o.steps; ++s) {
    if (s == o.warmup) {
      window_start = std::chrono::steady_clock::now();
      if (o.profile) cudaProfilerStart();
    }
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config->vocab_size));
      y[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config->vocab_size));
    }
    const auto start = std::chrono::steady_clock::now();
#if AIDN_HAVE_NCCL
    if (reducer != nullptr) {
      if (absl::Status st = reducer->BeginStep(); !st.ok()) return Fail(st);
    }
#endif
    if (absl::Status st = (*gpt)->ZeroGrad(); !st.ok()) return Fail(st);
    if (absl::Status st = (*gpt)->Forward(x.data(), y.data(), o.batch, o.seq, true); !st.ok()) {
      return Fail(st);
    }
    if (absl::Status st = (*gpt)->Backward(); !st.ok()) return Fail(st);
#if AIDN_HAVE_NCCL
    if (reducer != nullptr) {
      if (absl::Status st = reducer->AfterBackward(); !st.ok()) return Fail(st);
    }
#endif
    if (absl::Status st = (*optimizer)->Step(oc.lr); !st.ok()) return Fail(st);
#if AIDN_HAVE_NCCL
    if (reducer != nullptr) {
      if (cudaEventRecord(done, (*ctx)->stream()) != cudaSuccess) {
        return Fail(absl::InternalError("cudaEventRecord"));
      }
      if (absl::Status st = reducer->Wait(done); !st.ok()) return Fail(st);
    }
#endif
    absl::StatusOr<double> l = (*gpt)->ReadLoss();
    if (!l.ok()) return Fail(l.status());
    loss = *l;
    if (s >= o.warmup) {
      step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
  if (o.profile) cudaProfilerStop();
  const int window = o.steps - o.warmup;
  const double tokens_per_s = static_cast<double>(n) * window / wall;
  std::sort(step_seconds.begin(), step_seconds.end());
  const double median_ms = 1e3 * step_seconds[step_seconds.size() / 2];
  const double params = static_cast<double>((*cpu)->ParameterCount());
  const double flops_per_token =
      6.0 * params + 6.0 * config->n_layer * static_cast<double>(o.seq) * config->n_embd;
  const double tflops = flops_per_token * tokens_per_s / 1e12;
  const double peak_gib =
      static_cast<double>((*ctx)->allocator().stats().peak_bytes_in_use) / (1 << 30);
  // Model state: weights, gradients, AdamW's state and (sharded) the pools'
  // buffers, against 16 bytes a parameter.
  double weights = 4 * params, grads = 4 * params, buffers = 0;
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) {
    const cuda::GpuFsdpReducer::Memory m = reducer->memory();
    weights = static_cast<double>(m.weights);
    grads = static_cast<double>(m.gradients);
    buffers = static_cast<double>(m.buffers);
  }
#endif
  const double state = static_cast<double>((*optimizer)->state_bytes());
#if AIDN_HAVE_NCCL
  if (done != nullptr) cudaEventDestroy(done);
#endif
  const double mib = 1 << 20;
  if (o.json) {
    std::printf(
        "RESULT {\"config\": \"%s\", \"precision\": \"%s\", \"batch\": %d, \"seq\": %d, "
        "\"tokens_per_s\": %.1f, \"median_step_ms\": %.2f, \"model_tflops_per_s\": %.2f, "
        "\"peak_gib\": %.2f, \"final_loss\": %.4f, \"parameters\": %.0f, \"strategy\": "
        "\"%s\", \"weights_mib\": %.2f, \"gradients_mib\": %.2f, \"optimizer_mib\": %.2f, "
        "\"buffers_mib\": %.2f, \"formula_mib\": %.2f}\n",
        o.config.c_str(), o.precision.c_str(), o.batch, o.seq, tokens_per_s, median_ms, tflops,
        peak_gib, loss, params, o.strategy.c_str(), weights / mib, grads / mib, state / mib,
        buffers / mib, 16 * params / mib);
  } else {
    std::printf(
        "gpu_gpt_step %s %s batch %d seq %d | %d steps | %.1f ms median | %.0f tokens/s | "
        "%.1f model TFLOP/s | peak %.2f GiB | loss %.4f | %s: state %.1f MiB (16 bytes a "
        "parameter: %.1f) + buffers %.1f MiB\n",
        o.config.c_str(), o.precision.c_str(), o.batch, o.seq, window, median_ms, tokens_per_s,
        tflops, peak_gib, loss, o.strategy.c_str(), (weights + grads + state) / mib,
        16 * params / mib, buffers / mib);
  }
  return 0;
}
