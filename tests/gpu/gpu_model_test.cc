// The GPU model and training step against the CPU engine: whole-model
// forward/backward on random batches, then 50 training steps of the MLP and
// the CNN from the same initial weights on the same batches, loss curves
// compared step by step. Skips without a device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu/gpu_test_util.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/layers.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine::cuda {
namespace {

using testing::ExpectClose;
using testing::RandomTensor;
using testing::ToDevice;
using testing::ToHost;

constexpr double kFp32 = 1e-5;

struct Batch {
  Tensor images;
  std::vector<int32_t> labels;
};

// Random images in [-1, 1] (never zero) and random labels in [0, 10).
std::vector<Batch> RandomBatches(int count, int64_t batch, uint64_t seed) {
  std::vector<Batch> out;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int i = 0; i < count; ++i) {
    Batch b;
    b.images = RandomTensor({batch, 1, 28, 28}, seed * 1000 + i);
    b.labels.resize(static_cast<size_t>(batch));
    for (auto& l : b.labels) l = static_cast<int32_t>(rng() % 10);
    out.push_back(std::move(b));
  }
  return out;
}

std::unique_ptr<Sequential> Cpu(const ModelConfig& config, uint64_t seed) {
  auto model = BuildModel(config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(model).value() : nullptr;
}

ModelConfig Mlp() { return ModelConfig(); }
ModelConfig Cnn() {
  ModelConfig c;
  c.name = "cnn";
  return c;
}

void CompareForwardBackward(const ModelConfig& config) {
  SCOPED_TRACE(config.name);
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  std::printf("%s forward/backward, batch 64\n", config.name.c_str());
  auto cpu = Cpu(config, 7);
  ASSERT_NE(cpu, nullptr);
  auto gpu = GpuModel::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->Describe(), cpu->Describe());
  EXPECT_EQ((*gpu)->ParameterCount(), cpu->ParameterCount());

  Batch b = std::move(RandomBatches(1, 64, 3)[0]);
  Tensor logits;
  cpu->ZeroGrad();
  cpu->Forward(b.images, &logits, true);
  Tensor grad;
  const double loss = SoftmaxCrossEntropy(logits, b.labels, &grad);
  cpu->Backward(grad);

  GpuTensor x = ToDevice(ctx.get(), b.images);
  GpuTensor glogits;
  ASSERT_TRUE((*gpu)->ZeroGrad().ok());
  ASSERT_TRUE((*gpu)->Forward(x, &glogits, true).ok());
  ExpectClose("logits", ToHost(ctx.get(), glogits), logits, kFp32);
  GpuCrossEntropy xent(ctx.get());
  GpuTensor ggrad;
  ASSERT_TRUE(xent.Compute(glogits, b.labels, &ggrad).ok());
  absl::StatusOr<double> gloss = xent.Loss();
  ASSERT_TRUE(gloss.ok());
  std::printf("  loss %.8f vs CPU %.8f\n", *gloss, loss);
  EXPECT_NEAR(*gloss, loss, kFp32 * loss);
  ASSERT_TRUE((*gpu)->Backward(ggrad).ok());

  // Gradients into a second CPU model's parameters, compared by name.
  auto copy = Cpu(config, 7);
  ASSERT_NE(copy, nullptr);
  ASSERT_TRUE((*gpu)->CopyGradientsTo(copy->Parameters()).ok());
  for (size_t k = 0; k < cpu->Parameters().size(); ++k) {
    ExpectClose(cpu->Parameters()[k]->name + " gradient", copy->Parameters()[k]->grad,
                cpu->Parameters()[k]->grad, kFp32);
  }
  // Weights come back exactly as they went in.
  auto back = Cpu(config, 99);
  ASSERT_TRUE((*gpu)->CopyParametersTo(back->Parameters()).ok());
  for (size_t k = 0; k < cpu->Parameters().size(); ++k) {
    EXPECT_EQ(testing::MaxRelError(back->Parameters()[k]->value, cpu->Parameters()[k]->value), 0.0);
  }
}

TEST(GpuModel, MlpForwardBackwardMatchesCpu) { CompareForwardBackward(Mlp()); }
TEST(GpuModel, CnnForwardBackwardMatchesCpu) { CompareForwardBackward(Cnn()); }

TEST(GpuModel, RefusesParametersThatDoNotMatch) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  auto gpu = GpuModel::Build(ctx.get(), Mlp(), 1);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cnn = Cpu(Cnn(), 1);
  EXPECT_EQ((*gpu)->CopyParametersFrom(cnn->Parameters()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GpuModel, DropoutModelTrainsAndEvaluatesDeterministically) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  ModelConfig config = Mlp();
  config.dropout = 0.5;
  auto cpu = Cpu(config, 3);
  auto gpu = GpuModel::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->Describe(), cpu->Describe());
  Batch b = std::move(RandomBatches(1, 32, 4)[0]);
  GpuTensor x = ToDevice(ctx.get(), b.images);
  // Evaluation has no dropout: equal to the CPU.
  GpuTensor glogits;
  Tensor logits;
  cpu->Forward(b.images, &logits, false);
  ASSERT_TRUE((*gpu)->Forward(x, &glogits, false).ok());
  ExpectClose("eval logits with dropout layers", ToHost(ctx.get(), glogits), logits, kFp32);
  // Training: the same seed gives the same logits; another seed others.
  (*gpu)->SetSeed(11);
  ASSERT_TRUE((*gpu)->Forward(x, &glogits, true).ok());
  const Tensor first = ToHost(ctx.get(), glogits);
  (*gpu)->SetSeed(11);
  ASSERT_TRUE((*gpu)->Forward(x, &glogits, true).ok());
  EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), glogits), first), 0.0);
  (*gpu)->SetSeed(12);
  ASSERT_TRUE((*gpu)->Forward(x, &glogits, true).ok());
  EXPECT_GT(testing::MaxRelError(ToHost(ctx.get(), glogits), first), 1e-3);
}

// 50 steps on CPU and GPU from the same weights over the same 5 batches
// (cycled, so the loss falls as the model memorises them).
void CompareTraining(const ModelConfig& model_config, const OptimizerConfig& opt_config,
                     double tolerance) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  std::printf("%s, %s lr %g, 50 steps at batch 64\n", model_config.name.c_str(),
              opt_config.name.c_str(), opt_config.lr);
  auto cpu = Cpu(model_config, 5);
  ASSERT_NE(cpu, nullptr);
  auto gpu = GpuModel::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu_opt = Optimizer::Create(opt_config, cpu->Parameters());
  ASSERT_TRUE(cpu_opt.ok()) << cpu_opt.status();
  auto trainer = GpuTrainer::Create(ctx.get(), gpu->get(), opt_config);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const std::vector<Batch> batches = RandomBatches(5, 64, 8);

  double max_rel = 0;
  double first = 0, last_cpu = 0, last_gpu = 0;
  Tensor logits, grad;
  for (int step = 0; step < 50; ++step) {
    const Batch& b = batches[static_cast<size_t>(step) % batches.size()];
    cpu->ZeroGrad();
    cpu->Forward(b.images, &logits, true);
    const double cpu_loss = SoftmaxCrossEntropy(logits, b.labels, &grad);
    cpu->Backward(grad);
    ASSERT_TRUE((*cpu_opt)->Step(opt_config.lr).ok());
    absl::StatusOr<double> gpu_loss = (*trainer)->Step(b.images, b.labels, opt_config.lr);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    const double rel = std::fabs(*gpu_loss - cpu_loss) / cpu_loss;
    max_rel = std::max(max_rel, rel);
    if (step % 10 == 0 || step == 49) {
      std::printf("  step %2d  cpu %.7f  gpu %.7f  rel %.2g\n", step, cpu_loss, *gpu_loss, rel);
    }
    if (step == 0) first = cpu_loss;
    last_cpu = cpu_loss;
    last_gpu = *gpu_loss;
  }
  std::printf("  max rel loss difference over 50 steps: %.3g (tolerance %.0e)\n", max_rel,
              tolerance);
  EXPECT_LE(max_rel, tolerance);
  // It trained: the loss on the cycled batches fell on both.
  EXPECT_LT(last_cpu, 0.8 * first);
  EXPECT_LT(last_gpu, 0.8 * first);
  // And the weights agree at the end.
  auto after = Cpu(model_config, 1);
  ASSERT_TRUE((*gpu)->CopyParametersTo(after->Parameters()).ok());
  for (size_t k = 0; k < cpu->Parameters().size(); ++k) {
    ExpectClose(cpu->Parameters()[k]->name + " after 50 steps", after->Parameters()[k]->value,
                cpu->Parameters()[k]->value, 10 * tolerance);
  }
}

// fp32 throughout: the only differences are summation orders in GEMMs,
// convolutions and reductions (~1e-7 per step), which 50 steps of training
// amplify; 1e-4 on the loss leaves room for that and still catches any
// real difference (a wrong transpose or formula is off by far more).
TEST(GpuTraining, MlpSgdMomentumLossCurveMatchesCpu) {
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.01;
  opt.momentum = 0.9;
  CompareTraining(Mlp(), opt, 1e-4);
}

TEST(GpuTraining, CnnAdamWLossCurveMatchesCpu) {
  OptimizerConfig opt;
  opt.name = "adamw";
  opt.lr = 1e-3;
  opt.weight_decay = 0.01;
  CompareTraining(Cnn(), opt, 1e-4);
}

TEST(GpuTraining, CnnSgdNesterovLossCurveMatchesCpu) {
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.02;
  opt.momentum = 0.9;
  opt.nesterov = true;
  opt.weight_decay = 1e-4;
  CompareTraining(Cnn(), opt, 1e-4);
}

// The DDP seam: the hook runs after backward and before the update. A hook
// that zeroes every gradient leaves plain SGD's weights where they were; a
// failing hook fails the step before any update.
TEST(GpuTraining, TheAfterBackwardHookRunsBetweenBackwardAndTheUpdate) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  auto cpu = Cpu(Mlp(), 3);
  ASSERT_NE(cpu, nullptr);
  auto gpu = GpuModel::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.1;
  auto trainer = GpuTrainer::Create(ctx.get(), gpu->get(), opt);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  int calls = 0;
  GpuModel* model = gpu->get();
  (*trainer)->SetAfterBackward([&]() -> absl::Status {
    ++calls;
    for (GpuParameter* p : model->Parameters()) {
      // Backward's gradients are non-zero here (random inputs).
      Tensor g = ToHost(ctx.get(), p->grad);
      double sum = 0;
      for (int64_t i = 0; i < g.numel(); ++i) sum += std::fabs(g[i]);
      if (sum == 0) return absl::InternalError(p->name + ": gradient still zero after backward");
      if (absl::Status s = p->grad.Zero(ctx.get()); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
  const Batch b = std::move(RandomBatches(1, 64, 4)[0]);
  absl::StatusOr<double> loss = (*trainer)->Step(b.images, b.labels, opt.lr);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(calls, 1);
  auto after = Cpu(Mlp(), 9);
  ASSERT_TRUE(model->CopyParametersTo(after->Parameters()).ok());
  for (size_t k = 0; k < cpu->Parameters().size(); ++k) {
    ExpectClose(cpu->Parameters()[k]->name + " unchanged", after->Parameters()[k]->value,
                cpu->Parameters()[k]->value, 0.0);
  }

  (*trainer)->SetAfterBackward([]() { return absl::UnavailableError("peer gone (injected)"); });
  absl::StatusOr<double> failed = (*trainer)->Step(b.images, b.labels, opt.lr);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*trainer)->optimizer().steps(), 1) << "no update after a failed hook";
}

}  // namespace
}  // namespace aidn::engine::cuda
