// One rank's training step on the GPU: aidn's GpuTrainer against PyTorch on
// the same device (bench/gpu_step_torch.py, run by bench/gpu_step.sh).
//
//   gpu_step --model mlp|cnn --batch 64 --steps 500 [--warmup 50] [--tf32] [--fast-conv]
//            [--precision fp32|bf16|fp16] [--cuda-graphs] [--json]
//
// Convolution algorithms: deterministic ones by default (aidn's default,
// PyTorch's cudnn.deterministic); --fast-conv lets any be chosen, FFT and
// Winograd too (PyTorch's cudnn.benchmark default). --precision bf16 / fp16
// rounds GEMM and convolution operands to 16 bits (fp16 with dynamic loss
// scaling); the torch peer uses autocast (and GradScaler for fp16).
// --cuda-graphs replays captured steps (GpuTrainer::SetCudaGraphs; the
// torch peer stays eager).
// --profile brackets the
// timed steps with cudaProfilerStart/Stop (ncu --profile-from-start off).
//
// The step is what GpuTrainer::Step does: upload the batch from pageable
// host memory, zero the gradients, forward, softmax cross-entropy, backward,
// SGD (lr 0.05, momentum 0.9), and read the loss back (one host wait a step,
// as the trainer needs the loss for its records; the torch peer calls
// loss.item() for the same reason). Inputs are random (uniform in [-1, 1],
// never zero) so that the GPU machine needs no dataset; 8 batches cycle.
// Step times are taken on the host after each step; the first --warmup
// steps (cuDNN algorithm search, allocator growth) are left out.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/device.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/tensor.h"

namespace {

struct Options {
  std::string model = "mlp";
  long long batch = 64;
  long long steps = 500;
  long long warmup = 50;
  bool tf32 = false;
  bool fast_conv = false;
  std::string precision = "fp32";
  bool cuda_graphs = false;
  bool profile = false;
  bool json = false;
};

void Usage(std::FILE* out = stderr) {
  std::fprintf(out,
               "usage: gpu_step --model mlp|cnn [--batch 64] [--steps 500] [--warmup 50] "
               "[--tf32] [--fast-conv] [--precision fp32|bf16|fp16] [--cuda-graphs] [--profile] "
               "[--json]\n");
}

int Run(const Options& o) {
#if !defined(__OPTIMIZE__)
  std::printf("WARNING: built without optimisation: figures are not representative\n");
#endif
  aidn::engine::DeviceInventory inventory = aidn::engine::DiscoverDevices();
  if (inventory.gpus.empty()) {
    std::fprintf(stderr, "gpu_step: no CUDA device: %s\n", inventory.gpu_note.c_str());
    return 2;
  }
  aidn::engine::cuda::GpuContextOptions context_options;
  context_options.allow_tf32 = o.tf32;
  if (o.precision == "bf16") context_options.precision = aidn::engine::cuda::Precision::kBf16;
  if (o.precision == "fp16") context_options.precision = aidn::engine::cuda::Precision::kFp16;
  if (o.fast_conv) {
    // PyTorch's latitude with cudnn.benchmark: any algorithm, fastest first.
    context_options.allow_transform_convolutions = true;
    context_options.deterministic_convolutions = false;
  }
  auto ctx = aidn::engine::cuda::GpuContext::Create(context_options);
  if (!ctx.ok()) {
    std::fprintf(stderr, "gpu_step: %s\n", ctx.status().ToString().c_str());
    return 1;
  }
  aidn::engine::ModelConfig config;
  config.name = o.model;
  auto model = aidn::engine::cuda::GpuModel::Build(ctx->get(), config, /*seed=*/1);
  if (!model.ok()) {
    std::fprintf(stderr, "gpu_step: %s\n", model.status().ToString().c_str());
    return 1;
  }
  aidn::engine::OptimizerConfig optimizer;
  optimizer.name = "sgd";
  optimizer.lr = 0.05;
  optimizer.momentum = 0.9;
  auto trainer = aidn::engine::cuda::GpuTrainer::Create(ctx->get(), model->get(), optimizer);
  if (!trainer.ok()) {
    std::fprintf(stderr, "gpu_step: %s\n", trainer.status().ToString().c_str());
    return 1;
  }
  (*trainer)->SetCudaGraphs(o.cuda_graphs);

  constexpr int kBatches = 8;
  std::vector<aidn::engine::Tensor> images;
  std::vector<std::vector<int32_t>> labels(kBatches);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int b = 0; b < kBatches; ++b) {
    aidn::engine::Tensor t({o.batch, 1, 28, 28});
    for (int64_t i = 0; i < t.numel(); ++i) {
      float v = u(rng);
      while (v == 0.0f) v = u(rng);
      t[i] = v;
    }
    images.push_back(std::move(t));
    labels[b].resize(static_cast<size_t>(o.batch));
    for (auto& l : labels[b]) l = static_cast<int32_t>(rng() % 10);
  }

  std::vector<double> times;
  double last_loss = 0;
  const auto all_start = std::chrono::steady_clock::now();
  auto window_start = all_start;
  for (long long step = 0; step < o.warmup + o.steps; ++step) {
    if (step == o.warmup) {
      // --profile: a profiler started with --profile-from-start off (ncu,
      // nsys) sees the timed steps only.
      if (o.profile) cudaProfilerStart();
      window_start = std::chrono::steady_clock::now();
    }
    const auto start = std::chrono::steady_clock::now();
    const int b = static_cast<int>(step % kBatches);
    absl::StatusOr<double> loss = (*trainer)->Step(images[b], labels[b], 0.05);
    if (!loss.ok()) {
      std::fprintf(stderr, "gpu_step: step %lld: %s\n", step, loss.status().ToString().c_str());
      return 1;
    }
    last_loss = *loss;
    if (step >= o.warmup) {
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  const double window =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
  if (o.profile) cudaProfilerStop();
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double samples_per_s = static_cast<double>(o.batch * o.steps) / window;
  if (o.json) {
    std::printf(
        "RESULT {\"impl\": \"aidn\", \"model\": \"%s\", \"batch\": %lld, \"steps\": %lld, "
        "\"samples_per_s\": %.1f, \"median_step_ms\": %.4f, \"final_loss\": %.6f, "
        "\"tf32\": %s, \"conv\": \"%s\", \"precision\": \"%s\", \"cuda_graphs\": %s, "
        "\"graph_steps\": %lld, \"device\": \"%s\"}\n",
        o.model.c_str(), o.batch, o.steps, samples_per_s, median * 1e3, last_loss,
        o.tf32 ? "true" : "false", o.fast_conv ? "fast" : "deterministic", o.precision.c_str(),
        o.cuda_graphs ? "true" : "false", static_cast<long long>((*trainer)->graph_steps()),
        inventory.gpus[0].name.c_str());
  } else {
    std::printf(
        "gpu_step aidn %s batch %lld | %lld steps | %.3f ms median | %.0f samples/s | "
        "loss %.4f | %s | %s%s\n",
        o.model.c_str(), o.batch, o.steps, median * 1e3, samples_per_s, last_loss,
        inventory.gpus[0].name.c_str(), o.precision.c_str(), o.tf32 ? " | tf32" : "");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      Usage(stdout);
      return 0;
    }
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gpu_step: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--model") {
      o.model = value("--model");
    } else if (flag == "--batch") {
      o.batch = std::atoll(value("--batch"));
    } else if (flag == "--steps") {
      o.steps = std::atoll(value("--steps"));
    } else if (flag == "--warmup") {
      o.warmup = std::atoll(value("--warmup"));
    } else if (flag == "--tf32") {
      o.tf32 = true;
    } else if (flag == "--fast-conv") {
      o.fast_conv = true;
    } else if (flag == "--precision") {
      o.precision = value("--precision");
    } else if (flag == "--cuda-graphs") {
      o.cuda_graphs = true;
    } else if (flag == "--profile") {
      o.profile = true;
    } else if (flag == "--json") {
      o.json = true;
    } else {
      Usage();
      return 2;
    }
  }
  if (o.batch <= 0 || o.steps <= 0 || o.warmup < 0 || (o.model != "mlp" && o.model != "cnn") ||
      (o.precision != "fp32" && o.precision != "bf16" && o.precision != "fp16")) {
    Usage();
    return 2;
  }
  return Run(o);
}
