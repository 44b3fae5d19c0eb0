// Every GPU kernel and layer against the CPU engine on random inputs,
// reporting the max relative error (gpu_test_util.h). fp32 under 1e-5,
// TF32 under 1e-3. Skips without a device.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu/gpu_test_util.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/cuda/dropout_mask.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/cuda/gpu_resnet.h"
#include "worker/engine/layers.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/resnet.h"

namespace aidn::engine::cuda {
namespace {

using testing::ExpectClose;
using testing::RandomTensor;
using testing::ToDevice;
using testing::ToHost;

constexpr double kFp32 = 1e-5;
constexpr double kTf32 = 1e-3;
// FFT and Winograd convolutions (GpuContextOptions::allow_transform_convolutions)
// lose a few bits in their transforms.
constexpr double kTransform = 1e-4;

GpuContextOptions Fp32() { return GpuContextOptions(); }
// PyTorch's latitude with cudnn.benchmark: any algorithm, fastest first.
GpuContextOptions FastConvolutions() {
  GpuContextOptions o;
  o.allow_transform_convolutions = true;
  o.deterministic_convolutions = false;
  return o;
}
GpuContextOptions Tf32() {
  GpuContextOptions o;
  o.allow_tf32 = true;
  return o;
}
// Mixed precision: operands rounded to 16 bits, fp32 accumulation.
constexpr double kHalf = 1e-2;
GpuContextOptions Half(Precision precision) {
  GpuContextOptions o;
  o.precision = precision;
  return o;
}
const char* Name(Precision p) { return p == Precision::kBf16 ? "bf16" : "fp16"; }

void Randomize(Parameter* p, uint64_t seed) {
  Tensor v = RandomTensor(p->value.shape(), seed, 0.5f);
  std::copy(v.data(), v.data() + v.numel(), p->value.data());
  // Non-zero starting gradients: Backward must accumulate into them.
  Tensor g = RandomTensor(p->grad.shape(), seed + 1, 0.1f);
  std::copy(g.data(), g.data() + g.numel(), p->grad.data());
}

// Randomizes the CPU layer's parameters and gradients, mirrors it (values),
// and copies the gradients too so both accumulate from the same start.
std::unique_ptr<GpuLayer> Mirror(GpuContext* ctx, Layer* cpu, uint64_t seed) {
  std::vector<Parameter*> params = cpu->Parameters();
  for (size_t i = 0; i < params.size(); ++i) Randomize(params[i], seed + 10 * i);
  absl::StatusOr<std::unique_ptr<GpuLayer>> gpu = MirrorLayer(ctx, *cpu);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return nullptr;
  std::vector<GpuParameter*> gp = (*gpu)->Parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(gp[i]->name, params[i]->name);
    EXPECT_TRUE(gp[i]->grad.CopyFromHost(ctx, params[i]->grad).ok());
  }
  EXPECT_EQ((*gpu)->Describe(), cpu->Describe());
  return std::move(gpu).value();
}

// Forward and Backward of both, compared: output, input gradient, every
// parameter gradient.
void CompareLayer(const std::string& name, GpuContext* ctx, Layer* cpu, GpuLayer* gpu,
                  const Tensor& x, double tolerance, bool training = true) {
  SCOPED_TRACE(name);
  std::printf("%s\n", name.c_str());
  Tensor y;
  cpu->Forward(x, &y, training);
  GpuTensor gx = ToDevice(ctx, x);
  GpuTensor gy;
  ASSERT_TRUE(gpu->Forward(gx, &gy, training).ok());
  ExpectClose("forward", ToHost(ctx, gy), y, tolerance);

  const Tensor dy = RandomTensor(y.shape(), 99);
  Tensor dx;
  cpu->Backward(dy, &dx);
  GpuTensor gdy = ToDevice(ctx, dy);
  GpuTensor gdx;
  absl::Status s = gpu->Backward(gdy, &gdx);
  ASSERT_TRUE(s.ok()) << s;
  ExpectClose("input gradient", ToHost(ctx, gdx), dx, tolerance);
  std::vector<Parameter*> cp = cpu->Parameters();
  std::vector<GpuParameter*> gp = gpu->Parameters();
  ASSERT_EQ(cp.size(), gp.size());
  for (size_t i = 0; i < cp.size(); ++i) {
    ExpectClose(cp[i]->name + " gradient (accumulated)", ToHost(ctx, gp[i]->grad), cp[i]->grad,
                tolerance);
  }
}

TEST(GpuLinear, MatchesCpuForwardAndBackward) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Linear cpu(300, 130);
  auto gpu = Mirror(ctx.get(), &cpu, 1);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Linear(300, 130), batch 37", ctx.get(), &cpu, gpu.get(), RandomTensor({37, 300}, 2),
               kFp32);
}

// Enough rows for the bias gradient to be summed in many slices, and a
// last column tile that is partly outside the matrix.
TEST(GpuLinear, MatchesCpuAtALargeBatch) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Linear cpu(300, 130);
  auto gpu = Mirror(ctx.get(), &cpu, 7);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Linear(300, 130), batch 1000", ctx.get(), &cpu, gpu.get(),
               RandomTensor({1000, 300}, 8), kFp32);
}

TEST(GpuLinear, FusedReluMatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Linear cpu(784, 256);
  ASSERT_TRUE(cpu.Fuse(ReLU()));
  auto gpu = Mirror(ctx.get(), &cpu, 3);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(gpu->Fuse(GpuReLU(ctx.get())));
  CompareLayer("Linear(784, 256)+ReLU, batch 64", ctx.get(), &cpu, gpu.get(),
               RandomTensor({64, 784}, 4), kFp32);
}

TEST(GpuLinear, Tf32StaysWithinItsTolerance) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Tf32());
  Linear cpu(512, 256);
  auto gpu = Mirror(ctx.get(), &cpu, 5);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Linear(512, 256) TF32, batch 128", ctx.get(), &cpu, gpu.get(),
               RandomTensor({128, 512}, 6), kTf32);
}

// Unfused: with a fused ReLU, pre-activations within rounding of zero
// take the ReLU's other branch on one side, and each such flip moves a
// whole gradient element (the whole-model tests cover fused layers).
TEST(GpuLinear, Bf16AndFp16StayWithinTheirTolerance) {
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    AIDN_GPU_CONTEXT_OR_SKIP(ctx, Half(p));
    Linear cpu(512, 256);
    auto gpu = Mirror(ctx.get(), &cpu, 5);
    ASSERT_NE(gpu, nullptr);
    CompareLayer(std::string("Linear(512, 256) ") + Name(p) + ", batch 128", ctx.get(), &cpu,
                 gpu.get(), RandomTensor({128, 512}, 6), kHalf);
  }
}

TEST(GpuLinear, RejectsAWrongInputShape) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  auto gpu = GpuLinear::Create(ctx.get(), 10, 4);
  ASSERT_TRUE(gpu.ok());
  GpuTensor x = ToDevice(ctx.get(), RandomTensor({3, 11}, 1));
  GpuTensor y;
  EXPECT_EQ((*gpu)->Forward(x, &y, true).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GpuReLU, MatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  ReLU cpu;
  GpuReLU gpu(ctx.get());
  CompareLayer("ReLU [9, 7, 5, 3]", ctx.get(), &cpu, &gpu, RandomTensor({9, 7, 5, 3}, 7), 0.0);
}

TEST(GpuConv2d, MatchesCpuWithPadding) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Conv2d cpu(3, 8, 3, /*stride=*/1, /*padding=*/1);
  auto gpu = Mirror(ctx.get(), &cpu, 11);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Conv2d(3, 8, 3, pad 1), [5, 3, 13, 11]", ctx.get(), &cpu, gpu.get(),
               RandomTensor({5, 3, 13, 11}, 12), kFp32);
}

TEST(GpuConv2d, MatchesCpuWithStride) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Conv2d cpu(4, 6, 5, /*stride=*/2, /*padding=*/0);
  auto gpu = Mirror(ctx.get(), &cpu, 13);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Conv2d(4, 6, 5, stride 2), [3, 4, 17, 20]", ctx.get(), &cpu, gpu.get(),
               RandomTensor({3, 4, 17, 20}, 14), kFp32);
}

TEST(GpuConv2d, FusedReluMatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  // The CNN's second layer at batch 64.
  Conv2d cpu(32, 64, 3);
  ASSERT_TRUE(cpu.Fuse(ReLU()));
  auto gpu = Mirror(ctx.get(), &cpu, 15);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(gpu->Fuse(GpuReLU(ctx.get())));
  CompareLayer("Conv2d(32, 64, 3)+ReLU, [64, 32, 13, 13]", ctx.get(), &cpu, gpu.get(),
               RandomTensor({64, 32, 13, 13}, 16), kFp32);
}

// The CNN's two convolutions at batch 256: the algorithms the benchmark
// runs, and a bias gradient summed over many slices.
TEST(GpuConv2d, MatchesCpuAtTheCnnShapes) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  Conv2d first(1, 32, 3, 1, 1);
  auto gpu_first = Mirror(ctx.get(), &first, 21);
  ASSERT_NE(gpu_first, nullptr);
  CompareLayer("Conv2d(1, 32, 3, pad 1), [256, 1, 28, 28]", ctx.get(), &first, gpu_first.get(),
               RandomTensor({256, 1, 28, 28}, 22), kFp32);
  Conv2d second(32, 64, 3, 1, 1);
  auto gpu_second = Mirror(ctx.get(), &second, 23);
  ASSERT_NE(gpu_second, nullptr);
  CompareLayer("Conv2d(32, 64, 3, pad 1), [256, 32, 14, 14]", ctx.get(), &second, gpu_second.get(),
               RandomTensor({256, 32, 14, 14}, 24), kFp32);
}

// With any algorithm allowed (FFT and Winograd too, non-deterministic
// ones), the same shapes stay within kTransform; prints what cuDNN chose.
TEST(GpuConv2d, FastAlgorithmsStayWithinTheirTolerance) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, FastConvolutions());
  for (const auto& [in, out, side, seed] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, uint64_t>>{{1, 32, 28, 25},
                                                                    {32, 64, 14, 27}}) {
    Conv2d cpu(in, out, 3, 1, 1);
    auto gpu = Mirror(ctx.get(), &cpu, seed);
    ASSERT_NE(gpu, nullptr);
    const std::string name = "Conv2d(" + std::to_string(in) + ", " + std::to_string(out) +
                             ", 3, pad 1) fast, [256, " + std::to_string(in) + ", " +
                             std::to_string(side) + ", " + std::to_string(side) + "]";
    CompareLayer(name, ctx.get(), &cpu, gpu.get(), RandomTensor({256, in, side, side}, seed + 1),
                 kTransform);
    const GpuConv2d::Algorithms* algos = static_cast<GpuConv2d*>(gpu.get())->current_algorithms();
    ASSERT_NE(algos, nullptr);
    std::printf("  algorithms: forward %d, backward data %d, backward filter %d\n",
                static_cast<int>(algos->forward), static_cast<int>(algos->backward_data),
                static_cast<int>(algos->backward_filter));
  }
}

TEST(GpuConv2d, Bf16AndFp16StayWithinTheirTolerance) {
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    AIDN_GPU_CONTEXT_OR_SKIP(ctx, Half(p));
    for (const auto& [in, out, side, seed] :
         std::vector<std::tuple<int64_t, int64_t, int64_t, uint64_t>>{{1, 32, 28, 31},
                                                                      {32, 64, 14, 33}}) {
      Conv2d cpu(in, out, 3, 1, 1);
      auto gpu = Mirror(ctx.get(), &cpu, seed);
      ASSERT_NE(gpu, nullptr);
      const std::string name = "Conv2d(" + std::to_string(in) + ", " + std::to_string(out) +
                               ", 3, pad 1) " + Name(p) + ", [64, " + std::to_string(in) + ", " +
                               std::to_string(side) + ", " + std::to_string(side) + "]";
      CompareLayer(name, ctx.get(), &cpu, gpu.get(), RandomTensor({64, in, side, side}, seed + 1),
                   kHalf);
    }
  }
}

TEST(GpuConv2d, Tf32StaysWithinItsTolerance) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Tf32());
  Conv2d cpu(32, 64, 3);
  auto gpu = Mirror(ctx.get(), &cpu, 17);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("Conv2d(32, 64, 3) TF32, [32, 32, 13, 13]", ctx.get(), &cpu, gpu.get(),
               RandomTensor({32, 32, 13, 13}, 18), kTf32);
}

TEST(GpuConv2d, ChoosesAlgorithmsOncePerShape) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  auto conv = GpuConv2d::Create(ctx.get(), 1, 4, 3, 1, 0);
  ASSERT_TRUE(conv.ok()) << conv.status();
  GpuTensor a = ToDevice(ctx.get(), RandomTensor({8, 1, 10, 10}, 1));
  GpuTensor b = ToDevice(ctx.get(), RandomTensor({4, 1, 10, 10}, 2));
  GpuTensor y;
  ASSERT_TRUE((*conv)->Forward(a, &y, true).ok());
  ASSERT_TRUE((*conv)->Forward(a, &y, true).ok());
  EXPECT_EQ((*conv)->cached_shapes(), 1u);
  ASSERT_TRUE((*conv)->Forward(b, &y, true).ok());
  EXPECT_EQ((*conv)->cached_shapes(), 2u);
  ASSERT_TRUE((*conv)->Forward(a, &y, true).ok());
  EXPECT_EQ((*conv)->cached_shapes(), 2u);
  EXPECT_EQ(y.shape(), (std::vector<int64_t>{8, 4, 8, 8}));
}

TEST(GpuMaxPool2d, MatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  // Odd sizes: the last row and column are not covered.
  MaxPool2d cpu(2);
  auto gpu = GpuMaxPool2d::Create(ctx.get(), 2, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  CompareLayer("MaxPool2d(2), [4, 6, 11, 12]", ctx.get(), &cpu, gpu->get(),
               RandomTensor({4, 6, 11, 12}, 21), 0.0);
}

TEST(GpuMaxPool2d, OverlappingWindowsMatchCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  MaxPool2d cpu(3, 2);
  auto gpu = GpuMaxPool2d::Create(ctx.get(), 3, 2);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->Describe(), cpu.Describe());
  // Overlapping windows add gradients; allow rounding of those sums.
  CompareLayer("MaxPool2d(3, stride 2), [2, 3, 15, 9]", ctx.get(), &cpu, gpu->get(),
               RandomTensor({2, 3, 15, 9}, 22), kFp32);
}

TEST(GpuFlatten, IsAViewBothWays) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  GpuFlatten flatten;
  GpuTensor x = ToDevice(ctx.get(), RandomTensor({4, 3, 5, 2}, 1));
  GpuTensor y;
  ASSERT_TRUE(flatten.Forward(x, &y, true).ok());
  EXPECT_EQ(y.shape(), (std::vector<int64_t>{4, 30}));
  EXPECT_EQ(y.data(), x.data());
  EXPECT_TRUE(y.is_view());
  GpuTensor dx;
  ASSERT_TRUE(flatten.Backward(y, &dx).ok());
  EXPECT_EQ(dx.shape(), x.shape());
  EXPECT_EQ(dx.data(), y.data());
}

TEST(GpuDropout, MaskIsTheDocumentedFunctionOfSeedDrawAndIndex) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  const double p = 0.3;
  GpuDropout dropout(ctx.get(), p);
  dropout.SetSeed(1234);
  const Tensor x = RandomTensor({128, 513}, 3);
  GpuTensor gx = ToDevice(ctx.get(), x);
  GpuTensor gy;
  ASSERT_TRUE(dropout.Forward(gx, &gy, true).ok());
  const Tensor y = ToHost(ctx.get(), gy);
  const uint64_t key = DropoutKey(1234, 0);
  EXPECT_EQ(dropout.last_key(), key);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  int64_t kept = 0;
  int64_t wrong = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const bool keep = DropoutKeep(key, static_cast<uint64_t>(i), DropoutThreshold(p));
    kept += keep;
    const float want = keep ? x[i] * scale : 0.0f;
    wrong += y[i] != want;
  }
  EXPECT_EQ(wrong, 0);
  const double rate = static_cast<double>(kept) / x.numel();
  std::printf("  dropout p=%.1f kept %.4f of %ld\n", p, rate, static_cast<long>(x.numel()));
  EXPECT_NEAR(rate, 1 - p, 5 * std::sqrt(p * (1 - p) / x.numel()));

  // Backward applies the same mask to the gradient.
  const Tensor dy = RandomTensor(x.shape(), 4);
  GpuTensor gdy = ToDevice(ctx.get(), dy);
  GpuTensor gdx;
  ASSERT_TRUE(dropout.Backward(gdy, &gdx).ok());
  const Tensor dx = ToHost(ctx.get(), gdx);
  wrong = 0;
  for (int64_t i = 0; i < x.numel(); ++i) wrong += (dx[i] != 0) != (y[i] != 0);
  EXPECT_EQ(wrong, 0);

  // The next draw differs; SetSeed starts the sequence again.
  ASSERT_TRUE(dropout.Forward(gx, &gy, true).ok());
  EXPECT_NE(dropout.last_key(), key);
  dropout.SetSeed(1234);
  ASSERT_TRUE(dropout.Forward(gx, &gy, true).ok());
  EXPECT_EQ(dropout.last_key(), key);
  EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), gy), y), 0.0);

  // Evaluation is the identity.
  ASSERT_TRUE(dropout.Forward(gx, &gy, false).ok());
  EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), gy), x), 0.0);
}

TEST(GpuCrossEntropy, MatchesCpuLossAndGradient) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  std::printf("softmax cross-entropy\n");
  // 10 classes (fewer than a warp) and 100 (several per lane).
  for (int64_t classes : {10, 100}) {
    const int64_t n = 67;
    const Tensor logits = RandomTensor({n, classes}, 31 + classes, 4.0f);
    std::vector<int32_t> labels(n);
    std::mt19937 rng(5);
    for (auto& l : labels) l = static_cast<int32_t>(rng() % classes);
    Tensor grad;
    const double loss = SoftmaxCrossEntropy(logits, labels, &grad, 0.5);
    GpuCrossEntropy xent(ctx.get());
    GpuTensor gl = ToDevice(ctx.get(), logits);
    GpuTensor gg;
    ASSERT_TRUE(xent.Compute(gl, labels, &gg, 0.5).ok());
    absl::StatusOr<double> gpu_loss = xent.Loss();
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    const double rel = std::fabs(*gpu_loss - loss) / loss;
    std::printf("  classes %ld: loss %.9f vs CPU %.9f, rel error %.3g\n",
                static_cast<long>(classes), *gpu_loss, loss, rel);
    EXPECT_LE(rel, 1e-12);
    ExpectClose("gradient", ToHost(ctx.get(), gg), grad, kFp32);
  }
}

TEST(GpuCrossEntropy, RejectsLabelsOutOfRange) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  GpuCrossEntropy xent(ctx.get());
  GpuTensor gl = ToDevice(ctx.get(), RandomTensor({2, 3}, 1));
  GpuTensor gg;
  EXPECT_EQ(xent.Compute(gl, {0, 3}, &gg).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(xent.Compute(gl, {0}, &gg).code(), absl::StatusCode::kInvalidArgument);
}

// Three steps of the CPU and GPU optimizers on the same parameters and
// gradients (fresh random gradients each step).
void CompareOptimizer(GpuContext* ctx, const OptimizerConfig& config, double tolerance) {
  const std::string name = config.name + (config.momentum != 0 ? " momentum" : "") +
                           (config.nesterov ? " nesterov" : "") +
                           (config.weight_decay != 0 ? " wd" : "") +
                           (config.grad_clip_norm != 0 ? " clip" : "");
  SCOPED_TRACE(name);
  std::printf("optimizer %s\n", name.c_str());
  // Odd sizes: vector bodies and scalar tails on the CPU.
  std::vector<std::vector<int64_t>> shapes = {{37, 29}, {37}, {1001}};
  std::vector<Parameter> cpu(shapes.size());
  std::vector<GpuParameter> gpu(shapes.size());
  std::vector<Parameter*> cpu_ptrs;
  std::vector<GpuParameter*> gpu_ptrs;
  for (size_t k = 0; k < shapes.size(); ++k) {
    cpu[k].name = "p" + std::to_string(k);
    cpu[k].value = RandomTensor(shapes[k], 100 + k);
    cpu[k].grad = Tensor(shapes[k]);
    gpu[k].name = cpu[k].name;
    gpu[k].value = ToDevice(ctx, cpu[k].value);
    gpu[k].grad = ToDevice(ctx, cpu[k].grad);
    cpu_ptrs.push_back(&cpu[k]);
    gpu_ptrs.push_back(&gpu[k]);
  }
  auto cpu_opt = Optimizer::Create(config, cpu_ptrs);
  ASSERT_TRUE(cpu_opt.ok()) << cpu_opt.status();
  auto gpu_opt = GpuOptimizer::Create(ctx, config, gpu_ptrs);
  ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status();
  for (int step = 0; step < 3; ++step) {
    for (size_t k = 0; k < shapes.size(); ++k) {
      cpu[k].grad = RandomTensor(shapes[k], 1000 * step + k, 2.0f);
      ASSERT_TRUE(gpu[k].grad.CopyFromHost(ctx, cpu[k].grad).ok());
    }
    ASSERT_TRUE((*cpu_opt)->Step(config.lr).ok());
    ASSERT_TRUE((*gpu_opt)->Step(config.lr).ok());
  }
  for (size_t k = 0; k < shapes.size(); ++k) {
    ExpectClose(cpu[k].name + " after 3 steps", ToHost(ctx, gpu[k].value), cpu[k].value, tolerance);
  }
  if (config.grad_clip_norm > 0) {
    absl::StatusOr<double> norm = (*gpu_opt)->LastGradNorm();
    ASSERT_TRUE(norm.ok());
    EXPECT_NEAR(*norm, (*cpu_opt)->last_grad_norm(), 1e-9 * (*cpu_opt)->last_grad_norm());
  }
  auto state = (*gpu_opt)->StateToHost();
  ASSERT_TRUE(state.ok()) << state.status();
  const auto cpu_state = (*cpu_opt)->State();
  ASSERT_EQ(state->size(), cpu_state.size());
  for (size_t i = 0; i < cpu_state.size(); ++i) {
    EXPECT_EQ((*state)[i].first, cpu_state[i].first);
    ExpectClose(cpu_state[i].first, (*state)[i].second, *cpu_state[i].second, tolerance);
  }

  // A resume: a new GPU optimizer on the CPU's parameters takes the CPU's
  // state (as a checkpoint holds it) and steps on as the CPU does.
  std::vector<GpuParameter> resumed(shapes.size());
  std::vector<GpuParameter*> resumed_ptrs;
  for (size_t k = 0; k < shapes.size(); ++k) {
    resumed[k].name = cpu[k].name;
    resumed[k].value = ToDevice(ctx, cpu[k].value);
    resumed[k].grad = ToDevice(ctx, cpu[k].grad);
    resumed_ptrs.push_back(&resumed[k]);
  }
  auto resumed_opt = GpuOptimizer::Create(ctx, config, resumed_ptrs);
  ASSERT_TRUE(resumed_opt.ok()) << resumed_opt.status();
  ASSERT_TRUE((*resumed_opt)->LoadStateFromHost(cpu_state, (*cpu_opt)->steps()).ok());
  EXPECT_EQ((*resumed_opt)->steps(), (*cpu_opt)->steps());
  for (size_t k = 0; k < shapes.size(); ++k) {
    cpu[k].grad = RandomTensor(shapes[k], 5000 + k, 2.0f);
    ASSERT_TRUE(resumed[k].grad.CopyFromHost(ctx, cpu[k].grad).ok());
  }
  ASSERT_TRUE((*cpu_opt)->Step(config.lr).ok());
  ASSERT_TRUE((*resumed_opt)->Step(config.lr).ok());
  for (size_t k = 0; k < shapes.size(); ++k) {
    ExpectClose(cpu[k].name + " resumed, 1 step", ToHost(ctx, resumed[k].value), cpu[k].value,
                tolerance);
  }
  if (!cpu_state.empty()) {
    // A state list with one entry left out is refused, naming it.
    auto partial = cpu_state;
    const std::string dropped = partial.back().first;
    partial.pop_back();
    absl::Status s = (*resumed_opt)->LoadStateFromHost(partial, 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(dropped), std::string::npos) << s;
  }
}

// Same formula, same operation order, IEEE rounding on both: bit-identical.
TEST(GpuOptimizer, SgdVariantsMatchCpuExactly) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  OptimizerConfig c;
  c.name = "sgd";
  c.lr = 0.05;
  CompareOptimizer(ctx.get(), c, 0.0);
  c.momentum = 0.9;
  CompareOptimizer(ctx.get(), c, 0.0);
  c.weight_decay = 1e-3;
  CompareOptimizer(ctx.get(), c, 0.0);
  c.nesterov = true;
  CompareOptimizer(ctx.get(), c, 0.0);
}

TEST(GpuOptimizer, AdamWMatchesCpuExactly) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  OptimizerConfig c;
  c.name = "adamw";
  c.lr = 1e-3;
  CompareOptimizer(ctx.get(), c, 0.0);
  c.weight_decay = 0.01;
  CompareOptimizer(ctx.get(), c, 0.0);
}

TEST(GpuOptimizer, ClippingMatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  // The norm is summed in another order, so the coefficient may differ in
  // its last bit.
  OptimizerConfig c;
  c.name = "sgd";
  c.lr = 0.05;
  c.momentum = 0.9;
  c.grad_clip_norm = 1.0;
  CompareOptimizer(ctx.get(), c, kFp32);
  c.name = "adamw";
  c.momentum = 0;
  c.lr = 1e-3;
  CompareOptimizer(ctx.get(), c, kFp32);
}

// BatchNorm2d: cuDNN's statistics in fp32 against the CPU's in double.
TEST(GpuBatchNorm2d, MatchesCpuInTrainingAndEval) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  BatchNorm2d cpu(6);
  std::unique_ptr<GpuLayer> gpu = Mirror(ctx.get(), &cpu, 3);
  ASSERT_NE(gpu, nullptr);
  Tensor x = RandomTensor({4, 6, 5, 7}, 11, 2.0f);
  for (int64_t i = 0; i < x.numel(); ++i) x[i] += 0.5f;  // a mean away from 0
  CompareLayer("BatchNorm2d training", ctx.get(), &cpu, gpu.get(), x, 1e-4);
  // The running statistics moved alike (towards the unbiased variance).
  std::vector<Parameter*> buffers = cpu.Buffers();
  std::vector<GpuParameter*> gpu_buffers = gpu->Buffers();
  ASSERT_EQ(buffers.size(), 2u);
  ASSERT_EQ(gpu_buffers.size(), 2u);
  for (size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_EQ(gpu_buffers[i]->name, buffers[i]->name);
    ExpectClose(buffers[i]->name, ToHost(ctx.get(), gpu_buffers[i]->value), buffers[i]->value,
                1e-5);
  }
  // Eval: the running statistics normalise.
  Tensor y;
  cpu.Forward(x, &y, /*training=*/false);
  GpuTensor gx = ToDevice(ctx.get(), x);
  GpuTensor gy;
  ASSERT_TRUE(gpu->Forward(gx, &gy, /*training=*/false).ok());
  ExpectClose("BatchNorm2d eval", ToHost(ctx.get(), gy), y, 1e-5);
  GpuTensor gdx;
  EXPECT_EQ(gpu->Backward(gy, &gdx).code(), absl::StatusCode::kFailedPrecondition);
  GpuTensor bad = ToDevice(ctx.get(), RandomTensor({2, 5, 3, 3}, 1));
  EXPECT_EQ(gpu->Forward(bad, &gy, true).code(), absl::StatusCode::kInvalidArgument);
  // One value per channel has no variance to train with (the CPU aborts).
  GpuTensor single = ToDevice(ctx.get(), RandomTensor({1, 6, 1, 1}, 2));
  EXPECT_EQ(gpu->Forward(single, &gy, true).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu->Forward(single, &gy, false).ok()) << "eval needs no batch statistics";
}

// Basic blocks and bottlenecks, with the identity and with a downsampling
// shortcut: both paths, the sum, the ReLU, every gradient.
TEST(GpuResidualBlock, BasicAndBottleneckBlocksMatchCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  struct Shape {
    int64_t in, planes, stride;
    bool bottleneck;
  };
  for (const Shape& b : {Shape{4, 4, 1, false}, Shape{4, 8, 2, false}, Shape{8, 4, 1, true},
                         Shape{16, 4, 2, true}}) {
    ResidualBlock cpu(b.in, b.planes, b.stride, b.bottleneck);
    std::unique_ptr<GpuLayer> gpu = Mirror(ctx.get(), &cpu, 20 + b.in);
    ASSERT_NE(gpu, nullptr);
    EXPECT_EQ(gpu->Buffers().size(), cpu.Buffers().size());
    const Tensor x = RandomTensor({2, b.in, 8, 8}, 30 + b.planes);
    CompareLayer(cpu.Describe(), ctx.get(), &cpu, gpu.get(), x, 1e-4);
  }
  // Stochastic depth mirrors too; gpu_model_test checks that a ResNet's
  // blocks skip what the CPU's skip.
  ResidualBlock dropping(4, 4, 1, false, /*drop_prob=*/0.2);
  EXPECT_TRUE(MirrorLayer(ctx.get(), dropping).ok());
}

TEST(GpuGlobalAvgPool2d, MatchesCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  GlobalAvgPool2d cpu;
  std::unique_ptr<GpuLayer> gpu = Mirror(ctx.get(), &cpu, 1);
  ASSERT_NE(gpu, nullptr);
  CompareLayer("AdaptiveAvgPool2d", ctx.get(), &cpu, gpu.get(), RandomTensor({3, 5, 4, 6}, 2),
               1e-6);
}

// The clipping norm's sum of squares: one block for a small tensor, many
// blocks and a second pass for a large one; the CPU's double sum to
// rounding, and the same bits every run.
TEST(GpuKernels, SumOfSquaresOfSmallAndLargeTensors) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  DeviceBuffer out = ctx->allocator().Allocate(2 * sizeof(double)).value();
  DeviceBuffer scratch = ctx->allocator().Allocate(kSumOfSquaresBlocks * sizeof(double)).value();
  for (const int64_t n : {int64_t{0}, int64_t{1000}, int64_t{3'000'001}}) {
    const Tensor host = RandomTensor({std::max<int64_t>(n, 1)}, 5 + n);
    const GpuTensor g = ToDevice(ctx.get(), host);
    // In long double: a plain double sum of 3M squares is itself off by
    // ~1e-12 relative.
    long double exact = 0;
    for (int64_t i = 0; i < n; ++i) exact += static_cast<long double>(host[i]) * host[i];
    const double want = static_cast<double>(exact);
    double* sums = static_cast<double*>(out.data());
    double* partial = static_cast<double*>(scratch.data());
    ASSERT_TRUE(LaunchSumOfSquares(ctx->stream(), g.data(), n, sums, partial).ok());
    ASSERT_TRUE(LaunchSumOfSquares(ctx->stream(), g.data(), n, sums + 1, partial).ok());
    double got[2] = {-1, -1};
    ASSERT_EQ(cudaMemcpyAsync(got, sums, sizeof(got), cudaMemcpyDeviceToHost, ctx->stream()),
              cudaSuccess);
    ASSERT_TRUE(ctx->Synchronize().ok());
    EXPECT_NEAR(got[0], want, 1e-12 * std::max(want, 1.0)) << n;
    EXPECT_EQ(got[0], got[1]) << n;
  }
}

TEST(CachingAllocatorGpu, ReusesFreedBlocksBySize) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  CachingAllocator alloc;
  void* first = nullptr;
  {
    auto a = alloc.Allocate(1000);
    ASSERT_TRUE(a.ok()) << a.status();
    first = a->data();
    EXPECT_EQ(alloc.stats().bytes_in_use, 1024u);
  }
  EXPECT_EQ(alloc.stats().bytes_in_use, 0u);
  EXPECT_EQ(alloc.stats().bytes_cached, 1024u);
  auto b = alloc.Allocate(900);  // same size class
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(alloc.stats().cuda_mallocs, 1);
  EXPECT_EQ(alloc.stats().cache_hits, 1);
  auto c = alloc.Allocate(5000);  // another one
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->data(), first);
  EXPECT_EQ(alloc.stats().cuda_mallocs, 2);
  b->Release();
  alloc.EmptyCache();
  EXPECT_EQ(alloc.stats().bytes_cached, 0u);
}

TEST(CachingAllocatorGpu, ReportsOutOfMemory) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Fp32());
  CachingAllocator alloc;
  auto huge = alloc.Allocate(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // The context still works afterwards.
  auto small = alloc.Allocate(64);
  EXPECT_TRUE(small.ok()) << small.status();
}

}  // namespace
}  // namespace aidn::engine::cuda
