// One rank's training step, in process: no coordinator, no worker, no gRPC.
// It runs the trainer's own step (engine::CpuSession::Step, which the
// trainer's loop calls) for one rank without gradient accumulation:
// GatherBatch from the epoch's shuffled indices, then ZeroGrad, SetSeed
// (the trainer's dropout seed rule), Forward, softmax cross-entropy,
// Backward, SGD (lr 0.05, momentum 0.9) Step. The session has no
// communicator: the one-rank DdpReducer leaves gradients in place and is
// left out. This is the engine's side of bench/torch_peer.py --world 1,
// which times the same step in torch.
//
//   build/bench/engine_step --model mlp|cnn|resnet18|resnet50 [--steps 2000] [--threads 1]
//                           [--batch 64] [--warmup-frac 0.1] [--json]
//
// Timing as torch_peer.py: a timestamp after every optimizer step, the first
// --warmup-frac of the steps left out; samples/s = batch x window steps /
// window wall time, and the median step time over the window. Prints
//   engine_step mlp threads 1 batch 64 | 1800 steps | 0.920 ms median | 69000 samples/s |
//   cpu 0.925 ms/step | loss 0.2411
// or, with --json, one line "RESULT {json}" with the fields torch_peer.py
// prints (samples_per_s, median_step_ms, median_samples_per_s, final_loss)
// and cpu_ms_per_step: the process's CPU time (all threads) per step over
// the window, which on a shared host moves less with others' load.

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/data.h"
#include "worker/engine/gemm.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/tensor.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "mlp";
  int64_t steps = 2000;
  int threads = 1;
  int64_t batch = 64;
  double warmup_frac = 0.1;
  uint64_t seed = 1;
  std::string data = aidn::engine::kFashionMnistDir;
  bool json = false;
};

double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void PrintUsage(std::FILE* out, const char* argv0) {
  const Options d;
  std::fprintf(out,
               "usage: %s --model mlp|cnn|resnet18|resnet50 [--steps N] [--threads T] [--batch B]\n"
               "          [--warmup-frac F] [--seed S] [--data DIR] [--json]\n"
               "  --model        mlp, cnn, resnet18 or resnet50 (default: %s)\n"
               "  --steps        training steps (default: %lld)\n"
               "  --threads      CPU threads (default: %d)\n"
               "  --batch        batch size (default: %lld)\n"
               "  --warmup-frac  share of the steps left out of the figures (default: %g)\n"
               "  --seed         model and data seed (default: %llu)\n"
               "  --data         Fashion-MNIST directory (default: %s)\n"
               "  --json         one JSON line instead of the table (default: off)\n",
               argv0, d.model.c_str(), static_cast<long long>(d.steps), d.threads,
               static_cast<long long>(d.batch), d.warmup_frac,
               static_cast<unsigned long long>(d.seed), d.data.c_str());
}

int Usage(const char* argv0) {
  PrintUsage(stderr, argv0);
  return 2;
}

int Run(const Options& options) {
  namespace engine = aidn::engine;
#ifndef __OPTIMIZE__
  std::fprintf(stderr, "WARNING: engine_step built without optimisation; timings mean little\n");
#endif
  engine::ConfigureCpu(options.threads);
  absl::StatusOr<engine::Dataset> train = engine::LoadFashionMnist(options.data, /*train=*/true);
  if (!train.ok()) {
    std::fprintf(stderr, "dataset: %s\n", train.status().ToString().c_str());
    return 1;
  }
  engine::ModelConfig model_config;
  model_config.name = options.model;
  absl::StatusOr<std::unique_ptr<engine::Sequential>> built =
      engine::BuildModel(model_config, options.seed);
  if (!built.ok()) {
    std::fprintf(stderr, "model: %s\n", built.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<engine::Sequential> model = *std::move(built);
  engine::OptimizerConfig optimizer_config;
  optimizer_config.name = "sgd";
  optimizer_config.lr = 0.05;
  optimizer_config.momentum = 0.9;
  absl::StatusOr<std::unique_ptr<engine::Optimizer>> optimizer =
      engine::Optimizer::Create(optimizer_config, model->Parameters());
  if (!optimizer.ok()) {
    std::fprintf(stderr, "optimizer: %s\n", optimizer.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<engine::CpuSession>> session =
      engine::CpuSession::Create({}, model.get(), optimizer->get());
  if (!session.ok()) {
    std::fprintf(stderr, "session: %s\n", session.status().ToString().c_str());
    return 1;
  }

  engine::DistributedSampler sampler(train->size, /*world_size=*/1, /*rank=*/0, /*shuffle=*/true,
                                     options.seed, /*drop_last=*/false);
  const int64_t steps_per_epoch = sampler.num_samples() / options.batch;
  if (steps_per_epoch <= 0) {
    std::fprintf(stderr, "batch %lld is larger than the dataset\n",
                 static_cast<long long>(options.batch));
    return 2;
  }
  // Every epoch's shuffle is drawn before the clock starts, as torch_peer.py does.
  const int64_t epochs = (options.steps + steps_per_epoch - 1) / steps_per_epoch;
  std::vector<std::vector<int64_t>> epoch_indices;
  for (int64_t e = 0; e < epochs; ++e) epoch_indices.push_back(sampler.EpochIndices(e));

  engine::Tensor images;
  std::vector<int32_t> labels;
  std::vector<Clock::time_point> stamps(static_cast<size_t>(options.steps) + 1);
  std::vector<double> cpu_stamps(static_cast<size_t>(options.steps) + 1);
  double last_loss = 0;
  stamps[0] = Clock::now();
  cpu_stamps[0] = ProcessCpuSeconds();
  for (int64_t step = 0; step < options.steps; ++step) {
    const std::vector<int64_t>& indices =
        epoch_indices[static_cast<size_t>(step / steps_per_epoch)];
    engine::GatherBatch(*train, indices,
                        static_cast<size_t>((step % steps_per_epoch) * options.batch),
                        static_cast<size_t>(options.batch), &images, &labels);
    const uint64_t seed = engine::DropoutSeed(options.seed, step, /*accum=*/1, /*micro=*/0,
                                              /*world_size=*/1, /*rank=*/0);
    absl::StatusOr<double> loss =
        (*session)->Step({engine::MicroBatch{&images, &labels, seed}}, optimizer_config.lr);
    if (!loss.ok()) {
      std::fprintf(stderr, "step: %s\n", loss.status().ToString().c_str());
      return 1;
    }
    last_loss = *loss;
    stamps[static_cast<size_t>(step) + 1] = Clock::now();
    cpu_stamps[static_cast<size_t>(step) + 1] = ProcessCpuSeconds();
  }

  const int64_t warm = std::min<int64_t>(
      options.steps - 1,
      std::max<int64_t>(1, std::llround(options.warmup_frac * static_cast<double>(options.steps))));
  const int64_t window = options.steps - warm;
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  const double wall = seconds(stamps.back() - stamps[static_cast<size_t>(warm)]);
  std::vector<double> intervals;
  for (int64_t k = warm + 1; k <= options.steps; ++k) {
    intervals.push_back(
        seconds(stamps[static_cast<size_t>(k)] - stamps[static_cast<size_t>(k - 1)]));
  }
  const double median = Median(intervals);
  // CPU time (all threads) per step over the window: on a shared host it
  // moves less with other processes' load than the wall time does.
  const double cpu_per_step =
      (cpu_stamps.back() - cpu_stamps[static_cast<size_t>(warm)]) / static_cast<double>(window);
  const double samples_per_s = static_cast<double>(options.batch * window) / wall;
  if (options.json) {
    std::printf(
        "RESULT {\"model\": \"%s\", \"threads\": %d, \"batch\": %lld, \"steps\": %lld, "
        "\"window_steps\": %lld, \"window_s\": %.6f, \"samples_per_s\": %.1f, "
        "\"median_step_ms\": %.4f, \"median_samples_per_s\": %.1f, \"cpu_ms_per_step\": %.4f, "
        "\"final_loss\": %.6f, \"gemm\": \"%s\"}\n",
        options.model.c_str(), options.threads, static_cast<long long>(options.batch),
        static_cast<long long>(options.steps), static_cast<long long>(window), wall, samples_per_s,
        median * 1e3, static_cast<double>(options.batch) / median, cpu_per_step * 1e3, last_loss,
        aidn::engine::GemmDescription().c_str());
  } else {
    std::printf(
        "engine_step %s threads %d batch %lld | %lld steps | %.3f ms median | %.0f samples/s | "
        "cpu %.3f ms/step | loss %.4f | %s\n",
        options.model.c_str(), options.threads, static_cast<long long>(options.batch),
        static_cast<long long>(window), median * 1e3, samples_per_s, cpu_per_step * 1e3, last_loss,
        aidn::engine::GemmDescription().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The environment a worker gives its trainers: where OpenBLAS would take
  // its AVX2 kernels on an AVX-512 CPU, run again with OPENBLAS_CORETYPE set
  // (the library reads it once, at load). AIDN_BENCH_BLAS=default keeps
  // OpenBLAS's own choice, for comparison.
  const char* blas = std::getenv("AIDN_BENCH_BLAS");
  if (blas == nullptr || std::string(blas) != "default") {
    const std::string override_env = aidn::engine::BlasCoreOverride();
    if (!override_env.empty()) {
      putenv(const_cast<char*>(override_env.c_str()));
      execv("/proc/self/exe", argv);
      std::perror("execv /proc/self/exe");
      return 1;
    }
  }
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      PrintUsage(stdout, argv[0]);
      return 0;
    }
    if (flag == "--json") {
      options.json = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(argv[0]);
    const char* value = argv[++i];
    if (flag == "--model") {
      options.model = value;
    } else if (flag == "--steps") {
      options.steps = std::atoll(value);
    } else if (flag == "--threads") {
      options.threads = std::atoi(value);
    } else if (flag == "--batch") {
      options.batch = std::atoll(value);
    } else if (flag == "--warmup-frac") {
      options.warmup_frac = std::atof(value);
    } else if (flag == "--seed") {
      options.seed = std::strtoull(value, nullptr, 10);
    } else if (flag == "--data") {
      options.data = value;
    } else {
      return Usage(argv[0]);
    }
  }
  if (options.steps < 2 || options.threads < 1 || options.batch < 1 ||
      !(options.warmup_frac >= 0 && options.warmup_frac < 1)) {
    return Usage(argv[0]);
  }
  return Run(options);
}
