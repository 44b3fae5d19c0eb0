// Megatron's column- and row-parallel linear layers against the dense
// layers they split: a column-then-row pair over 2 and 3 ranks (shared
// memory and Gloo) gives the dense pair's output and input gradient, and
// each rank's weight gradient is the matching slice of the dense one.

#include "worker/engine/tensor_parallel.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/layers.h"

namespace aidn::engine {
namespace {

constexpr int64_t kBatch = 6, kIn = 8, kHidden = 12, kOut = 5;

void Fill(Tensor* t, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t->numel(); ++i) t->data()[i] = normal(gen);
}

// max |a - b| / max(1, max |b|) over `n` elements.
double RelDiff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

absl::Status Near(const std::string& what, const float* got, const float* want, int64_t n) {
  const double d = RelDiff(got, want, n);
  if (d > 1e-5) return absl::InternalError(absl::StrCat(what, ": relative difference ", d));
  return absl::OkStatus();
}

class TensorParallelTest : public ::testing::TestWithParam<std::tuple<int, CpuTransport>> {};

TEST_P(TensorParallelTest, AColumnRowPairMatchesTheDenseLayersItSplits) {
  const auto [world, transport] = GetParam();
  // The dense pair, its weights, a batch and an output gradient.
  Linear first(kIn, kHidden), second(kHidden, kOut);
  Fill(&first.weight().value, 1);
  Fill(&first.bias().value, 2);
  Fill(&second.weight().value, 3);
  Fill(&second.bias().value, 4);
  Tensor x({kBatch, kIn}), grad_y({kBatch, kOut});
  Fill(&x, 5);
  Fill(&grad_y, 6);
  Tensor h, y, grad_h, grad_x;
  first.Forward(x, &h, true);
  second.Forward(h, &y, true);
  second.Backward(grad_y, &grad_h);
  first.Backward(grad_h, &grad_x);

  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        CpuCommunicatorOptions options;
        options.gloo.rank = rank;
        options.gloo.world_size = world;
        options.gloo.timeout = std::chrono::seconds(60);
        options.transport = transport;
        options.shm_slot_bytes = size_t{64} << 10;
        AIDN_ASSIGN_OR_RETURN(CpuCommunicator group, CreateCpuCommunicator(options, &store));
        ColumnParallelLinear column(kIn, kHidden, group.communicator.get());
        RowParallelLinear row(kHidden, kOut, group.communicator.get());
        column.LoadShardOf(first.weight().value, first.bias().value);
        row.LoadShardOf(second.weight().value, second.bias().value);
        Tensor h_shard, y_tp, grad_h_shard, grad_x_tp;
        AIDN_RETURN_IF_ERROR(column.Forward(x, &h_shard));
        AIDN_RETURN_IF_ERROR(row.Forward(h_shard, &y_tp));
        AIDN_RETURN_IF_ERROR(Near("output", y_tp.data(), y.data(), y.numel()));
        AIDN_RETURN_IF_ERROR(row.Backward(grad_y, &grad_h_shard));
        AIDN_RETURN_IF_ERROR(column.Backward(grad_h_shard, &grad_x_tp));
        AIDN_RETURN_IF_ERROR(
            Near("input gradient", grad_x_tp.data(), grad_x.data(), grad_x.numel()));

        // Column shard: rows [rank*s, (rank+1)*s) of the dense first layer.
        const int64_t s = kHidden / world;
        AIDN_RETURN_IF_ERROR(Near("column weight gradient", column.weight().grad.data(),
                                  first.weight().grad.data() + rank * s * kIn, s * kIn));
        AIDN_RETURN_IF_ERROR(Near("column bias gradient", column.bias().grad.data(),
                                  first.bias().grad.data() + rank * s, s));
        // Row shard: columns [rank*s, (rank+1)*s) of the dense second layer.
        std::vector<float> slice;
        for (int64_t r = 0; r < kOut; ++r) {
          const float* from = second.weight().grad.data() + r * kHidden + rank * s;
          slice.insert(slice.end(), from, from + s);
        }
        AIDN_RETURN_IF_ERROR(
            Near("row weight gradient", row.weight().grad.data(), slice.data(), kOut * s));
        AIDN_RETURN_IF_ERROR(
            Near("row bias gradient", row.bias().grad.data(), second.bias().grad.data(), kOut));
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
}

INSTANTIATE_TEST_SUITE_P(Groups, TensorParallelTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(CpuTransport::kShm,
                                                              CpuTransport::kGloo)),
                         [](const ::testing::TestParamInfo<std::tuple<int, CpuTransport>>& info) {
                           return absl::StrCat(
                               std::get<0>(info.param), "Ranks",
                               std::get<1>(info.param) == CpuTransport::kShm ? "Shm" : "Gloo");
                         });

}  // namespace
}  // namespace aidn::engine
