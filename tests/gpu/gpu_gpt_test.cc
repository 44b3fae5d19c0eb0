// The GPU decoder (worker/engine/cuda/gpu_gpt.h) against the CPU decoder,
// the reference every GPU kernel is checked against: logits, loss and
// every gradient of one step, then the weights after 20 AdamW steps, in
// fp32; bf16 within its rounding; repeatability; what it refuses. Skips
// without a device.

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "tests/gpu/gpu_test_util.h"
#include "worker/engine/cuda/flash_attention.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/gpt.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine::cuda {
namespace {

using testing::MaxRelError;
using testing::ToHost;

GptConfig Small(bool bias = true) {
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.block_size = 48;
  c.vocab_size = 97;
  c.bias = bias;
  return c;
}

std::unique_ptr<Gpt> MakeCpu(const GptConfig& config, uint64_t seed = 7) {
  absl::StatusOr<std::unique_ptr<Gpt>> gpt = Gpt::Create(config, seed);
  EXPECT_TRUE(gpt.ok()) << gpt.status();
  return std::move(gpt).value();
}

// Random tokens and their next-token targets: [batch, seq_len] each.
struct Batch {
  std::vector<int32_t> tokens, targets;
};
Batch RandomBatch(const GptConfig& config, int64_t batch, int64_t seq_len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, config.vocab_size - 1);
  Batch b;
  for (int64_t i = 0; i < batch * seq_len; ++i) {
    b.tokens.push_back(tok(rng));
    b.targets.push_back(tok(rng));
  }
  // A token repeated across positions (and sequences): wte's gradient rows
  // that sum several positions.
  b.tokens[0] = 3;
  if (seq_len > 1) b.tokens[1] = 3;
  if (batch > 1) b.tokens[static_cast<size_t>(seq_len)] = 3;
  return b;
}

void ExpectForwardBackwardMatch(const GptConfig& config, int64_t batch, int64_t seq_len) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  absl::StatusOr<std::unique_ptr<GpuGpt>> gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const Batch b = RandomBatch(config, batch, seq_len, 11);

  cpu->ZeroGrad();
  const double cpu_loss =
      cpu->Forward(b.tokens.data(), b.targets.data(), batch, seq_len, /*training=*/true);
  cpu->Backward(0.5);
  ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), batch, seq_len, true).ok());
  absl::StatusOr<double> gpu_loss = (*gpu)->ReadLoss();
  ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
  EXPECT_NEAR(*gpu_loss, cpu_loss, 1e-5 * std::fabs(cpu_loss));
  EXPECT_LE(MaxRelError(ToHost(ctx.get(), (*gpu)->logits()), cpu->logits()), 1e-5);

  std::vector<std::string> ready;
  ASSERT_TRUE((*gpu)
                  ->Backward(0.5,
                             [&ready](const std::vector<GpuParameter*>& ps) {
                               for (const GpuParameter* p : ps) ready.push_back(p->name);
                               return absl::OkStatus();
                             })
                  .ok());
  std::unique_ptr<Gpt> grads = MakeCpu(config);
  grads->ZeroGrad();
  ASSERT_TRUE((*gpu)->CopyGradsTo(grads->Parameters()).ok());
  const std::vector<Parameter*>& want = cpu->Parameters();
  const std::vector<Parameter*>& got = grads->Parameters();
  ASSERT_EQ(ready.size(), want.size()) << "every parameter reported ready once";
  std::set<std::string> names;
  for (const Parameter* p : want) names.insert(p->name);
  EXPECT_EQ(std::set<std::string>(ready.begin(), ready.end()), names);
  // The embeddings come last.
  EXPECT_EQ(std::set<std::string>(ready.end() - 2, ready.end()),
            (std::set<std::string>{"transformer.wte.weight", "transformer.wpe.weight"}));
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = MaxRelError(got[i]->grad, want[i]->grad);
    EXPECT_LE(err, 1e-4) << want[i]->name;
  }
}

TEST(GpuGpt, OneStepMatchesTheCpu) { ExpectForwardBackwardMatch(Small(), 3, 48); }

TEST(GpuGpt, ShortSequencesWithoutBiasesMatchTheCpu) {
  ExpectForwardBackwardMatch(Small(/*bias=*/false), 2, 13);
}

// Stochastic depth: from the same seed the GPU skips the blocks the CPU
// skips (dropout 0: the generator draws nothing else), scales the kept
// branches alike, and reports only the kept blocks' parameters, whose
// gradients match; the skipped ones' stay zero.
TEST(GpuGpt, StochasticDepthSkipsTheCpusBlocks) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  GptConfig config = Small();
  config.n_layer = 4;
  config.stochastic_depth = 0.5;
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  absl::StatusOr<std::unique_ptr<GpuGpt>> gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const Batch b = RandomBatch(config, 2, 24, 5);
  // A seed that skips some blocks and keeps others.
  uint64_t seed = 1;
  for (;; ++seed) {
    cpu->SetSeed(seed);
    cpu->Forward(b.tokens.data(), b.targets.data(), 2, 24, true);
    const size_t unused = cpu->UnusedParameters().size();
    if (unused > 0 && unused < cpu->Parameters().size() / 2) break;
    ASSERT_LT(seed, 100u);
  }
  cpu->SetSeed(seed);
  (*gpu)->SetSeed(seed);
  cpu->ZeroGrad();
  const double cpu_loss = cpu->Forward(b.tokens.data(), b.targets.data(), 2, 24, true);
  cpu->Backward(1.0);
  ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 24, true).ok());
  absl::StatusOr<double> gpu_loss = (*gpu)->ReadLoss();
  ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
  EXPECT_NEAR(*gpu_loss, cpu_loss, 1e-5 * std::fabs(cpu_loss));
  std::set<std::string> want_unused, got_unused;
  for (const Parameter* p : cpu->UnusedParameters()) want_unused.insert(p->name);
  for (const GpuParameter* p : (*gpu)->UnusedParameters()) got_unused.insert(p->name);
  EXPECT_EQ(got_unused, want_unused);
  std::set<std::string> ready;
  ASSERT_TRUE((*gpu)
                  ->Backward(1.0,
                             [&ready](const std::vector<GpuParameter*>& ps) {
                               for (const GpuParameter* p : ps) ready.insert(p->name);
                               return absl::OkStatus();
                             })
                  .ok());
  std::unique_ptr<Gpt> grads = MakeCpu(config);
  grads->ZeroGrad();
  ASSERT_TRUE((*gpu)->CopyGradsTo(grads->Parameters()).ok());
  for (size_t i = 0; i < cpu->Parameters().size(); ++i) {
    const std::string& name = cpu->Parameters()[i]->name;
    const Tensor& got = grads->Parameters()[i]->grad;
    if (want_unused.count(name) > 0) {
      EXPECT_EQ(ready.count(name), 0u) << name << " was skipped but reported";
      for (int64_t j = 0; j < got.numel(); ++j) ASSERT_EQ(got[j], 0.0f) << name;
      continue;
    }
    EXPECT_EQ(ready.count(name), 1u) << name;
    EXPECT_LE(MaxRelError(got, cpu->Parameters()[i]->grad), 1e-4) << name;
  }
  // Evaluation skips nothing.
  ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 24, false).ok());
  EXPECT_TRUE((*gpu)->UnusedParameters().empty());
}

TEST(GpuGpt, TwentyAdamWStepsMatchTheCpu) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  const GptConfig config = Small();
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  absl::StatusOr<std::unique_ptr<GpuGpt>> gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  OptimizerConfig opt;
  opt.name = "adamw";
  opt.lr = 3e-3;
  opt.weight_decay = 0.1;
  opt.decay_matrices_only = true;
  opt.grad_clip_norm = 1.0;
  // With torch's eps of 1e-8 an element whose gradient is rounding noise
  // (the key third of c_attn's bias has a zero gradient in exact
  // arithmetic: softmax ignores a constant added to a row) moves by up to
  // lr whatever its sign, so two correct implementations that sum in
  // different orders drift apart by ~1e-3; 1e-6 keeps such elements still.
  opt.eps = 1e-6;
  auto cpu_opt = Optimizer::Create(opt, cpu->Parameters());
  ASSERT_TRUE(cpu_opt.ok()) << cpu_opt.status();
  auto gpu_opt = GpuOptimizer::Create(ctx.get(), opt, (*gpu)->Parameters());
  ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status();
  for (int step = 0; step < 20; ++step) {
    const Batch b = RandomBatch(config, 2, 32, 100 + static_cast<uint64_t>(step));
    cpu->ZeroGrad();
    cpu->Forward(b.tokens.data(), b.targets.data(), 2, 32, true);
    cpu->Backward();
    ASSERT_TRUE((*cpu_opt)->Step(opt.lr).ok());
    ASSERT_TRUE((*gpu)->ZeroGrad().ok());
    ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 32, true).ok());
    ASSERT_TRUE((*gpu)->Backward().ok());
    ASSERT_TRUE((*gpu_opt)->Step(opt.lr).ok());
  }
  std::unique_ptr<Gpt> after = MakeCpu(config);
  ASSERT_TRUE((*gpu)->CopyWeightsTo(after->Parameters()).ok());
  for (size_t i = 0; i < cpu->Parameters().size(); ++i) {
    const Parameter* want = cpu->Parameters()[i];
    EXPECT_LE(MaxRelError(after->Parameters()[i]->value, want->value), 1e-4) << want->name;
  }
}

TEST(GpuGpt, Bf16StaysWithinItsRounding) {
  GpuContextOptions options;
  options.precision = Precision::kBf16;
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, options);
  const GptConfig config = Small();
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  auto gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const Batch b = RandomBatch(config, 2, 48, 5);
  cpu->ZeroGrad();
  const double want = cpu->Forward(b.tokens.data(), b.targets.data(), 2, 48, true);
  cpu->Backward();
  ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 48, true).ok());
  ASSERT_TRUE((*gpu)->Backward().ok());
  absl::StatusOr<double> got = (*gpu)->ReadLoss();
  ASSERT_TRUE(got.ok()) << got.status();
  // 8-bit mantissas in every product, summed in fp32.
  EXPECT_NEAR(*got, want, 1e-2 * want);
  std::unique_ptr<Gpt> grads = MakeCpu(config);
  grads->ZeroGrad();
  ASSERT_TRUE((*gpu)->CopyGradsTo(grads->Parameters()).ok());
  for (size_t i = 0; i < cpu->Parameters().size(); ++i) {
    const Parameter* p = cpu->Parameters()[i];
    EXPECT_LE(MaxRelError(grads->Parameters()[i]->grad, p->grad), 5e-2) << p->name;
  }
}

// Fused (flash) attention in bf16 against the CPU decoder in fp32, head
// sizes 32, 64 and 128, over sequences of several 64-position tiles with a
// partial last one and of exactly two; and against the GPU's unfused bf16
// path, which rounds the same operands but keeps the probabilities in fp32.
// Gradients by their relative L2 error (bf16's 8-bit mantissas in every
// product; a host emulation of the kernels measured 3e-3 to 8e-3).
TEST(GpuGpt, FusedAttentionInBf16MatchesTheCpu) {
  GpuContextOptions options;
  options.precision = Precision::kBf16;
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, options);
  struct Case {
    int n_embd, heads, t;
  };
  int compared = 0;
  for (const Case& k : {Case{128, 4, 130}, Case{128, 2, 130}, Case{256, 2, 128}}) {
    GptConfig config = Small();
    config.n_embd = k.n_embd;
    config.n_head = k.heads;
    config.block_size = 160;
    const int t = k.t;
    SCOPED_TRACE(absl::StrCat("head size ", config.n_embd / k.heads, ", ", t, " positions"));
    if (!FlashAttentionFits(config.n_embd / k.heads, ctx->device())) {
      std::printf("head size %d: this GPU's shared memory is too small for the fused kernels\n",
                  config.n_embd / k.heads);
      continue;
    }
    std::unique_ptr<Gpt> cpu = MakeCpu(config);
    const Batch b = RandomBatch(config, 2, t, 21);
    cpu->ZeroGrad();
    const double want = cpu->Forward(b.tokens.data(), b.targets.data(), 2, t, true);
    cpu->Backward();
    std::vector<std::vector<Tensor>> grads;
    std::vector<double> losses;
    for (const bool fused : {true, false}) {
      auto gpu = GpuGpt::Create(ctx.get(), *cpu);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      (*gpu)->SetFusedAttention(fused);
      EXPECT_EQ((*gpu)->FusedAttention(), fused);
      ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, t, true).ok());
      ASSERT_TRUE((*gpu)->Backward().ok());
      absl::StatusOr<double> loss = (*gpu)->ReadLoss();
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses.push_back(*loss);
      grads.emplace_back();
      for (GpuParameter* p : (*gpu)->Parameters())
        grads.back().push_back(ToHost(ctx.get(), p->grad));
    }
    ++compared;
    EXPECT_NEAR(losses[0], want, 1e-2 * want);
    EXPECT_NEAR(losses[0], losses[1], 1e-2 * want);
    for (size_t i = 0; i < cpu->Parameters().size(); ++i) {
      const Parameter* p = cpu->Parameters()[i];
      EXPECT_LE(testing::RelL2Error(grads[0][i], p->grad), 3e-2) << p->name;
      EXPECT_LE(testing::RelL2Error(grads[0][i], grads[1][i]), 3e-2) << p->name;
    }
  }
  // Where it does not apply: a head size of 16, dropout, fp16.
  const auto fused = [](GpuContext* c, const GptConfig& config) {
    absl::StatusOr<std::unique_ptr<GpuGpt>> gpu = GpuGpt::Create(c, *MakeCpu(config));
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    return gpu.ok() && (*gpu)->FusedAttention();
  };
  GptConfig nano = Small();
  EXPECT_FALSE(fused(ctx.get(), nano)) << "head size 16";
  nano.n_head = 2;
  nano.dropout = 0.1;
  EXPECT_FALSE(fused(ctx.get(), nano)) << "dropout";
  GpuContextOptions fp16;
  fp16.precision = Precision::kFp16;
  absl::StatusOr<std::unique_ptr<GpuContext>> half = GpuContext::Create(fp16);
  ASSERT_TRUE(half.ok());
  nano.dropout = 0;
  EXPECT_FALSE(fused(half->get(), nano)) << "fp16";
  if (compared == 0) GTEST_SKIP() << "this GPU's shared memory holds none of the fused kernels";
}

TEST(GpuGpt, DropoutRunsRepeatBitForBitAndDiffer) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  GptConfig config = Small();
  config.dropout = 0.2;
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  const Batch b = RandomBatch(config, 2, 40, 9);
  auto run = [&](uint64_t seed, std::vector<Tensor>* grads) -> double {
    auto gpu = GpuGpt::Create(ctx.get(), *cpu);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    (*gpu)->SetSeed(seed);
    EXPECT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 40, true).ok());
    EXPECT_TRUE((*gpu)->Backward().ok());
    for (GpuParameter* p : (*gpu)->Parameters()) grads->push_back(ToHost(ctx.get(), p->grad));
    return (*gpu)->ReadLoss().value();
  };
  std::vector<Tensor> first, again, other;
  const double l1 = run(1, &first);
  const double l2 = run(1, &again);
  const double l3 = run(2, &other);
  EXPECT_EQ(l1, l2);
  EXPECT_NE(l1, l3);
  ASSERT_EQ(first.size(), again.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(MaxRelError(again[i], first[i]), 0.0) << i;
  }
  // Evaluation draws no masks: the CPU's eval loss.
  auto gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok());
  ASSERT_TRUE((*gpu)->Forward(b.tokens.data(), b.targets.data(), 2, 40, false).ok());
  const double want = cpu->Forward(b.tokens.data(), b.targets.data(), 2, 40, false);
  EXPECT_NEAR((*gpu)->ReadLoss().value(), want, 1e-5 * want);
  EXPECT_EQ((*gpu)->Backward().code(), absl::StatusCode::kFailedPrecondition);
}

// Pipeline stages of one block each, chained on one GPU through device
// activations and their gradients: the last stage's loss is the whole
// decoder's bit for bit, and every stage's gradients are the whole
// decoder's (wte's, the sum of the first stage's embedding part and the
// last stage's head part, within the rounding of that one sum).
TEST(GpuGpt, ChainedStagesComputeWhatTheWholeDecoderDoes) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  GptConfig config = Small();
  config.n_layer = 3;
  std::unique_ptr<Gpt> cpu = MakeCpu(config);
  auto whole = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<std::unique_ptr<GpuGpt>> stages;
  for (int s = 0; s < 3; ++s) {
    auto stage = GpuGpt::Create(ctx.get(), *cpu);
    ASSERT_TRUE(stage.ok()) << stage.status();
    ASSERT_TRUE((*stage)->SetStage(s, s + 1).ok());
    stages.push_back(*std::move(stage));
  }
  // wte and wpe + a block; a block; a block, ln_f and the tied wte.
  EXPECT_EQ(stages[0]->StageParameters().size(), 14u);
  EXPECT_EQ(stages[1]->StageParameters().size(), 12u);
  EXPECT_EQ(stages[2]->StageParameters().size(), 15u);
  EXPECT_EQ(stages[1]->Parameters().size(), (*whole)->Parameters().size());

  const Batch b = RandomBatch(config, 2, 16, 5);
  ASSERT_TRUE((*whole)->ZeroGrad().ok());
  ASSERT_TRUE((*whole)->Forward(b.tokens.data(), b.targets.data(), 2, 16, true).ok());
  ASSERT_TRUE((*whole)->Backward().ok());
  for (auto& stage : stages) ASSERT_TRUE(stage->ZeroGrad().ok());
  ASSERT_TRUE(stages[0]->ForwardStage(b.tokens.data(), nullptr, nullptr, 2, 16, true).ok());
  ASSERT_TRUE(stages[1]
                  ->ForwardStage(nullptr, stages[0]->stage_output().data(), nullptr, 2, 16, true)
                  .ok());
  ASSERT_TRUE(
      stages[2]
          ->ForwardStage(nullptr, stages[1]->stage_output().data(), b.targets.data(), 2, 16, true)
          .ok());
  GpuTensor g2, g1;
  ASSERT_TRUE(stages[2]->BackwardStage(nullptr, &g2, 1.0).ok());
  ASSERT_TRUE(stages[1]->BackwardStage(g2.data(), &g1, 1.0).ok());
  ASSERT_TRUE(stages[0]->BackwardStage(g1.data(), nullptr, 1.0).ok());
  auto want = (*whole)->ReadLoss();
  auto got = stages[2]->ReadLoss();
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(*got, *want);

  // CPU decoders to copy the gradients into (CopyGradsTo fills tensors of
  // the parameters' shapes).
  auto with_grads = [&](uint64_t seed) {
    std::unique_ptr<Gpt> m = MakeCpu(config, seed);
    for (Parameter* p : m->Parameters()) p->grad = Tensor(p->value.shape());
    return m;
  };
  std::unique_ptr<Gpt> all = with_grads(8);
  absl::Status copied = (*whole)->CopyGradsTo(all->Parameters());
  ASSERT_TRUE(copied.ok()) << copied;
  std::vector<std::unique_ptr<Gpt>> parts;
  for (auto& stage : stages) {
    parts.push_back(with_grads(9));
    copied = stage->CopyGradsTo(parts.back()->Parameters());
    ASSERT_TRUE(copied.ok()) << copied;
  }
  const std::vector<Parameter*>& names = all->Parameters();
  for (size_t k = 0; k < names.size(); ++k) {
    Tensor sum(names[k]->value.shape());
    for (auto& part : parts) {
      const Tensor& g = part->Parameters()[k]->grad;
      for (int64_t i = 0; i < sum.numel(); ++i) sum[i] += g[i];
    }
    const double tolerance = names[k]->name == "transformer.wte.weight" ? 1e-6 : 0.0;
    EXPECT_LE(MaxRelError(sum, names[k]->grad), tolerance) << names[k]->name;
  }
  // What a stage cannot run is refused.
  EXPECT_EQ(stages[1]->Forward(b.tokens.data(), b.targets.data(), 2, 16, true).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stages[1]->ForwardStage(nullptr, nullptr, nullptr, 2, 16, true).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stages[1]->SetStage(0, 1).code(), absl::StatusCode::kFailedPrecondition);
  // A stage's optimizer takes what the stage holds.
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.1;
  EXPECT_EQ(GpuOptimizer::Create(ctx.get(), opt, stages[1]->Parameters()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(GpuOptimizer::Create(ctx.get(), opt, stages[1]->StageParameters()).ok());
  auto bad = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)->SetStage(2, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*bad)->SetStage(0, 4).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GpuGpt, RefusesWhatItCannotRun) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  std::unique_ptr<Gpt> cpu = MakeCpu(Small());
  cpu->SetActivationCheckpointing(true);
  EXPECT_EQ(GpuGpt::Create(ctx.get(), *cpu).status().code(), absl::StatusCode::kUnimplemented);
  cpu->SetActivationCheckpointing(false);
  auto gpu = GpuGpt::Create(ctx.get(), *cpu);
  ASSERT_TRUE(gpu.ok());
  Batch b = RandomBatch(Small(), 1, 49, 1);
  EXPECT_EQ((*gpu)->Forward(b.tokens.data(), b.targets.data(), 1, 49, true).code(),
            absl::StatusCode::kInvalidArgument)
      << "longer than block_size";
  b = RandomBatch(Small(), 1, 8, 1);
  b.tokens[5] = 97;
  const absl::Status bad = (*gpu)->Forward(b.tokens.data(), b.targets.data(), 1, 8, true);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("token 97 at 5"), std::string::npos) << bad;
  EXPECT_EQ((*gpu)->Backward().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace aidn::engine::cuda
