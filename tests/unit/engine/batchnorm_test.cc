// BatchNorm2d as SyncBatchNorm: two Gloo ranks, each with half of a batch,
// normalise as one BatchNorm over the whole batch does (torch's
// SyncBatchNorm runs on GPUs only, so the whole-batch layer is the
// oracle; it matches torch's BatchNorm2d in integration_resnet_torch_test).

#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::engine::batchnorm_test {
namespace {

Tensor Random(std::vector<int64_t> shape, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.5f, 2.0f);
  Tensor t(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = normal(gen);
  return t;
}

// Rows [begin, begin + n) of an NCHW tensor.
Tensor Rows(const Tensor& t, int64_t begin, int64_t n) {
  const int64_t row = t.numel() / t.dim(0);
  Tensor out({n, t.dim(1), t.dim(2), t.dim(3)});
  for (int64_t i = 0; i < n * row; ++i) out[i] = t[begin * row + i];
  return out;
}

void ExpectNear(const Tensor& got, const Tensor& want, int64_t offset, float tolerance,
                const char* what) {
  for (int64_t i = 0; i < got.numel(); ++i) {
    ASSERT_NEAR(got[i], want[offset + i], tolerance * (1.0f + std::abs(want[offset + i])))
        << what << "[" << i << "]";
  }
}

TEST(SyncBatchNorm, TwoRanksWithHalfABatchEachNormaliseAsOneWholeBatch) {
  constexpr int64_t kChannels = 3;
  const Tensor x = Random({6, kChannels, 4, 5}, 1);
  const Tensor dy = Random({6, kChannels, 4, 5}, 2);
  // The oracle: one layer over the whole batch.
  BatchNorm2d whole(kChannels);
  for (int64_t c = 0; c < kChannels; ++c) {
    whole.weight().value[c] = 0.5f + static_cast<float>(c);
    whole.bias().value[c] = 0.1f * static_cast<float>(c);
  }
  Tensor y, dx;
  whole.Forward(x, &y, /*training=*/true);
  whole.Backward(dy, &dx);

  // Uneven halves: 2 and 4 samples.
  const int64_t split[2][2] = {{0, 2}, {2, 4}};
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> weight_grads(2), bias_grads(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions options;
      options.rank = r;
      options.world_size = 2;
      options.timeout = std::chrono::seconds(30);
      options.prefix = "syncbn-test";
      auto comm = CreateGlooCommunicator(options, &store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      BatchNorm2d layer(kChannels);
      for (int64_t c = 0; c < kChannels; ++c) {
        layer.weight().value[c] = 0.5f + static_cast<float>(c);
        layer.bias().value[c] = 0.1f * static_cast<float>(c);
      }
      layer.SetBatchNormSync(comm->get());
      const Tensor mine = Rows(x, split[r][0], split[r][1]);
      const Tensor my_dy = Rows(dy, split[r][0], split[r][1]);
      Tensor out, grad;
      layer.Forward(mine, &out, /*training=*/true);
      layer.Backward(my_dy, &grad);
      ASSERT_TRUE(layer.TakeCollectiveStatus().ok());
      const int64_t row = x.numel() / x.dim(0);
      ExpectNear(out, y, split[r][0] * row, 1e-5f, "output");
      ExpectNear(grad, dx, split[r][0] * row, 1e-4f, "input gradient");
      ExpectNear(layer.running_mean().value, whole.running_mean().value, 0, 1e-6f, "running_mean");
      ExpectNear(layer.running_var().value, whole.running_var().value, 0, 1e-6f, "running_var");
      const Tensor& gw = layer.weight().grad;
      const Tensor& gb = layer.bias().grad;
      weight_grads[static_cast<size_t>(r)].assign(gw.data(), gw.data() + gw.numel());
      bias_grads[static_cast<size_t>(r)].assign(gb.data(), gb.data() + gb.numel());
      // Evaluation uses the running statistics alone: no collective.
      layer.Forward(mine, &out, /*training=*/false);
    });
  }
  for (std::thread& t : threads) t.join();
  // Each rank's parameter gradients are its own share: they sum to the
  // whole batch's (DDP then averages them).
  for (int64_t c = 0; c < kChannels; ++c) {
    EXPECT_NEAR(weight_grads[0][c] + weight_grads[1][c], whole.weight().grad[c], 1e-4f);
    EXPECT_NEAR(bias_grads[0][c] + bias_grads[1][c], whole.bias().grad[c], 1e-4f);
  }
}

}  // namespace
}  // namespace aidn::engine::batchnorm_test
