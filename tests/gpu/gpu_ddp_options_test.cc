// DDP's options on one GPU, against the CPU engine: PowerSGD
// (cuda/gpu_powersgd.h) against PowerSgd on the same gradients, and
// SyncBatchNorm (GpuBatchNorm2d over the NCCL communicator's stream
// collectives) against BatchNorm2d, through a real NcclCommunicator of
// world size 1 (two ranks need two GPUs). Over one rank every collective is
// the identity, so what these pin down is the GPU arithmetic and the
// streams' order. Skips without a device.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/nccl_test_util.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/gpu_ddp.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/cuda/gpu_powersgd.h"
#include "worker/engine/cuda/gpu_resnet.h"
#include "worker/engine/powersgd.h"

namespace aidn::engine::cuda {
namespace {

using testing::RandomTensor;
using testing::ToDevice;
using testing::ToHost;

using ::aidn::engine::testing::WorldOfOne;

// The CPU's world of one: every collective leaves the data as it is (the
// sum and the mean over one rank), as the NCCL communicator of one rank.
class HostWorldOfOne final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  absl::Status AllReduce(float*, size_t, ReduceOp) override { return Count(); }
  absl::Status Broadcast(float*, size_t, int) override { return Count(); }
  absl::Status AllGather(const float* in, size_t count, float* out) override {
    if (in != out) std::memmove(out, in, sizeof(float) * count);
    return Count();
  }
  absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp) override {
    if (in != out) std::memmove(out, in, sizeof(float) * count);
    return Count();
  }
  absl::Status Barrier() override { return Count(); }
  int64_t sequence() const override { return sequence_; }

 private:
  absl::Status Count() {
    ++sequence_;
    return absl::OkStatus();
  }
  int64_t sequence_ = 0;
};

// A bucket laid out as the reducers lay it out: each gradient at a
// multiple of 16 floats, zeros between.
struct Bucket {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<size_t> offsets;
  size_t floats = 0;
};
Bucket Layout(const std::vector<std::vector<int64_t>>& shapes) {
  Bucket b;
  b.shapes = shapes;
  for (const auto& s : shapes) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    b.offsets.push_back(b.floats);
    b.floats += (static_cast<size_t>(n) + 15) / 16 * 16;
  }
  return b;
}

// Each gradient of `got` (the bucket) against the CPU's `want`: the L2
// norm of the difference over that of `scale` (the gradient itself, or the
// input for an error that is all but zero at full rank); the worst.
double WorstError(const Bucket& b, const std::vector<float>& got,
                  const std::vector<std::vector<float>>& want,
                  const std::vector<std::vector<float>>& scale) {
  double worst = 0;
  for (size_t g = 0; g < b.shapes.size(); ++g) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < want[g].size(); ++i) {
      const double d = static_cast<double>(got[b.offsets[g] + i]) - want[g][i];
      diff += d * d;
      norm += static_cast<double>(scale[g][i]) * scale[g][i];
    }
    worst = std::max(worst, std::sqrt(diff / norm));
  }
  return worst;
}

// PowerSGD's whole pass on the GPU, step after step (warm start, error
// feedback), against the CPU's on the same gradients: the same plan, the
// same random Q, results to rounding.
void ExpectPowerSgdAsOnTheCpu(GpuContext* ctx, const PowerSgdOptions& options,
                              const std::vector<std::vector<int64_t>>& shapes, double tolerance) {
  const Bucket layout = Layout(shapes);
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto gpu = GpuPowerSgd::Create(ctx, nccl.get(), options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  PowerSgd cpu(options);
  HostWorldOfOne host_comm;
  GpuTensor bucket = ToDevice(ctx, Tensor({static_cast<int64_t>(layout.floats)}));
  for (int step = 0; step < 4; ++step) {
    std::vector<float> flat(layout.floats, 0.0f);
    std::vector<std::vector<float>> grads;
    std::vector<PowerSgd::Gradient> cpu_grads;
    std::vector<GpuPowerSgd::Gradient> gpu_grads;
    for (size_t g = 0; g < shapes.size(); ++g) {
      Tensor t = RandomTensor(shapes[g], 1000 * step + g);
      grads.emplace_back(t.data(), t.data() + t.numel());
      std::memcpy(flat.data() + layout.offsets[g], t.data(), sizeof(float) * t.numel());
    }
    for (size_t g = 0; g < shapes.size(); ++g) {
      cpu_grads.push_back({grads[g].data(), shapes[g]});
      gpu_grads.push_back({bucket.data() + layout.offsets[g], shapes[g]});
    }
    ASSERT_EQ(
        cudaMemcpy(bucket.data(), flat.data(), sizeof(float) * flat.size(), cudaMemcpyHostToDevice),
        cudaSuccess);
    // The upload and the zeroing before it (on the compute stream) done
    // before the NCCL stream reads the bucket.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<std::vector<float>> inputs = grads;
    ASSERT_TRUE(cpu.Reduce(0, cpu_grads, &host_comm).ok());
    const std::vector<std::vector<float>>& cpu_out = grads;
    ASSERT_TRUE((*gpu)->Reduce(0, bucket.data(), layout.floats, gpu_grads).ok());
    ASSERT_TRUE(nccl->Wait("powersgd").ok());
    std::vector<float> got(layout.floats);
    ASSERT_EQ(
        cudaMemcpy(got.data(), bucket.data(), sizeof(float) * got.size(), cudaMemcpyDeviceToHost),
        cudaSuccess);
    const double err = WorstError(layout, got, cpu_out, inputs);
    std::printf("  step %d: output %.3g", step, err);
    EXPECT_LE(err, tolerance) << "step " << step;
    EXPECT_EQ((*gpu)->last_floats_sent(), cpu.last_floats_sent());
    EXPECT_EQ((*gpu)->last_floats_uncompressed(), cpu.last_floats_uncompressed());
    // The padding is neither sent nor changed.
    for (size_t g = 0; g + 1 < layout.offsets.size(); ++g) {
      for (size_t i = layout.offsets[g] + grads[g].size(); i < layout.offsets[g + 1]; ++i) {
        ASSERT_EQ(got[i], 0.0f) << "padding at " << i;
      }
    }
    if (options.error_feedback) {
      absl::StatusOr<std::vector<float>> error = (*gpu)->Error(0);
      ASSERT_TRUE(error.ok()) << error.status();
      const std::vector<float>* want = cpu.error(0);
      ASSERT_NE(want, nullptr);
      std::vector<std::vector<float>> want_each;
      size_t at = 0;
      for (const auto& g : grads) {
        want_each.emplace_back(want->begin() + at, want->begin() + at + g.size());
        at += g.size();
      }
      const double error_err = WorstError(layout, *error, want_each, inputs);
      std::printf(", error %.3g", error_err);
      EXPECT_LE(error_err, tolerance) << "step " << step;
    }
    std::printf("\n");
    cpu.EndStep();
    (*gpu)->EndStep();
  }
}

TEST(GpuPowerSgd, LowRankPassesMatchTheCpusStepAfterStep) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  PowerSgdOptions options;
  options.rank = 2;
  options.start_step = 0;
  options.seed = 11;
  // Matrices compressed (64 x 48, 32 x 27, 10 x 100), vectors and a small
  // matrix not (16, 3 x 4).
  ExpectPowerSgdAsOnTheCpu(ctx.get(), options, {{64, 48}, {16}, {32, 3, 3, 3}, {3, 4}, {10, 100}},
                           1e-4);
  options.warm_start = false;
  options.error_feedback = false;
  ExpectPowerSgdAsOnTheCpu(ctx.get(), options, {{64, 48}, {16}}, 1e-4);
}

TEST(GpuPowerSgd, AtFullRankEveryGradientComesBackAsItWent) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  PowerSgdOptions options;
  options.rank = 48;
  options.start_step = 0;
  options.min_compression_rate = 0;  // compress everything
  const std::vector<std::vector<int64_t>> shapes = {{64, 48}, {20, 30}};
  ExpectPowerSgdAsOnTheCpu(ctx.get(), options, shapes, 1e-4);
  // And the average of one rank is the gradient itself.
  const Bucket layout = Layout(shapes);
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  auto gpu = GpuPowerSgd::Create(ctx.get(), nccl.get(), options);
  ASSERT_TRUE(gpu.ok());
  Tensor flat = RandomTensor({static_cast<int64_t>(layout.floats)}, 5);
  GpuTensor bucket = ToDevice(ctx.get(), flat);
  ASSERT_TRUE(ctx->Synchronize().ok());  // before the NCCL stream reads it
  std::vector<GpuPowerSgd::Gradient> grads;
  for (size_t g = 0; g < shapes.size(); ++g) {
    grads.push_back({bucket.data() + layout.offsets[g], shapes[g]});
  }
  ASSERT_TRUE((*gpu)->Reduce(0, bucket.data(), layout.floats, grads).ok());
  ASSERT_TRUE(nccl->Wait("powersgd").ok());
  testing::ExpectClose("full-rank PowerSGD of one rank", ToHost(ctx.get(), bucket), flat, 1e-5);
}

// Through the reducer: a plain allreduce before start_step, compression
// after, with the bytes each step handed NCCL.
TEST(GpuPowerSgd, TheReducerCompressesFromItsStartStepAndCountsTheBytes) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  ModelConfig mlp;
  mlp.name = "mlp";
  mlp.hidden_sizes = {256, 128};
  auto model = GpuModel::Build(ctx.get(), mlp, 3);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GpuParameter*>& params = (*model)->Parameters();
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  PowerSgdOptions psgd;
  psgd.rank = 4;
  psgd.start_step = 2;
  auto reducer = GpuDdpReducer::Create(ctx.get(), params, nccl.get(),
                                       DdpOptions{.bucket_mb = 0.1, .powersgd = psgd});
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  ASSERT_NE((*reducer)->powersgd(), nullptr);
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  for (int step = 0; step < 4; ++step) {
    for (size_t k = 0; k < params.size(); ++k) {
      ASSERT_TRUE(
          params[k]->grad.CopyFromHost(ctx.get(), RandomTensor(params[k]->grad.shape(), k)).ok());
    }
    ASSERT_TRUE((*reducer)->OnGradReady(params).ok());
    ASSERT_TRUE((*reducer)->AfterBackward().ok());
    ASSERT_EQ(cudaEventRecord(done, ctx->stream()), cudaSuccess);
    ASSERT_TRUE((*reducer)->Wait(done).ok());
    const int64_t sent = (*reducer)->last_bytes_sent();
    const int64_t plain = (*reducer)->last_bytes_uncompressed();
    std::printf("  step %d: %lld of %lld bytes\n", step, static_cast<long long>(sent),
                static_cast<long long>(plain));
    if (step < 2) {
      EXPECT_EQ(sent, plain) << "step " << step;
    } else {
      EXPECT_LT(sent, plain / 10) << "step " << step;
    }
  }
  cudaEventDestroy(done);
  EXPECT_EQ((*reducer)->powersgd()->step(), 4);
}

// SyncBatchNorm over one rank: the CPU layer's statistics, output, running
// statistics and gradients, through the engine's kernels and the stream
// collectives (the statistics go out as floats, so ~1e-6 apart).
TEST(GpuSyncBatchNorm, MatchesTheCpuLayerThroughTheStreamCollectives) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{8, 16, 7, 7}, {4, 64, 1, 1}, {2, 3, 33, 17}}) {
    const int64_t channels = shape[1];
    BatchNorm2d cpu(channels);
    auto gpu = GpuBatchNorm2d::Create(ctx.get(), channels, 1e-5, 0.1);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    (*gpu)->SetBatchNormSync(nccl.get());
    // Non-trivial weights and running statistics, the same on both.
    Tensor weight = RandomTensor({channels}, 3);
    Tensor bias = RandomTensor({channels}, 4);
    std::memcpy(cpu.weight().value.data(), weight.data(), sizeof(float) * channels);
    std::memcpy(cpu.bias().value.data(), bias.data(), sizeof(float) * channels);
    ASSERT_TRUE((*gpu)->Parameters()[0]->value.CopyFromHost(ctx.get(), weight).ok());
    ASSERT_TRUE((*gpu)->Parameters()[1]->value.CopyFromHost(ctx.get(), bias).ok());
    cpu.weight().grad.Fill(0.0f);
    cpu.bias().grad.Fill(0.0f);
    const Tensor x = RandomTensor(shape, 7, 2.0f);
    const Tensor dy = RandomTensor(shape, 8);
    Tensor y, dx;
    cpu.Forward(x, &y, /*training=*/true);
    cpu.Backward(dy, &dx);
    const GpuTensor gx = ToDevice(ctx.get(), x);
    const GpuTensor gdy = ToDevice(ctx.get(), dy);
    GpuTensor gy, gdx;
    ASSERT_TRUE((*gpu)->Forward(gx, &gy, true).ok());
    ASSERT_TRUE((*gpu)->Backward(gdy, &gdx).ok());
    ASSERT_TRUE(ctx->Synchronize().ok());
    ASSERT_TRUE(nccl->Wait("sync batchnorm").ok());
    const std::string at = " " + x.ShapeString();
    testing::ExpectClose("output" + at, ToHost(ctx.get(), gy), y, 1e-5);
    testing::ExpectClose("input gradient" + at, ToHost(ctx.get(), gdx), dx, 1e-4);
    testing::ExpectClose("weight gradient" + at, ToHost(ctx.get(), (*gpu)->Parameters()[0]->grad),
                         cpu.weight().grad, 1e-5);
    testing::ExpectClose("bias gradient" + at, ToHost(ctx.get(), (*gpu)->Parameters()[1]->grad),
                         cpu.bias().grad, 1e-5);
    testing::ExpectClose("running mean" + at, ToHost(ctx.get(), (*gpu)->Buffers()[0]->value),
                         cpu.running_mean().value, 1e-5);
    testing::ExpectClose("running var" + at, ToHost(ctx.get(), (*gpu)->Buffers()[1]->value),
                         cpu.running_var().value, 1e-5);
    // Eval uses the running statistics (cuDNN's path), synced or not.
    Tensor y_eval;
    cpu.Forward(x, &y_eval, /*training=*/false);
    ASSERT_TRUE((*gpu)->Forward(gx, &gy, false).ok());
    testing::ExpectClose("eval output" + at, ToHost(ctx.get(), gy), y_eval, 1e-5);
  }
  // A collective counted per exchange: three training forwards' all-gathers
  // and three backwards' allreduces (eval exchanges nothing).
  EXPECT_EQ(nccl->sequence(), 6);
}

// The stream collectives order a collective between a stream's work before
// and after it, with no host wait in between.
TEST(GpuSyncBatchNorm, StreamCollectivesRunInTheCallersStreamOrder) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions());
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> nccl = WorldOfOne(&store);
  ASSERT_NE(nccl, nullptr);
  const Tensor values = RandomTensor({4096}, 21);
  GpuTensor in = ToDevice(ctx.get(), Tensor({4096}));
  GpuTensor out = ToDevice(ctx.get(), Tensor({4096}));
  // Queued on the compute stream, not yet run when the collective is
  // queued; read back on the compute stream after it.
  ASSERT_EQ(cudaMemcpyAsync(in.data(), values.data(), sizeof(float) * 4096, cudaMemcpyHostToDevice,
                            ctx->stream()),
            cudaSuccess);
  ASSERT_TRUE(nccl->AllGatherOn(ctx->stream(), in.data(), 4096, out.data()).ok());
  ASSERT_TRUE(nccl->AllReduceSumOn(ctx->stream(), out.data(), 4096).ok());
  Tensor got({4096});
  ASSERT_EQ(cudaMemcpyAsync(got.data(), out.data(), sizeof(float) * 4096, cudaMemcpyDeviceToHost,
                            ctx->stream()),
            cudaSuccess);
  ASSERT_TRUE(ctx->Synchronize().ok());
  EXPECT_EQ(testing::MaxRelError(got, values), 0.0);
  ASSERT_TRUE(nccl->Wait("stream collectives").ok());
  EXPECT_EQ(nccl->sequence(), 2);
}

}  // namespace
}  // namespace aidn::engine::cuda
