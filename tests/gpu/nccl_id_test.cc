// The NCCL unique-id hand-out through a KeyValueStore: rank 0 creates and
// publishes, the others wait. ncclGetUniqueId needs no GPU, so this runs on
// every machine the CUDA targets build on.
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/nccl_communicator.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

// NCCL's bootstrap listens on an interface of its choosing: loopback only.
void LoopbackOnly() { setenv("NCCL_SOCKET_IFNAME", "lo", 0); }

NcclOptions Options(int rank, int world, std::chrono::milliseconds timeout) {
  NcclOptions o;
  o.rank = rank;
  o.world_size = world;
  o.prefix = "nccl-test";
  o.timeout = timeout;
  return o;
}

TEST(ExchangeNcclUniqueId, EveryRankGetsRankZerosId) {
  LoopbackOnly();
  for (int world : {1, 2, 4}) {
    SCOPED_TRACE(world);
    InMemoryKeyValueStore store;
    std::vector<absl::StatusOr<ncclUniqueId>> ids(world, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    // The waiting ranks start first: they must wait, not fail.
    for (int r = world - 1; r >= 0; --r) {
      threads.emplace_back([&, r] {
        if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        ids[r] = ExchangeNcclUniqueId(Options(r, world, std::chrono::seconds(10)), &store);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(ids[0].ok()) << ids[0].status();
    const std::string zero(sizeof(ncclUniqueId), '\0');
    EXPECT_NE(std::string(ids[0]->internal, sizeof(ids[0]->internal)), zero);
    for (int r = 1; r < world; ++r) {
      ASSERT_TRUE(ids[r].ok()) << "rank " << r << ": " << ids[r].status();
      EXPECT_EQ(std::memcmp(ids[r]->internal, ids[0]->internal, sizeof(ids[0]->internal)), 0)
          << "rank " << r;
    }
  }
}

TEST(ExchangeNcclUniqueId, AMissingRankZeroTimesOutNamingTheKey) {
  InMemoryKeyValueStore store;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ncclUniqueId> id =
      ExchangeNcclUniqueId(Options(1, 2, std::chrono::milliseconds(150)), &store);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(id.status().message(), HasSubstr("rank 1"));
  EXPECT_THAT(id.status().message(), HasSubstr("nccl-test/id"));
}

TEST(ExchangeNcclUniqueId, RefusesARankOutsideTheWorld) {
  InMemoryKeyValueStore store;
  for (auto [rank, world] : {std::pair{2, 2}, std::pair{-1, 2}, std::pair{0, 0}}) {
    absl::StatusOr<ncclUniqueId> id =
        ExchangeNcclUniqueId(Options(rank, world, std::chrono::milliseconds(10)), &store);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  }
}

TEST(ExchangeNcclUniqueId, AValueOfTheWrongSizeIsRefused) {
  InMemoryKeyValueStore store;
  ASSERT_TRUE(store.Set("nccl-test/id", "short").ok());
  absl::StatusOr<ncclUniqueId> id =
      ExchangeNcclUniqueId(Options(1, 2, std::chrono::milliseconds(100)), &store);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(id.status().message(), HasSubstr("5 bytes"));
}

TEST(NcclError, NamesTheCallAndMapsTheCode) {
  EXPECT_TRUE(NcclError("x", ncclSuccess).ok());
  absl::Status remote = NcclError("nccl allreduce of 4 floats", ncclRemoteError);
  EXPECT_EQ(remote.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(remote.message(), HasSubstr("nccl allreduce of 4 floats: "));
  EXPECT_EQ(NcclError("y", ncclInvalidArgument).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclError("z", ncclUnhandledCudaError).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace aidn::engine
