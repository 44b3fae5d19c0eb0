// GpuSession, the trainer's view of the GPU engine: what it says without a
// device, and (with one) one rank's steps against the CPU path, the weights
// and optimizer state back on the host, and a resume from them.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "worker/engine/data.h"
#include "worker/engine/device.h"
#include "worker/engine/gpt.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Sequential> Mlp(uint64_t seed) {
  auto model = BuildModel(ModelConfig(), seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(model).value() : nullptr;
}

OptimizerConfig SgdMomentum() {
  OptimizerConfig c;
  c.name = "sgd";
  c.lr = 0.01;
  c.momentum = 0.9;
  return c;
}

struct Batch {
  Tensor images;
  std::vector<int32_t> labels;
};

Batch RandomBatch(uint64_t seed) {
  Batch b;
  b.images = Tensor({64, 1, 28, 28});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t i = 0; i < b.images.numel(); ++i) {
    float v = u(rng);
    while (v == 0.0f) v = u(rng);
    b.images[i] = v;
  }
  b.labels.resize(64);
  for (auto& l : b.labels) l = static_cast<int32_t>(rng() % 10);
  return b;
}

// max |got - want| and max |want| over the elements.
std::pair<double, double> MaxDiffAndRef(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  double diff = 0, ref = 0;
  for (int64_t j = 0; j < want.numel() && j < got.numel(); ++j) {
    diff = std::max(diff, static_cast<double>(std::fabs(got[j] - want[j])));
    ref = std::max(ref, static_cast<double>(std::fabs(want[j])));
  }
  return {diff, ref};
}

TEST(GpuSession, WithoutADeviceCreateSaysWhy) {
  DeviceInventory inventory = DiscoverDevices();
  if (!inventory.gpus.empty()) GTEST_SKIP() << "this machine has a GPU";
  auto model = Mlp(1);
  ASSERT_NE(model, nullptr);
  absl::StatusOr<std::unique_ptr<GpuSession>> session =
      GpuSession::Create(GpuSessionOptions(), *model, SgdMomentum());
  ASSERT_FALSE(session.ok());
  // Without CUDA in the build: UNIMPLEMENTED; with it but no device:
  // FAILED_PRECONDITION naming what the driver said.
  EXPECT_THAT(session.status().code(), ::testing::AnyOf(absl::StatusCode::kFailedPrecondition,
                                                        absl::StatusCode::kUnimplemented));
  EXPECT_THAT(session.status().message(), HasSubstr("device: gpu"));
}

TEST(GpuSession, RefusesARankOutsideTheWorld) {
  auto model = Mlp(1);
  ASSERT_NE(model, nullptr);
  GpuSessionOptions o;
  o.rank = 2;
  o.world_size = 2;
  absl::StatusOr<std::unique_ptr<GpuSession>> session =
      GpuSession::Create(o, *model, SgdMomentum());
  ASSERT_FALSE(session.ok());
  EXPECT_THAT(session.status().code(), ::testing::AnyOf(absl::StatusCode::kInvalidArgument,
                                                        absl::StatusCode::kUnimplemented));
}

TEST(GpuSession, OneRankTrainsAsTheCpuDoesAndResumesFromItsState) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  auto cpu = Mlp(5);
  ASSERT_NE(cpu, nullptr);
  auto session = GpuSession::Create(GpuSessionOptions(), *cpu, SgdMomentum());
  ASSERT_TRUE(session.ok()) << session.status();
  std::printf("%s\n", (*session)->Describe().c_str());
  auto cpu_opt = Optimizer::Create(SgdMomentum(), cpu->Parameters());
  ASSERT_TRUE(cpu_opt.ok()) << cpu_opt.status();

  Tensor logits, grad;
  double max_rel = 0;
  for (int step = 0; step < 20; ++step) {
    const Batch b = RandomBatch(100 + step % 4);
    cpu->ZeroGrad();
    cpu->Forward(b.images, &logits, true);
    const double cpu_loss = SoftmaxCrossEntropy(logits, b.labels, &grad);
    cpu->Backward(grad);
    ASSERT_TRUE((*cpu_opt)->Step(0.01).ok());
    absl::StatusOr<double> gpu_loss = (*session)->Step(b.images, b.labels, 0.01);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    max_rel = std::max(max_rel, std::fabs(*gpu_loss - cpu_loss) / cpu_loss);
  }
  std::printf("max rel loss difference over 20 steps: %.3g\n", max_rel);
  EXPECT_LE(max_rel, 1e-4);
  EXPECT_EQ((*session)->optimizer_steps(), 20);
  EXPECT_EQ((*session)->last_allreduce_seconds(), 0.0) << "one rank: no allreduce";
  // The model state's bytes on the device: weights, gradients and the
  // momentum buffers are each 4 bytes a parameter; no buffers; no
  // gradient bytes sent.
  const GpuSession::StateMemory memory = (*session)->memory();
  const int64_t weights = 4 * cpu->ParameterCount();
  EXPECT_EQ(memory.parameters, weights);
  EXPECT_EQ(memory.gradients, weights);
  EXPECT_EQ(memory.optimizer_state, weights);
  EXPECT_EQ(memory.buffers, 0);
  EXPECT_EQ((*session)->last_bytes_sent(), 0);

  // Weights and state back on the host, named as the CPU's.
  auto copy = Mlp(9);
  ASSERT_TRUE((*session)->CopyParametersTo(copy->Parameters()).ok());
  auto state = (*session)->OptimizerState();
  ASSERT_TRUE(state.ok()) << state.status();
  const auto cpu_state = (*cpu_opt)->State();
  ASSERT_EQ(state->size(), cpu_state.size());
  for (size_t i = 0; i < cpu_state.size(); ++i) EXPECT_EQ((*state)[i].first, cpu_state[i].first);

  // A resume: a new session from the copied weights and state steps on as
  // the first one does.
  auto resumed = GpuSession::Create(GpuSessionOptions(), *copy, SgdMomentum());
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  std::vector<std::pair<std::string, const Tensor*>> entries;
  for (const auto& [name, t] : *state) entries.emplace_back(name, &t);
  ASSERT_TRUE((*resumed)->LoadOptimizerState(entries, 20).ok());
  const Batch b = RandomBatch(7);
  absl::StatusOr<double> a = (*session)->Step(b.images, b.labels, 0.01);
  absl::StatusOr<double> r = (*resumed)->Step(b.images, b.labels, 0.01);
  ASSERT_TRUE(a.ok() && r.ok());
  EXPECT_EQ(*a, *r) << "same weights, same state, same batch";
}

// A ResNet-18 session against the CPU model: losses over 2 SGD steps, and
// the running statistics it hands back for checkpoints and evaluation.
// (Longer runs drift apart as rounding moves activations across ReLUs:
// the CPU model against itself nudged by one ulp differs by 1e-3 in loss
// after 5 steps, by 5e-6 after 2.)
TEST(GpuSession, OneRankTrainsAResNetAsTheCpuDoesAndHandsBackItsStatistics) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  ModelConfig resnet;
  resnet.name = "resnet18";
  auto cpu = BuildModel(resnet, 5);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto session = GpuSession::Create(GpuSessionOptions(), **cpu, SgdMomentum());
  ASSERT_TRUE(session.ok()) << session.status();
  auto cpu_opt = Optimizer::Create(SgdMomentum(), (*cpu)->Parameters());
  ASSERT_TRUE(cpu_opt.ok());
  Tensor logits, grad;
  double max_rel = 0;
  for (int step = 0; step < 2; ++step) {
    const Batch b = RandomBatch(200 + step);
    (*cpu)->ZeroGrad();
    (*cpu)->Forward(b.images, &logits, true);
    const double cpu_loss = SoftmaxCrossEntropy(logits, b.labels, &grad);
    (*cpu)->Backward(grad);
    ASSERT_TRUE((*cpu_opt)->Step(0.01).ok());
    absl::StatusOr<double> gpu_loss = (*session)->Step(b.images, b.labels, 0.01);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    max_rel = std::max(max_rel, std::fabs(*gpu_loss - cpu_loss) / cpu_loss);
  }
  std::printf("max rel loss difference over 2 steps: %.3g\n", max_rel);
  EXPECT_LE(max_rel, 1e-4);
  auto copy = BuildModel(resnet, 9);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE((*session)->CopyBuffersTo((*copy)->Buffers()).ok());
  ASSERT_EQ((*copy)->Buffers().size(), (*cpu)->Buffers().size());
  for (size_t i = 0; i < (*cpu)->Buffers().size(); ++i) {
    const auto [diff, ref] =
        MaxDiffAndRef((*copy)->Buffers()[i]->value, (*cpu)->Buffers()[i]->value);
    // Against max(ref, 1): a running mean can be ~1e-4 everywhere.
    EXPECT_LE(diff, 1e-3 * std::max(ref, 1.0)) << (*cpu)->Buffers()[i]->name;
  }
  // Evaluation on the device (eval mode: the running statistics) against
  // the CPU model's: the mean loss, and the right predictions but for a
  // row whose two largest logits rounding may swap.
  const Batch eval = RandomBatch(300);
  (*cpu)->Forward(eval.images, &logits, /*training=*/false);
  const double cpu_loss = SoftmaxCrossEntropy(logits, eval.labels, nullptr);
  const int64_t cpu_correct = CountCorrect(logits, eval.labels);
  absl::StatusOr<GpuSession::EvalResult> on_gpu =
      (*session)->Evaluate(MicroBatch{&eval.images, &eval.labels, std::nullopt});
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  std::printf("eval: loss %.6f vs CPU %.6f, %lld vs %lld right\n", on_gpu->mean_loss, cpu_loss,
              static_cast<long long>(on_gpu->correct), static_cast<long long>(cpu_correct));
  EXPECT_NEAR(on_gpu->mean_loss, cpu_loss, 1e-3 * cpu_loss);
  EXPECT_NEAR(static_cast<double>(on_gpu->correct), static_cast<double>(cpu_correct), 1.0);
  EXPECT_EQ((*session)->Evaluate(MicroBatch{}).status().code(), absl::StatusCode::kInvalidArgument);
}

GptConfig TinyGpt() {
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.block_size = 16;
  c.vocab_size = 256;
  return c;
}

TEST(GpuSession, GptWithoutADeviceSaysWhyAndRefusesCudaGraphs) {
  auto gpt = Gpt::Create(TinyGpt(), 1);
  ASSERT_TRUE(gpt.ok());
  GpuSessionOptions o;
  o.cuda_graphs = true;
  absl::StatusOr<std::unique_ptr<GpuSession>> session =
      GpuSession::CreateForGpt(o, **gpt, OptimizerConfig());
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnimplemented) << session.status();
  // Refused for its graphs wherever the binary has a GPU engine at all.
  if (GpuSessionAvailable()) {
    EXPECT_THAT(session.status().message(), HasSubstr("cuda_graphs")) << session.status();
  }
  DeviceInventory inventory = DiscoverDevices();
  if (!inventory.gpus.empty()) return;
  session = GpuSession::CreateForGpt(GpuSessionOptions(), **gpt, OptimizerConfig());
  ASSERT_FALSE(session.ok());
  EXPECT_THAT(session.status().message(), HasSubstr("device: gpu"));
}

// A GPT in fp16: dynamic loss scaling as the MLP's (GradScaler's initial
// scale, steps that count towards growth), losses within fp16's rounding
// of the CPU decoder's; a scale so large that the gradients overflow skips
// the update and halves the scale.
TEST(GpuSession, AGptTrainsInFp16WithItsLossScale) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  auto cpu = Gpt::Create(TinyGpt(), 3);
  ASSERT_TRUE(cpu.ok());
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.lr = 1e-3;
  GpuSessionOptions o;
  o.precision = "fp16";
  auto session = GpuSession::CreateForGpt(o, **cpu, adamw);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->loss_scale_state().has_value());
  EXPECT_EQ((*session)->loss_scale_state()->scale, 65536.0);
  // A scale this small model's gradients cannot overflow at: every step
  // updates, as the CPU's do.
  ASSERT_TRUE((*session)->RestoreLossScale({.scale = 1024, .growth_tracker = 0}).ok());
  auto cpu_opt = Optimizer::Create(adamw, (*cpu)->Parameters());
  ASSERT_TRUE(cpu_opt.ok());
  std::mt19937_64 rng(5);
  std::vector<int32_t> tokens, targets;
  auto next_batch = [&] {
    tokens.clear();
    targets.clear();
    for (int i = 0; i < 3 * 16; ++i) {
      tokens.push_back(static_cast<int32_t>(rng() % 256));
      targets.push_back(static_cast<int32_t>(rng() % 256));
    }
  };
  MicroBatch micro;
  micro.tokens = &tokens;
  micro.labels = &targets;
  micro.seq_len = 16;
  double max_rel = 0;
  for (int step = 0; step < 3; ++step) {
    next_batch();
    (*cpu)->ZeroGrad();
    const double cpu_loss = (*cpu)->Forward(tokens.data(), targets.data(), 3, 16, true);
    (*cpu)->Backward(1.0);
    ASSERT_TRUE((*cpu_opt)->Step(adamw.lr).ok());
    absl::StatusOr<double> gpu_loss = (*session)->Step({micro}, adamw.lr);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    EXPECT_FALSE((*session)->last_step_skipped()) << "step " << step;
    max_rel = std::max(max_rel, std::fabs(*gpu_loss - cpu_loss) / cpu_loss);
  }
  std::printf("fp16 GPT: max rel loss difference over 3 steps %.3g\n", max_rel);
  EXPECT_LE(max_rel, 1e-2);
  EXPECT_EQ((*session)->loss_scale_state()->growth_tracker, 3);
  // 2^40: the scaled loss gradient, finite in fp32, overflows when the LM
  // head's product rounds it to fp16.
  ASSERT_TRUE((*session)->RestoreLossScale({.scale = 0x1p40, .growth_tracker = 0}).ok());
  next_batch();
  ASSERT_TRUE((*session)->Step({micro}, adamw.lr).ok());
  EXPECT_TRUE((*session)->last_step_skipped());
  EXPECT_EQ((*session)->loss_scale_state()->scale, 0x1p39);
  EXPECT_EQ((*session)->optimizer_steps(), 3) << "the skipped step is not counted";
}

// A GPT session's steps of two micro-batches each against the CPU decoder
// accumulating the same two with AdamW (decay on matrices only, clipping):
// losses and weights within 1e-4 after 10 steps.
TEST(GpuSession, OneRankTrainsAGptAsTheCpuDoes) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  auto cpu = Gpt::Create(TinyGpt(), 3);
  ASSERT_TRUE(cpu.ok());
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.lr = 1e-3;
  adamw.weight_decay = 0.1;
  adamw.decay_matrices_only = true;
  adamw.grad_clip_norm = 1.0;
  // Not torch's 1e-8: elements whose gradient is rounding noise would move
  // by up to lr in either direction (gpu_gpt_test says more).
  adamw.eps = 1e-6;
  auto session = GpuSession::CreateForGpt(GpuSessionOptions(), **cpu, adamw);
  ASSERT_TRUE(session.ok()) << session.status();
  std::printf("%s\n", (*session)->Describe().c_str());
  auto cpu_opt = Optimizer::Create(adamw, (*cpu)->Parameters());
  ASSERT_TRUE(cpu_opt.ok()) << cpu_opt.status();
  std::mt19937_64 rng(17);
  double max_rel = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<int32_t> tokens[2], targets[2];
    for (int m = 0; m < 2; ++m) {
      for (int i = 0; i < 3 * 16; ++i) {
        tokens[m].push_back(static_cast<int32_t>(rng() % 256));
        targets[m].push_back(static_cast<int32_t>(rng() % 256));
      }
    }
    (*cpu)->ZeroGrad();
    double cpu_loss = 0;
    for (int m = 0; m < 2; ++m) {
      cpu_loss += (*cpu)->Forward(tokens[m].data(), targets[m].data(), 3, 16, true) / 2;
      (*cpu)->Backward(0.5);
    }
    ASSERT_TRUE((*cpu_opt)->Step(adamw.lr).ok());
    std::vector<MicroBatch> micro(2);
    for (int m = 0; m < 2; ++m) {
      micro[m].tokens = &tokens[m];
      micro[m].labels = &targets[m];
      micro[m].seq_len = 16;
    }
    absl::StatusOr<double> gpu_loss = (*session)->Step(micro, adamw.lr);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    max_rel = std::max(max_rel, std::fabs(*gpu_loss - cpu_loss) / cpu_loss);
  }
  EXPECT_LE(max_rel, 1e-4);
  EXPECT_EQ((*session)->optimizer_steps(), 10);
  auto copy = Gpt::Create(TinyGpt(), 99);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE((*session)->CopyParametersTo((*copy)->Parameters()).ok());
  for (size_t i = 0; i < (*cpu)->Parameters().size(); ++i) {
    const auto [diff, ref] =
        MaxDiffAndRef((*copy)->Parameters()[i]->value, (*cpu)->Parameters()[i]->value);
    EXPECT_LE(diff, 1e-4 * ref) << (*cpu)->Parameters()[i]->name;
  }
  // Evaluation on the device against the CPU decoder's: the mean loss per
  // token and the next-token hits.
  std::vector<int32_t> tokens, targets;
  for (int i = 0; i < 4 * 16; ++i) {
    tokens.push_back(static_cast<int32_t>(rng() % 256));
    targets.push_back(static_cast<int32_t>(rng() % 256));
  }
  const double cpu_eval = (*cpu)->Forward(tokens.data(), targets.data(), 4, 16, false);
  const int64_t cpu_correct = CountCorrect((*cpu)->WholeLogits(), targets);
  MicroBatch eval;
  eval.tokens = &tokens;
  eval.labels = &targets;
  eval.seq_len = 16;
  absl::StatusOr<GpuSession::EvalResult> on_gpu = (*session)->Evaluate(eval);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  EXPECT_NEAR(on_gpu->mean_loss, cpu_eval, 1e-3 * cpu_eval);
  EXPECT_NEAR(static_cast<double>(on_gpu->correct), static_cast<double>(cpu_correct), 1.0);
}

// fp16: the session's loss scaler state is what a checkpoint keeps, and a
// new session restores it (a bad one is refused and changes nothing);
// fp32 has none to keep or restore.
TEST(GpuSession, Fp16HasALossScaleThatANewSessionRestores) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  auto cpu = Mlp(5);
  ASSERT_NE(cpu, nullptr);
  auto fp32 = GpuSession::Create(GpuSessionOptions(), *cpu, SgdMomentum());
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_FALSE((*fp32)->loss_scale_state().has_value());
  EXPECT_EQ((*fp32)->RestoreLossScale({.scale = 4, .growth_tracker = 0}).code(),
            absl::StatusCode::kFailedPrecondition);

  GpuSessionOptions o;
  o.precision = "fp16";
  auto first = GpuSession::Create(o, *cpu, SgdMomentum());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->loss_scale_state().has_value());
  EXPECT_EQ((*first)->loss_scale_state()->scale, 65536.0) << "torch GradScaler's initial scale";
  for (int step = 0; step < 3; ++step) {
    const Batch b = RandomBatch(100 + step);
    ASSERT_TRUE((*first)->Step(b.images, b.labels, 0.01).ok());
  }
  const LossScaleState saved = *(*first)->loss_scale_state();
  std::printf("after 3 steps: scale %g, growth tracker %d\n", saved.scale, saved.growth_tracker);
  EXPECT_TRUE(saved.growth_tracker == 3 || saved.scale < 65536.0)
      << "three steps either counted towards growth or backed the scale off";

  auto resumed = GpuSession::Create(o, *cpu, SgdMomentum());
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ((*resumed)->RestoreLossScale({.scale = saved.scale, .growth_tracker = 1 << 20}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*resumed)->loss_scale_state()->scale, 65536.0) << "a refused state changes nothing";
  ASSERT_TRUE((*resumed)->RestoreLossScale(saved).ok());
  EXPECT_EQ((*resumed)->loss_scale_state()->scale, saved.scale);
  EXPECT_EQ((*resumed)->loss_scale_state()->growth_tracker, saved.growth_tracker);
}

}  // namespace
}  // namespace aidn::engine
