// The data x tensor x pipeline layout of a job's ranks, communicators per
// group (every group of a dimension reduces among its own members only, all
// of them at once, over the job's one store), and point to point between
// pipeline neighbours.

#include "worker/engine/comm/process_grid.h"

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/comm/peer_link.h"

namespace aidn::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ProcessGridTest, TensorIsInnermostThenDataThenPipeline) {
  absl::StatusOr<ProcessGrid> grid =
      ProcessGrid::Create(8, {.data = 2, .tensor = 2, .pipeline = 2});
  ASSERT_TRUE(grid.ok()) << grid.status();
  // Rank 5 = (pipeline 1 * data 2 + data 0) * tensor 2 + tensor 1.
  const GridCoords c = grid->CoordsOf(5);
  EXPECT_EQ(c.tensor, 1);
  EXPECT_EQ(c.data, 0);
  EXPECT_EQ(c.pipeline, 1);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(grid->RankOf(grid->CoordsOf(r)), r);
  EXPECT_THAT(grid->Group(5, GridDim::kTensor), ElementsAre(4, 5));
  EXPECT_THAT(grid->Group(5, GridDim::kData), ElementsAre(5, 7));
  EXPECT_THAT(grid->Group(5, GridDim::kPipeline), ElementsAre(1, 5));
  EXPECT_EQ(grid->GroupName(5, GridDim::kTensor), "tensor/d0p1");
  EXPECT_EQ(grid->GroupName(4, GridDim::kTensor), "tensor/d0p1");
  EXPECT_EQ(grid->GroupName(6, GridDim::kTensor), "tensor/d1p1");
  // Every rank is in exactly one group of each dimension.
  for (GridDim dim : {GridDim::kData, GridDim::kTensor, GridDim::kPipeline}) {
    std::set<std::string> names;
    for (int r = 0; r < 8; ++r) {
      names.insert(grid->GroupName(r, dim));
      for (int member : grid->Group(r, dim)) {
        EXPECT_EQ(grid->GroupName(member, dim), grid->GroupName(r, dim)) << GridDimName(dim);
      }
    }
    EXPECT_EQ(static_cast<int>(names.size()), 8 / grid->Size(dim)) << GridDimName(dim);
  }
}

TEST(ProcessGridTest, ShapesThatDoNotMakeTheWorldAreRefusedNamingTheSizes) {
  absl::StatusOr<ProcessGrid> bad = ProcessGrid::Create(6, {.data = 2, .tensor = 2, .pipeline = 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("world_size 6 is not data x tensor x pipeline = 2 x 2 x 2 = 8"));
  EXPECT_FALSE(ProcessGrid::Create(2, {.data = 2, .tensor = 0, .pipeline = 1}).ok());
  absl::StatusOr<ProcessGrid> plain = ProcessGrid::Create(3, {.data = 3});
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(plain->Group(1, GridDim::kData), ElementsAre(0, 1, 2));
  EXPECT_THAT(plain->Group(1, GridDim::kTensor), ElementsAre(1));
}

// 8 ranks, 2 x 2 x 2: each rank joins its three groups (in the same order
// everywhere) and all-reduces its rank in each; the sum is its group's.
TEST(GroupCommunicatorTest, EachGroupReducesAmongItsMembersOnly) {
  const absl::StatusOr<ProcessGrid> grid =
      ProcessGrid::Create(8, {.data = 2, .tensor = 2, .pipeline = 2});
  ASSERT_TRUE(grid.ok());
  for (CpuTransport transport : {CpuTransport::kShm, CpuTransport::kGloo}) {
    SCOPED_TRACE(transport == CpuTransport::kShm ? "shm" : "gloo");
    std::vector<absl::Status> results =
        testing::RunRanks(8, [&](int rank, KeyValueStore& store) -> absl::Status {
          CpuCommunicatorOptions options;
          options.gloo.rank = rank;
          options.gloo.world_size = 8;
          options.gloo.timeout = std::chrono::seconds(60);
          options.gloo.prefix = "job";
          options.transport = transport;
          options.shm_slot_bytes = size_t{64} << 10;
          for (GridDim dim : {GridDim::kTensor, GridDim::kData, GridDim::kPipeline}) {
            const std::vector<int> members = grid->Group(rank, dim);
            AIDN_ASSIGN_OR_RETURN(
                CpuCommunicator group,
                CreateCpuGroupCommunicator(options, members, grid->GroupName(rank, dim), &store));
            if (group.communicator->world_size() != 2) {
              return absl::InternalError("group of the wrong size");
            }
            float value = static_cast<float>(rank);
            AIDN_RETURN_IF_ERROR(group.communicator->AllReduce(&value, 1, ReduceOp::kSum));
            const float want = static_cast<float>(members[0] + members[1]);
            if (value != want) {
              return absl::InternalError(absl::StrCat(GridDimName(dim), " group of rank ", rank,
                                                      ": sum ", value, ", want ", want));
            }
          }
          return absl::OkStatus();
        });
    EXPECT_TRUE(testing::AllOk(results));
  }
}

TEST(GroupCommunicatorTest, ARankOutsideItsGroupIsRefused) {
  CpuCommunicatorOptions options;
  options.gloo.rank = 3;
  options.gloo.world_size = 4;
  absl::StatusOr<CpuCommunicator> outside =
      CreateCpuGroupCommunicator(options, {0, 1}, "tensor/d0p0", nullptr);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("rank 3 is not one of its"));
  absl::StatusOr<CpuCommunicator> repeated =
      CreateCpuGroupCommunicator(options, {3, 3}, "g", nullptr);
  EXPECT_EQ(repeated.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<CpuCommunicator> alone = CreateCpuGroupCommunicator(options, {3}, "g", nullptr);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->communicator->world_size(), 1);
}

// The link between stages `left` and `left + 1` of a pipeline of `world`.
absl::StatusOr<PeerLink> LinkTo(int rank, int world, int left, CpuTransport transport,
                                KeyValueStore& store) {
  CpuCommunicatorOptions options;
  options.gloo.rank = rank;
  options.gloo.world_size = world;
  options.gloo.timeout = std::chrono::seconds(60);
  options.transport = transport;
  options.shm_slot_bytes = size_t{64} << 10;
  AIDN_ASSIGN_OR_RETURN(
      CpuCommunicator pair,
      CreateCpuGroupCommunicator(options, {left, left + 1}, absl::StrCat("edge/", left), &store));
  return PeerLink::Create(std::move(pair.communicator));
}

float StageValue(int stage, size_t i) {
  return static_cast<float>(stage * 1000 + static_cast<int>(i % 997));
}

// Four stages: an activation goes forward stage by stage (Send/Recv, a
// buffer larger than a shared-memory slot), then every neighbour pair
// exchanges at once in both directions with different sizes (1F1B's
// steady state), evens with their right neighbour first, odds with their
// left, as a schedule pairs them.
TEST(PeerLinkTest, SendRecvAndExchangeBetweenPipelineNeighbours) {
  constexpr int kStages = 4;
  constexpr size_t kActivation = 40'000;  // > one 64 KiB slot
  constexpr size_t kGradient = 3'000;
  for (CpuTransport transport : {CpuTransport::kShm, CpuTransport::kGloo}) {
    SCOPED_TRACE(transport == CpuTransport::kShm ? "shm" : "gloo");
    std::vector<absl::Status> results =
        testing::RunRanks(kStages, [&](int rank, KeyValueStore& store) -> absl::Status {
          std::optional<PeerLink> left, right;
          // Links are made left to right, as every stage agrees.
          if (rank > 0) {
            AIDN_ASSIGN_OR_RETURN(PeerLink link, LinkTo(rank, kStages, rank - 1, transport, store));
            left.emplace(std::move(link));
          }
          if (rank + 1 < kStages) {
            AIDN_ASSIGN_OR_RETURN(PeerLink link, LinkTo(rank, kStages, rank, transport, store));
            right.emplace(std::move(link));
          }
          std::vector<float> activation(kActivation);
          if (rank == 0) {
            for (size_t i = 0; i < kActivation; ++i) activation[i] = StageValue(0, i);
          } else {
            AIDN_RETURN_IF_ERROR(left->Recv(activation.data(), kActivation));
            for (size_t i = 0; i < kActivation; ++i) {
              if (activation[i] != StageValue(0, i) + static_cast<float>(rank)) {
                return absl::InternalError(
                    absl::StrCat("stage ", rank, " got a wrong element ", i));
              }
            }
          }
          for (float& x : activation) x += 1.0f;
          if (right.has_value()) AIDN_RETURN_IF_ERROR(right->Send(activation.data(), kActivation));
          AIDN_RETURN_IF_ERROR(right.has_value() ? right->Send(nullptr, 0) : absl::OkStatus());
          if (left.has_value()) {
            std::vector<float> none;
            AIDN_RETURN_IF_ERROR(left->Recv(none.data(), 0));
          }

          // Exchange: forward an activation to the right, a gradient back to
          // the left.
          auto with_right = [&]() -> absl::Status {
            std::vector<float> send(kActivation), got(kGradient);
            for (size_t i = 0; i < kActivation; ++i) send[i] = StageValue(rank, i);
            AIDN_RETURN_IF_ERROR(right->Exchange(send.data(), kActivation, got.data(), kGradient));
            for (size_t i = 0; i < kGradient; ++i) {
              if (got[i] != -StageValue(rank + 1, i)) return absl::InternalError("wrong gradient");
            }
            return absl::OkStatus();
          };
          auto with_left = [&]() -> absl::Status {
            std::vector<float> send(kGradient), got(kActivation);
            for (size_t i = 0; i < kGradient; ++i) send[i] = -StageValue(rank, i);
            AIDN_RETURN_IF_ERROR(left->Exchange(send.data(), kGradient, got.data(), kActivation));
            for (size_t i = 0; i < kActivation; ++i) {
              if (got[i] != StageValue(rank - 1, i)) return absl::InternalError("wrong activation");
            }
            return absl::OkStatus();
          };
          const bool even = rank % 2 == 0;
          if (even && right.has_value()) AIDN_RETURN_IF_ERROR(with_right());
          if (left.has_value()) AIDN_RETURN_IF_ERROR(with_left());
          if (!even && right.has_value()) AIDN_RETURN_IF_ERROR(with_right());
          return absl::OkStatus();
        });
    EXPECT_TRUE(testing::AllOk(results));
  }
}

TEST(PeerLinkTest, OnlyACommunicatorOfTwoRanksMakesALink) {
  CpuCommunicatorOptions options;  // one rank: Gloo without a store
  absl::StatusOr<CpuCommunicator> one = CreateCpuCommunicator(options, nullptr);
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<PeerLink> link = PeerLink::Create(std::move(one->communicator));
  EXPECT_EQ(link.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(link.status().message()), HasSubstr("2 ranks, got 1"));
}

}  // namespace
}  // namespace aidn::engine
