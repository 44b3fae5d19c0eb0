// GpuFsdpReducer (ZeRO-2, FSDP shard_grad_op and full_shard) on one GPU,
// with a real NcclCommunicator of world size 1 through the KV rendezvous.
// Over one rank the reduce-scatters and all-gathers are exact, so a model
// trained through the units' hooks must match one trained without sharding
// bit for bit (one micro-batch a step); the pools, the full gathers for
// evaluation and the layout checks are pinned down too. Two ranks need two
// GPUs. Skips without a device.
#include "worker/engine/cuda/gpu_fsdp.h"

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/nccl_test_util.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/gpt.h"
#include "worker/engine/half.h"
#include "worker/engine/host_shards.h"
#include "worker/engine/model.h"

namespace aidn::engine::cuda {
namespace {

using ::aidn::engine::testing::WorldOfOne;
using ::testing::HasSubstr;
using testing::RandomTensor;

constexpr Sharding kShardings[] = {Sharding::kGradients, Sharding::kShardGradOp,
                                   Sharding::kFullShard};

const char* Name(Sharding s) {
  return s == Sharding::kGradients     ? "zero2"
         : s == Sharding::kShardGradOp ? "shard_grad_op"
                                       : "full_shard";
}

GpuContextOptions Reproducible() {
  GpuContextOptions o;
  o.benchmark_convolutions = false;
  return o;
}

// The reducer's hooks, as GpuSession sets them (session_setup.h).
void Hook(GpuTrainer* trainer, GpuModel* model, GpuFsdpReducer* r, NcclCommunicator* nccl,
          GpuContext* ctx) {
  model->SetUnitHooks(r);
  trainer->SetBeforeForward([r] { return r->BeginStep(); });
  trainer->SetBeforeLastBackward(
      [r](const std::vector<bool>& used, const std::vector<GpuParameter*>&) {
        return r->BeginBackward(used);
      });
  trainer->SetAfterBackward([r] { return r->AfterBackward(); });
  trainer->SetWait([r](cudaEvent_t done) { return r->Wait(done); });
  trainer->SetCheckWait([r](cudaEvent_t event) { return r->WaitForCheck(event); });
  trainer->optimizer().SetNormAllReduce(
      [nccl, ctx](double* total) { return nccl->AllReduceDoubleSumOn(ctx->stream(), total, 1); });
  trainer->SetOverflowAllReduce(
      [nccl, ctx](int32_t* flag) { return nccl->AllReduceIntMaxOn(ctx->stream(), flag, 1); });
}

// The CPU model's weights after the GPU models' (the sharded one gathered
// first), element for element.
void ExpectSameWeights(const ModelConfig& config, const GpuModel& want, GpuModel* got,
                       GpuFsdpReducer* r, double tolerance) {
  auto a = BuildModel(config, 8);
  auto b = BuildModel(config, 9);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(want.CopyParametersTo((*a)->Parameters()).ok());
  ASSERT_TRUE(r->GatherFullParameters().ok());
  ASSERT_TRUE(got->CopyParametersTo((*b)->Parameters()).ok());
  r->ReleaseFullParameters();
  for (size_t k = 0; k < (*a)->Parameters().size(); ++k) {
    EXPECT_LE(testing::MaxRelError((*b)->Parameters()[k]->value, (*a)->Parameters()[k]->value),
              tolerance)
        << (*a)->Parameters()[k]->name;
  }
}

// A model of `cpu` under FSDP or ZeRO-2 over one rank with `options` (the
// layout HostShards::ForUnits gives), and a trainer of `opt` over its
// shards, hooked as GpuSession hooks it.
struct Sharded {
  std::unique_ptr<GpuModel> model;
  std::unique_ptr<HostShards> layout;
  std::unique_ptr<GpuFsdpReducer> reducer;
  std::unique_ptr<GpuTrainer> trainer;
};
absl::StatusOr<Sharded> Shard(GpuContext* ctx, NcclCommunicator* nccl, const Sequential& cpu,
                              const GpuFsdpOptions& options, const OptimizerConfig& opt) {
  Sharded s;
  AIDN_ASSIGN_OR_RETURN(s.model, GpuModel::Create(ctx, cpu));
  AIDN_ASSIGN_OR_RETURN(s.layout, HostShards::ForUnits(cpu.Units(), cpu.Parameters(), 0, 1));
  AIDN_ASSIGN_OR_RETURN(s.reducer, GpuFsdpReducer::Create(ctx, nccl, s.layout->map(),
                                                          s.model->Parameters(), options));
  AIDN_ASSIGN_OR_RETURN(
      s.trainer, GpuTrainer::Create(ctx, s.model.get(), opt, &s.reducer->shard_parameters()));
  Hook(s.trainer.get(), s.model.get(), s.reducer.get(), nccl, ctx);
  return s;
}

struct Training {
  ModelConfig config;
  OptimizerConfig opt;
  int micro = 1;  // micro-batches per step
  int steps = 5;
};

// Trains `run` plainly and through every sharding over one rank.
void TrainBothWays(const Training& run, double tolerance) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto cpu = BuildModel(run.config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  for (const Sharding sharding : kShardings) {
    SCOPED_TRACE(Name(sharding));
    auto plain = GpuModel::Create(ctx.get(), **cpu);
    ASSERT_TRUE(plain.ok());
    auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), run.opt);
    ASSERT_TRUE(plain_trainer.ok());
    absl::StatusOr<Sharded> s = Shard(
        ctx.get(), nccl.get(), **cpu,
        {.sharding = sharding, .find_unused_parameters = run.config.stochastic_depth > 0}, run.opt);
    ASSERT_TRUE(s.ok()) << s.status();
    GpuFsdpReducer* reducer = s->reducer.get();
    const std::vector<GpuParameter*>& shards = reducer->shard_parameters();
    ASSERT_EQ(shards.size(), s->layout->map().shards().size());
    for (size_t k = 0; k < shards.size(); ++k) {
      EXPECT_EQ(shards[k]->name, s->layout->map().shards()[k]->name);
    }

    const int64_t sequence = nccl->sequence();
    for (int step = 0; step < run.steps; ++step) {
      std::vector<Tensor> images;
      std::vector<std::vector<int32_t>> labels(static_cast<size_t>(run.micro));
      for (int m = 0; m < run.micro; ++m) {
        images.push_back(RandomTensor({16, 1, 28, 28}, 300 + 10 * step + m));
        for (int j = 0; j < 16; ++j) labels[static_cast<size_t>(m)].push_back((step + j * 3) % 10);
      }
      std::vector<MicroBatch> micro;
      for (int m = 0; m < run.micro; ++m) {
        micro.push_back({&images[static_cast<size_t>(m)], &labels[static_cast<size_t>(m)],
                         static_cast<uint64_t>(40 + step)});
      }
      absl::StatusOr<double> a = (*plain_trainer)->Step(micro, run.opt.lr);
      absl::StatusOr<double> b = s->trainer->Step(micro, run.opt.lr);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      if (tolerance == 0) {
        EXPECT_EQ(*a, *b) << "step " << step;
      }
      EXPECT_GT(reducer->last_bytes_sent(), 0);
      EXPECT_GT(reducer->last_comm_seconds(), 0.0);
    }
    EXPECT_GT(nccl->sequence(), sequence) << "the collectives are counted";
    ExpectSameWeights(run.config, **plain, s->model.get(), reducer, tolerance);
    // Memory: ZeRO-2 keeps whole units, FSDP slices (one rank: the same
    // floats, padding included); the pools held buffers during the step.
    const GpuFsdpReducer::Memory m = reducer->memory();
    EXPECT_GT(m.weights, 0);
    EXPECT_EQ(m.gradients, m.weights);
    EXPECT_GT(m.buffers, 0);
  }
}

TEST(GpuFsdp, EveryShardingOverOneRankTrainsBitForBitAsWithoutSharding) {
  Training run;
  run.config.name = "cnn";
  run.opt.name = "adamw";
  run.opt.lr = 1e-3;
  run.opt.weight_decay = 0.1;
  run.opt.decay_matrices_only = true;
  run.opt.grad_clip_norm = 0.5;
  TrainBothWays(run, 0.0);
}

// Accumulation: each micro-batch's gradients reduce-scattered and summed
// in the shards (the plain trainer sums them in place): the same up to the
// order of one addition.
TEST(GpuFsdp, AccumulatedMicroBatchesSumInTheShards) {
  Training run;
  run.config.name = "mlp";
  run.config.hidden_sizes = {64, 32};
  run.opt.name = "sgd";
  run.opt.lr = 0.05;
  run.opt.momentum = 0.9;
  run.micro = 3;
  TrainBothWays(run, 1e-6);
}

// Stochastic depth: the skipped blocks' zero gradients reduce-scattered,
// their shards left alone as the plain trainer leaves the parameters.
TEST(GpuFsdp, SkippedBlocksAreLeftAloneAsWithoutSharding) {
  Training run;
  run.config.name = "resnet18";
  run.config.stochastic_depth = 0.5;
  run.opt.name = "sgd";
  run.opt.lr = 0.05;
  run.opt.momentum = 0.9;
  run.steps = 4;
  TrainBothWays(run, 0.0);
}

// full_shard gathers a unit for its forward, frees it, gathers it again
// for its backward: its pools hold a few units at once; shard_grad_op keeps
// every unit from forward to backward.
TEST(GpuFsdp, FullShardHoldsFewerGatheredUnitsThanShardGradOp) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig config;
  config.name = "mlp";
  config.hidden_sizes = {256, 256, 256, 256, 256};
  auto cpu = BuildModel(config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.01;
  int64_t buffers[2] = {0, 0};
  int64_t sent[2] = {0, 0};
  int i = 0;
  for (const Sharding sharding : {Sharding::kFullShard, Sharding::kShardGradOp}) {
    absl::StatusOr<Sharded> s = Shard(ctx.get(), nccl.get(), **cpu, {.sharding = sharding}, opt);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->reducer->num_units(), 7) << "an empty root and six Linear layers";
    const Tensor images = RandomTensor({8, 1, 28, 28}, 5);
    const std::vector<int32_t> labels = {1, 2, 3, 4, 5, 6, 7, 8};
    ASSERT_TRUE(s->trainer->Step(images, labels, opt.lr).ok());
    buffers[i] = s->reducer->memory().buffers;
    sent[i] = s->reducer->last_bytes_sent();
    ++i;
  }
  EXPECT_LT(buffers[0], buffers[1]);
  // full_shard gathers every unit twice, shard_grad_op once.
  EXPECT_GT(sent[0], sent[1]);
}

// Evaluation and checkpoints read whole weights: GatherFullParameters puts
// every unit in place until its release; a backward meanwhile is refused.
TEST(GpuFsdp, GatherFullParametersForEvaluation) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig config;
  config.name = "cnn";
  auto cpu = BuildModel(config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  absl::StatusOr<Sharded> s =
      Shard(ctx.get(), nccl.get(), **cpu, {.sharding = Sharding::kFullShard}, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  GpuModel* model = s->model.get();
  GpuFsdpReducer* reducer = s->reducer.get();
  // Between steps FSDP holds no whole weights.
  for (const GpuParameter* p : model->Parameters()) EXPECT_EQ(p->value.data(), nullptr);
  ASSERT_TRUE(reducer->GatherFullParameters().ok());
  EXPECT_EQ(reducer->GatherFullParameters().code(), absl::StatusCode::kFailedPrecondition);
  auto copy = BuildModel(config, 9);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE(model->CopyParametersTo((*copy)->Parameters()).ok());
  for (size_t k = 0; k < (*cpu)->Parameters().size(); ++k) {
    EXPECT_EQ(testing::MaxRelError((*copy)->Parameters()[k]->value, (*cpu)->Parameters()[k]->value),
              0.0);
  }
  // An eval-mode forward runs on the gathered weights, with no collective.
  ASSERT_TRUE(nccl->Wait("the gathers").ok());
  const int64_t sequence = nccl->sequence();
  GpuTensor input, logits;
  ASSERT_TRUE(input.CopyFromHost(ctx.get(), RandomTensor({4, 1, 28, 28}, 2)).ok());
  ASSERT_TRUE(model->Forward(input, &logits, /*training=*/false).ok());
  ASSERT_TRUE(ctx->Synchronize().ok());
  // The communicator counts what it queued once waited for.
  ASSERT_TRUE(nccl->Wait("the evaluation's collectives").ok());
  EXPECT_EQ(nccl->sequence(), sequence);
  GpuTensor grad;
  ASSERT_TRUE(grad.CopyFromHost(ctx.get(), RandomTensor({4, 10}, 3)).ok());
  absl::Status backward = model->Backward(grad);
  EXPECT_EQ(backward.code(), absl::StatusCode::kFailedPrecondition) << backward;
  reducer->ReleaseFullParameters();
  for (const GpuParameter* p : model->Parameters()) EXPECT_EQ(p->value.data(), nullptr);
}

// The GPT decoder's units (the root: embeddings and ln_f; one per block),
// full_shard against the plain decoder with AdamW, step by step.
TEST(GpuFsdp, AGptTrainsBitForBitUnderFullShard) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  GptConfig config;
  config.n_layer = 3;
  config.n_head = 4;
  config.n_embd = 64;
  config.block_size = 32;
  config.vocab_size = 97;
  auto cpu = Gpt::Create(config, 7);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto plain = GpuGpt::Create(ctx.get(), **cpu);
  auto sharded = GpuGpt::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok() && sharded.ok());
  auto layout = HostShards::ForUnits((*cpu)->Units(), (*cpu)->Parameters(), 0, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->map().num_groups(), 4);
  auto reducer =
      GpuFsdpReducer::Create(ctx.get(), nccl.get(), (*layout)->map(), (*sharded)->Parameters(),
                             {.sharding = Sharding::kFullShard});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  ASSERT_TRUE((*sharded)->SetUnitHooks(reducer->get()).ok());
  OptimizerConfig opt;
  opt.name = "adamw";
  opt.lr = 1e-3;
  opt.weight_decay = 0.1;
  auto plain_opt = GpuOptimizer::Create(ctx.get(), opt, (*plain)->Parameters());
  auto sharded_opt = GpuOptimizer::Create(ctx.get(), opt, (*reducer)->shard_parameters());
  ASSERT_TRUE(plain_opt.ok() && sharded_opt.ok());
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  std::mt19937_64 rng(11);
  for (int step = 0; step < 4; ++step) {
    std::vector<int32_t> tokens(2 * 16), targets(2 * 16);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(rng() % 97);
      targets[i] = static_cast<int32_t>(rng() % 97);
    }
    ASSERT_TRUE((*plain)->ZeroGrad().ok());
    ASSERT_TRUE((*plain)->Forward(tokens.data(), targets.data(), 2, 16, true).ok());
    ASSERT_TRUE((*plain)->Backward().ok());
    ASSERT_TRUE((*plain_opt)->Step(opt.lr).ok());
    ASSERT_TRUE((*reducer)->BeginStep().ok());
    ASSERT_TRUE((*sharded)->Forward(tokens.data(), targets.data(), 2, 16, true).ok());
    ASSERT_TRUE((*sharded)->Backward().ok());
    ASSERT_TRUE((*reducer)->AfterBackward().ok());
    ASSERT_TRUE((*sharded_opt)->Step(opt.lr).ok());
    ASSERT_EQ(cudaEventRecord(done, ctx->stream()), cudaSuccess);
    ASSERT_TRUE((*reducer)->Wait(done).ok());
    absl::StatusOr<double> a = (*plain)->ReadLoss();
    absl::StatusOr<double> b = (*sharded)->ReadLoss();
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b) << "step " << step;
  }
  cudaEventDestroy(done);
  auto want = Gpt::Create(config, 8);
  auto got = Gpt::Create(config, 9);
  ASSERT_TRUE(want.ok() && got.ok());
  ASSERT_TRUE((*plain)->CopyWeightsTo((*want)->Parameters()).ok());
  ASSERT_TRUE((*reducer)->GatherFullParameters().ok());
  ASSERT_TRUE((*sharded)->CopyWeightsTo((*got)->Parameters()).ok());
  (*reducer)->ReleaseFullParameters();
  for (size_t k = 0; k < (*want)->Parameters().size(); ++k) {
    EXPECT_EQ(testing::MaxRelError((*got)->Parameters()[k]->value, (*want)->Parameters()[k]->value),
              0.0)
        << (*want)->Parameters()[k]->name;
  }
}

ModelConfig SmallMlp() {
  ModelConfig config;
  config.name = "mlp";
  config.hidden_sizes = {64, 32};
  return config;
}

// param_dtype bf16: the step computes on the fp32 shards rounded to bf16
// (the loss is the plain model's on rounded weights, bit for bit), and the
// masters stay fp32 (GatherFullParameters gives them back unrounded).
TEST(GpuFsdp, Bf16GathersComputeOnRoundedWeightsOverFp32Masters) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto cpu = BuildModel(SmallMlp(), 3);
  auto rounded = BuildModel(SmallMlp(), 3);
  ASSERT_TRUE(cpu.ok() && rounded.ok());
  for (Parameter* p : (*rounded)->Parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) {
      p->value[i] = Bf16ToFloat(FloatToBf16(p->value[i]));
    }
  }
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.1;
  auto plain = GpuModel::Create(ctx.get(), **rounded);
  ASSERT_TRUE(plain.ok());
  auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), opt);
  ASSERT_TRUE(plain_trainer.ok());
  absl::StatusOr<Sharded> shard =
      Shard(ctx.get(), nccl.get(), **cpu,
            {.sharding = Sharding::kFullShard, .param_half = HalfFormat::kBf16}, opt);
  ASSERT_TRUE(shard.ok()) << shard.status();
  Sharded& s = *shard;
  const Tensor images = RandomTensor({16, 1, 28, 28}, 21);
  std::vector<int32_t> labels(16);
  for (int j = 0; j < 16; ++j) labels[static_cast<size_t>(j)] = j % 10;
  absl::StatusOr<double> a = (*plain_trainer)->Step(images, labels, opt.lr);
  absl::StatusOr<double> b = s.trainer->Step(images, labels, opt.lr);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(*a, *b);
  // Half the fp32 traffic: the gathers in two bytes a value.
  EXPECT_LT(s.reducer->last_bytes_sent(), s.reducer->last_bytes_uncompressed());
  // The update went into the fp32 masters: each moved by the gradient the
  // plain model got on the rounded weights, as the SGD kernel computes it
  // (p + (-lr) g, each rounded).
  auto grads = BuildModel(SmallMlp(), 9);
  auto masters = BuildModel(SmallMlp(), 9);
  ASSERT_TRUE(grads.ok() && masters.ok());
  ASSERT_TRUE((*plain)->CopyGradientsTo((*grads)->Parameters()).ok());
  ASSERT_TRUE(s.reducer->GatherFullParameters().ok());
  ASSERT_TRUE(s.model->CopyParametersTo((*masters)->Parameters()).ok());
  s.reducer->ReleaseFullParameters();
  const float lr = static_cast<float>(opt.lr);
  for (size_t k = 0; k < (*cpu)->Parameters().size(); ++k) {
    const Tensor& w = (*cpu)->Parameters()[k]->value;
    const Tensor& g = (*grads)->Parameters()[k]->grad;
    const Tensor& got = (*masters)->Parameters()[k]->value;
    for (int64_t i = 0; i < w.numel(); ++i) {
      const float step = -lr * g[i];
      ASSERT_EQ(got[i], w[i] + step) << (*cpu)->Parameters()[k]->name << "[" << i << "]";
    }
  }
}

// reduce_dtype bf16: each unit's gradients rounded to bf16 before the
// reduce-scatter; one SGD step of lr 1 then moves each weight by exactly
// its rounded gradient.
TEST(GpuFsdp, Bf16ReduceScattersRoundTheGradients) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto cpu = BuildModel(SmallMlp(), 3);
  ASSERT_TRUE(cpu.ok());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 1.0;
  const Tensor images = RandomTensor({16, 1, 28, 28}, 22);
  std::vector<int32_t> labels(16);
  for (int j = 0; j < 16; ++j) labels[static_cast<size_t>(j)] = (3 * j) % 10;
  // The plain model's gradients at the same weights.
  auto plain = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok());
  GpuTensor input, logits, grad_logits;
  ASSERT_TRUE(input.CopyFromHost(ctx.get(), images).ok());
  ASSERT_TRUE((*plain)->ZeroGrad().ok());
  ASSERT_TRUE((*plain)->Forward(input, &logits, /*training=*/true).ok());
  GpuCrossEntropy xent(ctx.get());
  ASSERT_TRUE(xent.Compute(logits, labels, &grad_logits).ok());
  ASSERT_TRUE((*plain)->Backward(grad_logits).ok());
  auto grads = BuildModel(SmallMlp(), 9);
  ASSERT_TRUE(grads.ok());
  ASSERT_TRUE((*plain)->CopyGradientsTo((*grads)->Parameters()).ok());

  absl::StatusOr<Sharded> shard =
      Shard(ctx.get(), nccl.get(), **cpu,
            {.sharding = Sharding::kShardGradOp, .reduce_half = HalfFormat::kBf16}, opt);
  ASSERT_TRUE(shard.ok()) << shard.status();
  Sharded& s = *shard;
  ASSERT_TRUE(s.trainer->Step(images, labels, opt.lr).ok());
  auto after = BuildModel(SmallMlp(), 9);
  ASSERT_TRUE(after.ok());
  ASSERT_TRUE(s.reducer->GatherFullParameters().ok());
  ASSERT_TRUE(s.model->CopyParametersTo((*after)->Parameters()).ok());
  s.reducer->ReleaseFullParameters();
  for (size_t k = 0; k < (*cpu)->Parameters().size(); ++k) {
    const Tensor& w = (*cpu)->Parameters()[k]->value;
    const Tensor& g = (*grads)->Parameters()[k]->grad;
    const Tensor& got = (*after)->Parameters()[k]->value;
    for (int64_t i = 0; i < w.numel(); ++i) {
      const float want = w[i] - Bf16ToFloat(FloatToBf16(g[i]));
      ASSERT_EQ(got[i], want) << (*cpu)->Parameters()[k]->name << "[" << i << "]";
    }
  }
}

// A layout for another world size, or of another model, is refused before
// anything moves.
TEST(GpuFsdp, ALayoutThatIsNotTheModelsIsRefused) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig config;
  config.name = "cnn";
  auto cpu = BuildModel(config, 3);
  ASSERT_TRUE(cpu.ok());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto model = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(model.ok());
  auto two = HostShards::ForUnits((*cpu)->Units(), (*cpu)->Parameters(), 0, 2);
  ASSERT_TRUE(two.ok());
  auto r = GpuFsdpReducer::Create(ctx.get(), nccl.get(), (*two)->map(), (*model)->Parameters(),
                                  {.sharding = Sharding::kFullShard});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("not for 1 ranks"));
  ModelConfig mlp;
  mlp.name = "mlp";
  auto other = BuildModel(mlp, 3);
  ASSERT_TRUE(other.ok());
  auto theirs = HostShards::ForUnits((*other)->Units(), (*other)->Parameters(), 0, 1);
  ASSERT_TRUE(theirs.ok());
  r = GpuFsdpReducer::Create(ctx.get(), nccl.get(), (*theirs)->map(), (*model)->Parameters(),
                             {.sharding = Sharding::kGradients});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = GpuFsdpReducer::Create(ctx.get(), nccl.get(), (*theirs)->map(), (*model)->Parameters(),
                             {.sharding = Sharding::kOptimizer});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  auto ours = HostShards::ForUnits((*cpu)->Units(), (*cpu)->Parameters(), 0, 1);
  ASSERT_TRUE(ours.ok());
  r = GpuFsdpReducer::Create(ctx.get(), nccl.get(), (*ours)->map(), (*model)->Parameters(),
                             {.sharding = Sharding::kGradients, .param_half = HalfFormat::kBf16});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("16-bit gathers are FSDP's"));
  // The model's weights stayed where they were.
  for (const GpuParameter* p : (*model)->Parameters()) EXPECT_NE(p->value.data(), nullptr);
}

}  // namespace
}  // namespace aidn::engine::cuda
