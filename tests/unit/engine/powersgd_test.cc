// PowerSGD (PowerSgd, powerSGD_hook's semantics) over 2 and 3 ranks on
// shared memory: with r = min(n, m) every gradient comes back averaged, to
// rounding; the error kept is the input (with the last error) minus the
// output; before start_step the bucket is plainly averaged and nothing is
// kept; warm start makes repeated steps on the same gradients converge (the
// power iteration); only the matrices whose compression pays are
// compressed, and the floats sent say so.

#include "worker/engine/powersgd.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/comm/cpu_communicator.h"

// A namespace of its own: the test binary is a unity build.
namespace aidn::engine::powersgd_test {
namespace {

absl::StatusOr<std::unique_ptr<Communicator>> Comm(int rank, int world, KeyValueStore& store) {
  CpuCommunicatorOptions options;
  options.gloo.rank = rank;
  options.gloo.world_size = world;
  options.gloo.timeout = std::chrono::seconds(60);
  options.transport = CpuTransport::kShm;
  options.shm_slot_bytes = size_t{64} << 10;
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator c, CreateCpuCommunicator(options, &store));
  return std::move(c.communicator);
}

int64_t Floats(const std::vector<std::vector<int64_t>>& shapes) {
  int64_t n = 0;
  for (const auto& s : shapes) {
    int64_t k = 1;
    for (int64_t d : s) k *= d;
    n += k;
  }
  return n;
}

// Rank `rank`'s gradients at `step`: the same in every run.
std::vector<float> Grads(int rank, int step, int64_t floats) {
  std::mt19937 gen(static_cast<uint32_t>(100 * step + rank));
  std::normal_distribution<float> normal;
  std::vector<float> g(static_cast<size_t>(floats));
  for (float& v : g) v = normal(gen);
  return g;
}

std::vector<float> Mean(int world, int step, int64_t floats) {
  std::vector<double> sum(static_cast<size_t>(floats), 0.0);
  for (int r = 0; r < world; ++r) {
    const std::vector<float> g = Grads(r, step, floats);
    for (size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
  }
  std::vector<float> mean(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) mean[i] = static_cast<float>(sum[i] / world);
  return mean;
}

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

const std::vector<std::vector<int64_t>> kShapes = {{6, 4}, {5}, {3, 7}, {4, 2, 3}};

class PowerSgdTest : public ::testing::TestWithParam<int> {};

TEST_P(PowerSgdTest, AtFullRankTheBucketComesBackAveraged) {
  const int world = GetParam();
  const int64_t floats = Floats(kShapes);
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, Comm(rank, world, store));
        PowerSgd psgd({.rank = 8, .start_step = 1, .min_compression_rate = 0.0});
        for (int step = 0; step < 3; ++step) {
          std::vector<float> g = Grads(rank, step, floats);
          AIDN_RETURN_IF_ERROR(psgd.Reduce(0, g.data(), kShapes, comm.get()));
          psgd.EndStep();
          const double d = RelDiff(g, Mean(world, step, floats));
          if (d > 1e-5) return absl::InternalError(absl::StrCat("step ", step, ": ", d));
          // Every matrix compressed at r = min(n, m): (n + m) r each.
          const int64_t sent = step == 0 ? floats  // a plain allreduce first
                                         : (6 + 4) * 4 + (5 + 1) * 1 + (3 + 7) * 3 + (4 + 6) * 4;
          if (psgd.last_floats_sent() != sent || psgd.last_floats_uncompressed() != floats) {
            return absl::InternalError(absl::StrCat("sent ", psgd.last_floats_sent()));
          }
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
}

TEST_P(PowerSgdTest, TheErrorKeptIsTheInputMinusTheOutput) {
  const int world = GetParam();
  const std::vector<std::vector<int64_t>> shapes = {{16, 12}, {12}};
  const int64_t floats = Floats(shapes);
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, Comm(rank, world, store));
        PowerSgd psgd({.rank = 1, .start_step = 1});
        std::vector<float> last_error(static_cast<size_t>(floats), 0.0f);
        for (int step = 0; step < 4; ++step) {
          const std::vector<float> in = Grads(rank, step, floats);
          std::vector<float> g = in;
          AIDN_RETURN_IF_ERROR(psgd.Reduce(3, g.data(), shapes, comm.get()));
          psgd.EndStep();
          const std::vector<float>* error = psgd.error(3);
          if (step == 0) {
            // A plain allreduce: averaged exactly, nothing kept.
            if (error != nullptr) return absl::InternalError("an error before start_step");
            if (RelDiff(g, Mean(world, 0, floats)) > 1e-6) {
              return absl::InternalError("not averaged before start_step");
            }
            continue;
          }
          if (error == nullptr) return absl::InternalError("no error kept");
          for (int64_t i = 0; i < floats; ++i) {
            const float want = in[static_cast<size_t>(i)] + last_error[static_cast<size_t>(i)] -
                               g[static_cast<size_t>(i)];
            if (std::abs((*error)[static_cast<size_t>(i)] - want) > 1e-5f) {
              return absl::InternalError(absl::StrCat("step ", step, " element ", i, ": error ",
                                                      (*error)[static_cast<size_t>(i)], ", want ",
                                                      want));
            }
          }
          // The vector is not compressed: as in torch, its error is the
          // rank's input less the average (the ranks' errors sum to 0).
          last_error = *error;
          // Rank 1 of 16 x 12: P and Q (16 + 12 floats) and the vector.
          if (psgd.last_floats_sent() != 16 + 12 + 12) {
            return absl::InternalError(absl::StrCat("sent ", psgd.last_floats_sent()));
          }
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
}

TEST_P(PowerSgdTest, WarmStartConvergesOnRepeatedGradients) {
  const int world = GetParam();
  const std::vector<std::vector<int64_t>> shapes = {{24, 20}};
  const int64_t floats = Floats(shapes);
  // The best rank-2 approximation of the mean is what the power iteration
  // approaches; its distance from the mean is what remains.
  auto run = [&](bool warm) {
    std::vector<double> distance(6);
    std::vector<absl::Status> results =
        testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
          AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, Comm(rank, world, store));
          PowerSgd psgd({.rank = 2,
                         .start_step = 0,
                         .min_compression_rate = 1.0,
                         .error_feedback = false,
                         .warm_start = warm});
          for (int step = 0; step < 6; ++step) {
            std::vector<float> g = Grads(rank, 0, floats);  // the same every step
            AIDN_RETURN_IF_ERROR(psgd.Reduce(0, g.data(), shapes, comm.get()));
            psgd.EndStep();
            if (rank == 0) distance[static_cast<size_t>(step)] = RelDiff(g, Mean(world, 0, floats));
          }
          return absl::OkStatus();
        });
    EXPECT_TRUE(testing::AllOk(results));
    return distance;
  };
  const std::vector<double> warm = run(true);
  for (size_t s = 1; s < warm.size(); ++s) {
    EXPECT_LE(warm[s], warm[s - 1] + 1e-6) << "step " << s;
  }
  EXPECT_LT(warm.back(), warm.front()) << "warm start did not improve the approximation";
}

INSTANTIATE_TEST_SUITE_P(Ranks, PowerSgdTest, ::testing::Values(2, 3));

TEST(OrthogonalizeColumns, GivesOrthonormalColumnsAndLeavesAZeroColumnZero) {
  std::vector<float> a = {1, 2, 0, 3, 4, 0, 5, 7, 0, 1, 1, 0};  // 4 x 3, last column 0
  OrthogonalizeColumns(a.data(), 4, 3);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      double dot = 0;
      for (int r = 0; r < 4; ++r) dot += static_cast<double>(a[r * 3 + i]) * a[r * 3 + j];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5) << i << "," << j;  // float32
    }
  }
  for (int r = 0; r < 4; ++r) EXPECT_EQ(a[r * 3 + 2], 0.0f);
}

}  // namespace
}  // namespace aidn::engine::powersgd_test
