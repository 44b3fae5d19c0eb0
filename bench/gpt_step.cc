// One rank's GPT training step, in process: the engine's side of
// bench/gpt_torch.py, which times the same step in PyTorch. Each step:
// random windows of bytes, ZeroGrad, Forward (loss), Backward, AdamW
// (lr 1e-3, betas 0.9/0.95, decay 0.1 on matrices, clipping at 1.0).
//
//   build/bench/gpt_step [--config gpt-char] [--batch 8] [--seq 256]
//                        [--steps 12] [--warmup 2] [--threads 1] [--json]
//
// Prints tokens/s over the steps after the warm-up, the median step, and
// the model's FLOPs per second: 6 N per token for the parameter GEMMs plus
// 6 n_layer T n_embd per token for the attention (forward 2, backward 4 of
// its two products, the causal half not subtracted, as PaLM's appendix
// counts), and the process's CPU time per step. With --json one line
// "RESULT {json}".

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "worker/engine/cpu.h"
#include "worker/engine/gemm.h"
#include "worker/engine/gpt.h"
#include "worker/engine/optimizer.h"

namespace {

using aidn::engine::Gpt;
using aidn::engine::GptConfig;

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Options {
  std::string config = "gpt-char";
  int batch = 8;
  int seq = 256;
  int steps = 12;
  int warmup = 2;
  int threads = 1;
  bool json = false;
};

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--config gpt-char] [--batch 8] [--seq 256] [--steps 12] "
               "[--warmup 2] [--threads 1] [--json]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // The environment a worker gives its trainers (as bench/engine_step.cc):
  // where OpenBLAS would take older kernels on an AVX-512 CPU, run again
  // with OPENBLAS_CORETYPE set (the library reads it once, at load).
  if (const std::string override_env = aidn::engine::BlasCoreOverride(); !override_env.empty()) {
    static std::string env = override_env;
    putenv(env.data());
    execv("/proc/self/exe", argv);
    std::perror("execv /proc/self/exe");
    return 1;
  }
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--json") {
      o.json = true;
    } else if ((a == "--config") && (v = next())) {
      o.config = v;
    } else if (a == "--batch" && (v = next())) {
      o.batch = std::atoi(v);
    } else if (a == "--seq" && (v = next())) {
      o.seq = std::atoi(v);
    } else if (a == "--steps" && (v = next())) {
      o.steps = std::atoi(v);
    } else if (a == "--warmup" && (v = next())) {
      o.warmup = std::atoi(v);
    } else if (a == "--threads" && (v = next())) {
      o.threads = std::atoi(v);
    } else {
      return Usage(argv[0]);
    }
  }
  absl::StatusOr<GptConfig> config = aidn::engine::NamedGptConfig(o.config);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  if (o.batch < 1 || o.seq < 1 || o.seq > config->block_size || o.steps <= o.warmup ||
      o.warmup < 0 || o.threads < 1) {
    return Usage(argv[0]);
  }
  aidn::engine::ConfigureCpu(o.threads);
  std::unique_ptr<Gpt> gpt = *Gpt::Create(*config, 1);
  aidn::engine::OptimizerConfig oc;
  oc.name = "adamw";
  oc.lr = 1e-3;
  oc.beta2 = 0.95;
  oc.weight_decay = 0.1;
  oc.decay_matrices_only = true;
  oc.grad_clip_norm = 1.0;
  std::unique_ptr<aidn::engine::Optimizer> optimizer =
      *aidn::engine::Optimizer::Create(oc, gpt->Parameters());

  std::mt19937_64 rng(3);
  const size_t n = static_cast<size_t>(o.batch) * static_cast<size_t>(o.seq);
  std::vector<int32_t> x(n), y(n);
  std::vector<double> step_seconds;
  double loss = 0.0, window_cpu = 0.0;
  auto window_start = std::chrono::steady_clock::now();
  for (int s = 0; s < o.steps; ++s) {
    if (s == o.warmup) {
      window_start = std::chrono::steady_clock::now();
      window_cpu = CpuSeconds();
    }
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config->vocab_size));
      y[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config->vocab_size));
    }
    const auto start = std::chrono::steady_clock::now();
    gpt->ZeroGrad();
    loss = gpt->Forward(x.data(), y.data(), o.batch, o.seq, /*training=*/true);
    gpt->Backward();
    if (!optimizer->Step(oc.lr).ok()) return 1;
    if (s >= o.warmup) {
      step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
  const double cpu = CpuSeconds() - window_cpu;
  const int window = o.steps - o.warmup;
  const double tokens_per_s = static_cast<double>(n) * window / wall;
  std::sort(step_seconds.begin(), step_seconds.end());
  const double median_ms = 1e3 * step_seconds[step_seconds.size() / 2];
  const double params = static_cast<double>(gpt->ParameterCount());
  const double flops_per_token =
      6.0 * params + 6.0 * config->n_layer * static_cast<double>(o.seq) * config->n_embd;
  const double gflops = flops_per_token * tokens_per_s / 1e9;
  if (o.json) {
    std::printf(
        "RESULT {\"config\": \"%s\", \"threads\": %d, \"batch\": %d, \"seq\": %d, "
        "\"tokens_per_s\": %.1f, \"median_step_ms\": %.2f, \"model_gflops_per_s\": %.2f, "
        "\"cpu_s_per_step\": %.3f, \"final_loss\": %.4f, \"parameters\": %.0f}\n",
        o.config.c_str(), o.threads, o.batch, o.seq, tokens_per_s, median_ms, gflops, cpu / window,
        loss, params);
  } else {
    std::printf(
        "gpt_step %s threads %d batch %d seq %d | %d steps | %.1f ms median | %.0f tokens/s | "
        "%.1f model GFLOP/s | cpu %.3f s/step | loss %.4f | %s\n",
        o.config.c_str(), o.threads, o.batch, o.seq, window, median_ms, tokens_per_s, gflops,
        cpu / window, loss, aidn::engine::GemmDescription().c_str());
  }
  return 0;
}
