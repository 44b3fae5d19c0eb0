// GpuDdpReducer on one GPU, with a real NcclCommunicator of world size 1
// through the KV rendezvous. Averaging over one rank is exact, so a model
// trained through several buckets must match one trained without DDP bit
// for bit; the buckets' mechanics (gradients as views, a gradient that never
// comes, one reported twice) are pinned down too. Two ranks need two GPUs.
// Skips without a device.
#include "worker/engine/cuda/gpu_ddp.h"
#include "worker/engine/host_shards.h"

#include <stdlib.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/nccl_test_util.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/half.h"
#include "worker/engine/model.h"

namespace aidn::engine::cuda {
namespace {

using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::ToHost;

using ::aidn::engine::testing::WorldOfOne;

ModelConfig Cnn() {
  ModelConfig c;
  c.name = "cnn";
  return c;
}

// Heuristic algorithm choice: two models on one context then pick the same
// convolution algorithms (timing them could pick differently, and differ
// in the last bits).
GpuContextOptions Reproducible() {
  GpuContextOptions o;
  o.benchmark_convolutions = false;
  return o;
}

// The reducer's hooks, as GpuSession sets them.
void Hook(GpuTrainer* trainer, GpuDdpReducer* reducer) {
  trainer->SetGradReady(
      [reducer](const std::vector<GpuParameter*>& p) { return reducer->OnGradReady(p); });
  trainer->SetBeforeLastBackward(
      [reducer](const std::vector<bool>& used, const std::vector<GpuParameter*>& unused_now) {
        return reducer->BeginBackward(used, unused_now);
      });
  trainer->SetAfterBackward([reducer] { return reducer->AfterBackward(); });
  trainer->SetWait([reducer](cudaEvent_t done) { return reducer->Wait(done); });
  trainer->SetCheckWait([reducer](cudaEvent_t event) { return reducer->WaitForCheck(event); });
}

// Two GPU models of `config` hold the same weights, bit for bit.
void ExpectSameWeights(const ModelConfig& config, const GpuModel& want, const GpuModel& got) {
  auto a = BuildModel(config, 8);
  auto b = BuildModel(config, 9);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(want.CopyParametersTo((*a)->Parameters()).ok());
  ASSERT_TRUE(got.CopyParametersTo((*b)->Parameters()).ok());
  for (size_t k = 0; k < (*a)->Parameters().size(); ++k) {
    EXPECT_EQ(testing::MaxRelError((*b)->Parameters()[k]->value, (*a)->Parameters()[k]->value), 0.0)
        << (*a)->Parameters()[k]->name;
  }
}

TEST(GpuDdp, AWorldOfOneThroughSeveralBucketsTrainsBitForBitAsWithoutDdp) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto cpu = BuildModel(Cnn(), 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto plain = GpuModel::Create(ctx.get(), **cpu);
  auto ddp = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok() && ddp.ok());
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.05;
  opt.momentum = 0.9;
  auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), opt);
  auto ddp_trainer = GpuTrainer::Create(ctx.get(), ddp->get(), opt);
  ASSERT_TRUE(plain_trainer.ok() && ddp_trainer.ok());

  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  // 20 kB buckets: the CNN's gradients fill several.
  auto reducer = GpuDdpReducer::Create(ctx.get(), (*ddp)->Parameters(), nccl.get(),
                                       DdpOptions{.bucket_mb = 0.02});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  const int buckets = (*reducer)->num_buckets();
  std::printf("  %d buckets\n", buckets);
  EXPECT_GE(buckets, 3);
  Hook(ddp_trainer->get(), reducer->get());

  std::vector<Tensor> images;
  std::vector<std::vector<int32_t>> labels;
  for (int i = 0; i < 12; ++i) {
    images.push_back(RandomTensor({32, 1, 28, 28}, 100 + i));
    labels.emplace_back(32);
    for (int j = 0; j < 32; ++j) labels.back()[static_cast<size_t>(j)] = (i * 7 + j * 3) % 10;
  }
  int64_t collectives = 0;
  for (int step = 0; step < 10; ++step) {
    absl::StatusOr<double> a = (*plain_trainer)->Step(images[step], labels[step], opt.lr);
    absl::StatusOr<double> b = (*ddp_trainer)->Step(images[step], labels[step], opt.lr);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*a, *b) << "step " << step;
    collectives += buckets;
    EXPECT_EQ(nccl->sequence(), collectives) << "every bucket's allreduce is counted";
    EXPECT_GT((*reducer)->last_allreduce_seconds(), 0.0);
  }
  // A step of two micro-batches communicates once, after the second.
  std::vector<MicroBatch> micro = {{&images[10], &labels[10], std::nullopt},
                                   {&images[11], &labels[11], std::nullopt}};
  absl::StatusOr<double> a = (*plain_trainer)->Step(micro, opt.lr);
  absl::StatusOr<double> b = (*ddp_trainer)->Step(micro, opt.lr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(nccl->sequence(), collectives + buckets);

  ExpectSameWeights(Cnn(), **plain, **ddp);
}

TEST(GpuDdp, GradientsMoveIntoTheBucketsAndBackWithTheirValues) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto model = GpuModel::Build(ctx.get(), Cnn(), 4);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GpuParameter*>& params = (*model)->Parameters();
  std::vector<Tensor> values;
  for (size_t k = 0; k < params.size(); ++k) {
    values.push_back(RandomTensor(params[k]->grad.shape(), 40 + k));
    ASSERT_TRUE(params[k]->grad.CopyFromHost(ctx.get(), values.back()).ok());
  }
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto reducer =
      GpuDdpReducer::Create(ctx.get(), params, nccl.get(), DdpOptions{.bucket_mb = 0.001});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  // Reverse registration order: the last parameter's bucket goes first.
  EXPECT_EQ((*reducer)->BucketLayout().front().front(), params.back()->name);
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(params[k]->grad.is_view()) << params[k]->name;
    EXPECT_EQ(params[k]->grad.shape(), values[k].shape());
    EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), params[k]->grad), values[k]), 0.0);
  }
  reducer->reset();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_FALSE(params[k]->grad.is_view()) << params[k]->name;
    EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), params[k]->grad), values[k]), 0.0);
  }
}

// ddp.compression fp16 / bf16: over one rank the allreduce of 16-bit
// values is the identity, so each gradient comes back as its own rounding
// to 16 bits, exactly (the CPU's half.h rounding, nearest-even).
TEST(GpuDdp, CompressedBucketsComeBackRoundedTo16Bits) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  for (const HalfFormat format : {HalfFormat::kFp16, HalfFormat::kBf16}) {
    auto model = GpuModel::Build(ctx.get(), Cnn(), 4);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::vector<GpuParameter*>& params = (*model)->Parameters();
    std::vector<Tensor> values;
    for (size_t k = 0; k < params.size(); ++k) {
      values.push_back(RandomTensor(params[k]->grad.shape(), 70 + k, 3.0f));
      ASSERT_TRUE(params[k]->grad.CopyFromHost(ctx.get(), values.back()).ok());
    }
    InMemoryKeyValueStore store;
    std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
    ASSERT_NE(nccl, nullptr);
    auto reducer = GpuDdpReducer::Create(ctx.get(), params, nccl.get(),
                                         DdpOptions{.bucket_mb = 0.001, .half = format});
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    ASSERT_TRUE((*reducer)->OnGradReady(params).ok());
    ASSERT_TRUE((*reducer)->AfterBackward().ok());
    cudaEvent_t done = nullptr;
    ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(done, ctx->stream()), cudaSuccess);
    ASSERT_TRUE((*reducer)->Wait(done).ok());
    cudaEventDestroy(done);
    for (size_t k = 0; k < params.size(); ++k) {
      Tensor want = values[k].Clone();
      for (int64_t i = 0; i < want.numel(); ++i) {
        want[i] = HalfToFloat(FloatToHalf(want[i], format), format);
      }
      EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), params[k]->grad), want), 0.0)
          << HalfFormatName(format) << " " << params[k]->name;
    }
  }
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto model = GpuModel::Build(ctx.get(), Cnn(), 4);
  ASSERT_TRUE(model.ok());
  // ZeRO-1 needs the shards' layout; without one the reducer is refused.
  EXPECT_EQ(GpuDdpReducer::Create(ctx.get(), (*model)->Parameters(), nccl.get(),
                                  DdpOptions{.shard_optimizer = true})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// broadcast_buffers: rank 0's running statistics to every rank, ordered
// between the compute stream and NCCL's. Over one rank they come back as
// they were (which a no-op would too: what this pins down is that the
// calls, events and group complete).
TEST(GpuDdp, BufferBroadcastsOfAWorldOfOneLeaveTheStatisticsAsTheyWere) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig resnet;
  resnet.name = "resnet18";
  auto model = GpuModel::Build(ctx.get(), resnet, 4);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GpuParameter*>& buffers = (*model)->Buffers();
  ASSERT_FALSE(buffers.empty());
  std::vector<Tensor> values;
  for (size_t k = 0; k < buffers.size(); ++k) {
    values.push_back(RandomTensor(buffers[k]->value.shape(), 90 + k));
    ASSERT_TRUE(buffers[k]->value.CopyFromHost(ctx.get(), values.back()).ok());
  }
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto reducer = GpuDdpReducer::Create(ctx.get(), (*model)->Parameters(), nccl.get(),
                                       DdpOptions{.bucket_mb = 1});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  ASSERT_TRUE((*reducer)->BroadcastBuffers(buffers).ok());
  ASSERT_TRUE(nccl->Wait("buffer broadcasts").ok());
  ASSERT_TRUE(ctx->Synchronize().ok());
  for (size_t k = 0; k < buffers.size(); ++k) {
    EXPECT_EQ(testing::MaxRelError(ToHost(ctx.get(), buffers[k]->value), values[k]), 0.0)
        << buffers[k]->name;
  }
}

// Stochastic depth through the reducer (find_unused_parameters): the
// skipped blocks' parameters are ready at once, the used flags summed, and
// what no rank used is left alone, so over one rank it trains bit for bit
// as a trainer without DDP (which leaves them alone itself). Without the
// option the first step that skips a block fails, naming a parameter.
TEST(GpuDdp, UnusedParametersFinishTheirBucketsAndAreLeftAlone) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig config;
  config.name = "resnet18";
  config.stochastic_depth = 0.5;
  auto cpu = BuildModel(config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto plain = GpuModel::Create(ctx.get(), **cpu);
  auto ddp = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok() && ddp.ok());
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.05;
  opt.momentum = 0.9;
  auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), opt);
  auto ddp_trainer = GpuTrainer::Create(ctx.get(), ddp->get(), opt);
  ASSERT_TRUE(plain_trainer.ok() && ddp_trainer.ok());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto reducer = GpuDdpReducer::Create(ctx.get(), (*ddp)->Parameters(), nccl.get(),
                                       DdpOptions{.bucket_mb = 1, .find_unused_parameters = true});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  Hook(ddp_trainer->get(), reducer->get());
  const Tensor images = RandomTensor({16, 1, 28, 28}, 5);
  std::vector<int32_t> labels(16);
  for (int j = 0; j < 16; ++j) labels[static_cast<size_t>(j)] = j % 10;
  int skipping_steps = 0;
  for (uint64_t step = 0; step < 6; ++step) {
    const std::vector<MicroBatch> micro = {{&images, &labels, 40 + step}};
    absl::StatusOr<double> a = (*plain_trainer)->Step(micro, opt.lr);
    absl::StatusOr<double> b = (*ddp_trainer)->Step(micro, opt.lr);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*a, *b) << "step " << step;
    int skipped = 0;
    for (size_t k = 0; k < (*ddp)->Parameters().size(); ++k) {
      EXPECT_EQ((*ddp)->Parameters()[k]->no_grad, (*plain)->Parameters()[k]->no_grad);
      skipped += (*ddp)->Parameters()[k]->no_grad ? 1 : 0;
    }
    if (skipped > 0) ++skipping_steps;
  }
  EXPECT_GT(skipping_steps, 0) << "no step skipped a block: the test shows nothing";
  ExpectSameWeights(config, **plain, **ddp);

  // Without the option.
  auto strict_model = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(strict_model.ok());
  auto strict_trainer = GpuTrainer::Create(ctx.get(), strict_model->get(), opt);
  ASSERT_TRUE(strict_trainer.ok());
  InMemoryKeyValueStore strict_store;
  std::unique_ptr<NcclCommunicator> strict_nccl = WorldOfOne(&strict_store);
  ASSERT_NE(strict_nccl, nullptr);
  auto strict = GpuDdpReducer::Create(ctx.get(), (*strict_model)->Parameters(), strict_nccl.get(),
                                      DdpOptions{.bucket_mb = 1});
  ASSERT_TRUE(strict.ok());
  Hook(strict_trainer->get(), strict->get());
  absl::Status failed;
  for (uint64_t step = 0; step < 6 && failed.ok(); ++step) {
    const std::vector<MicroBatch> micro = {{&images, &labels, 40 + step}};
    failed = (*strict_trainer)->Step(micro, opt.lr).status();
  }
  EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("set ddp.find_unused_parameters: true"));
  // The step failed before the update and after every bucket launched.
  EXPECT_TRUE(strict_nccl->Wait("buckets").ok());
}

// ZeRO-1 over one rank: the buckets reduce-scattered in place, the
// optimizer over the shards of a HostShards layout (named as its
// shards, decay and clipping by the whole parameters and norm), the weights
// all-gathered after the update: bit for bit a model trained without DDP.
TEST(GpuDdp, ZeroOneOverOneRankTrainsBitForBitAsWithoutDdp) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto cpu = BuildModel(Cnn(), 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto plain = GpuModel::Create(ctx.get(), **cpu);
  auto sharded = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok() && sharded.ok());
  OptimizerConfig opt;
  opt.name = "adamw";
  opt.lr = 1e-3;
  opt.weight_decay = 0.1;
  opt.decay_matrices_only = true;
  opt.grad_clip_norm = 0.5;
  auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), opt);
  ASSERT_TRUE(plain_trainer.ok());

  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto layout = HostShards::ForBuckets((*cpu)->Parameters(), 0.02, 0, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto reducer = GpuDdpReducer::Create(ctx.get(), (*sharded)->Parameters(), nccl.get(),
                                       DdpOptions{.bucket_mb = 0.02, .shard_optimizer = true},
                                       &(*layout)->map());
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  const std::vector<GpuParameter*>& shards = (*reducer)->shard_parameters();
  ASSERT_EQ(shards.size(), (*layout)->map().shards().size());
  for (size_t k = 0; k < shards.size(); ++k) {
    EXPECT_EQ(shards[k]->name, (*layout)->map().shards()[k]->name);
    EXPECT_FALSE(shards[k]->whole_shape.empty());
  }
  auto sharded_trainer = GpuTrainer::Create(ctx.get(), sharded->get(), opt, &shards);
  ASSERT_TRUE(sharded_trainer.ok()) << sharded_trainer.status();
  (*sharded_trainer)->optimizer().SetNormAllReduce([&](double* total) {
    return nccl->AllReduceDoubleSumOn(ctx->stream(), total, 1);
  });
  Hook(sharded_trainer->get(), reducer->get());

  for (int step = 0; step < 6; ++step) {
    const Tensor images = RandomTensor({32, 1, 28, 28}, 300 + step);
    std::vector<int32_t> labels(32);
    for (int j = 0; j < 32; ++j) labels[static_cast<size_t>(j)] = (step + j * 3) % 10;
    absl::StatusOr<double> a = (*plain_trainer)->Step(images, labels, opt.lr);
    absl::StatusOr<double> b = (*sharded_trainer)->Step(images, labels, opt.lr);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*a, *b) << "step " << step;
  }
  ExpectSameWeights(Cnn(), **plain, **sharded);
  // The state comes back named as the layout's shards' (what a sharded
  // checkpoint holds).
  auto state = (*sharded_trainer)->optimizer().StateToHost();
  ASSERT_TRUE(state.ok()) << state.status();
  auto host = Optimizer::Create(opt, (*layout)->map().shards());
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<Optimizer::StateEntry> entries;
  for (const auto& [name, tensor] : *state) entries.emplace_back(name, &tensor);
  EXPECT_TRUE((*host)->LoadState(entries, 6).ok());
  EXPECT_TRUE((*layout)->map().StatePieces((*host)->State()).ok());
}

// ZeRO-1 with skipped blocks over one rank: the skipped parameters' shards
// are left alone with them (their used flags summed, as under DDP), bit for
// bit as a trainer without DDP leaves the parameters alone.
TEST(GpuDdp, ZeroOneLeavesTheShardsOfUnusedParametersAlone) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  ModelConfig config;
  config.name = "resnet18";
  config.stochastic_depth = 0.5;
  auto cpu = BuildModel(config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto plain = GpuModel::Create(ctx.get(), **cpu);
  auto sharded = GpuModel::Create(ctx.get(), **cpu);
  ASSERT_TRUE(plain.ok() && sharded.ok());
  OptimizerConfig opt;
  opt.name = "sgd";
  opt.lr = 0.05;
  opt.momentum = 0.9;
  auto plain_trainer = GpuTrainer::Create(ctx.get(), plain->get(), opt);
  ASSERT_TRUE(plain_trainer.ok());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto layout = HostShards::ForBuckets((*cpu)->Parameters(), 1, 0, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto reducer = GpuDdpReducer::Create(
      ctx.get(), (*sharded)->Parameters(), nccl.get(),
      DdpOptions{.bucket_mb = 1, .shard_optimizer = true, .find_unused_parameters = true},
      &(*layout)->map());
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  const std::vector<GpuParameter*>& shards = (*reducer)->shard_parameters();
  auto sharded_trainer = GpuTrainer::Create(ctx.get(), sharded->get(), opt, &shards);
  ASSERT_TRUE(sharded_trainer.ok()) << sharded_trainer.status();
  Hook(sharded_trainer->get(), reducer->get());
  const Tensor images = RandomTensor({16, 1, 28, 28}, 6);
  std::vector<int32_t> labels(16);
  for (int j = 0; j < 16; ++j) labels[static_cast<size_t>(j)] = (j * 7) % 10;
  int skipped_shards = 0;
  for (uint64_t step = 0; step < 5; ++step) {
    const std::vector<MicroBatch> micro = {{&images, &labels, 60 + step}};
    absl::StatusOr<double> a = (*plain_trainer)->Step(micro, opt.lr);
    absl::StatusOr<double> b = (*sharded_trainer)->Step(micro, opt.lr);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*a, *b) << "step " << step;
    for (const GpuParameter* s : shards) skipped_shards += s->no_grad ? 1 : 0;
  }
  EXPECT_GT(skipped_shards, 0) << "no step skipped a block: the test shows nothing";
  ExpectSameWeights(config, **plain, **sharded);
}

// A bucket that fills before the ones ahead of it (the parameters of a
// block the forward skipped, reported before backward) waits for its turn:
// every rank launches in plan order whatever it skipped, so that the
// ranks' allreduces pair up.
TEST(GpuDdp, BucketsLaunchInPlanOrderWhateverFillsFirst) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto model = GpuModel::Build(ctx.get(), Cnn(), 4);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GpuParameter*>& params = (*model)->Parameters();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto reducer =
      GpuDdpReducer::Create(ctx.get(), params, nccl.get(), DdpOptions{.bucket_mb = 0.001});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  const std::vector<std::vector<std::string>> layout = (*reducer)->BucketLayout();
  ASSERT_GE(layout.size(), 3u);
  // The last bucket's parameters first, then every other in plan order.
  auto named = [&](const std::string& name) {
    for (GpuParameter* p : params) {
      if (p->name == name) return p;
    }
    return static_cast<GpuParameter*>(nullptr);
  };
  std::vector<GpuParameter*> early;
  for (const std::string& name : layout.back()) early.push_back(named(name));
  ASSERT_TRUE((*reducer)->OnGradReady(early).ok());
  EXPECT_TRUE((*reducer)->last_launch_order().empty())
      << "the last bucket went before the first was in";
  for (size_t b = 0; b + 1 < layout.size(); ++b) {
    std::vector<GpuParameter*> ready;
    for (const std::string& name : layout[b]) ready.push_back(named(name));
    ASSERT_TRUE((*reducer)->OnGradReady(ready).ok());
  }
  ASSERT_TRUE((*reducer)->AfterBackward().ok());
  ASSERT_TRUE(nccl->Wait("buckets").ok());
  std::vector<int> want(layout.size());
  for (size_t b = 0; b < want.size(); ++b) want[b] = static_cast<int>(b);
  EXPECT_EQ((*reducer)->last_launch_order(), want);
}

TEST(GpuDdp, AGradientThatNeverComesOrComesTwiceFailsTheStep) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, Reproducible());
  auto model = GpuModel::Build(ctx.get(), Cnn(), 4);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GpuParameter*>& params = (*model)->Parameters();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto reducer =
      GpuDdpReducer::Create(ctx.get(), params, nccl.get(), DdpOptions{.bucket_mb = 0.001});
  ASSERT_TRUE(reducer.ok()) << reducer.status();

  // Only the last layer's gradients: the earlier buckets never fill.
  ASSERT_TRUE((*reducer)->OnGradReady({params[params.size() - 2], params.back()}).ok());
  absl::Status missing = (*reducer)->AfterBackward();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("got no gradient"));
  EXPECT_THAT(missing.message(), HasSubstr(params.front()->name));
  EXPECT_THAT(missing.message(), HasSubstr("set ddp.find_unused_parameters: true"));

  ASSERT_TRUE((*reducer)->OnGradReady({params.back()}).ok());
  absl::Status twice = (*reducer)->OnGradReady({params.back()});
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.message(), HasSubstr(params.back()->name));

  GpuParameter stranger;
  stranger.name = "stranger";
  EXPECT_EQ((*reducer)->OnGradReady({&stranger}).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(GpuDdpReducer::Create(ctx.get(), params, nccl.get(), DdpOptions{.bucket_mb = 0})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aidn::engine::cuda
