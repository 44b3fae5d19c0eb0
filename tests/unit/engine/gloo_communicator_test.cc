// What only the Gloo communicator does, with every rank a thread of this
// process meeting through one in-memory KeyValueStore on 127.0.0.1: its
// direct exchange and cached options, creation without a store, SIGPIPE,
// rendezvous and peer failures, a store's status carried through Gloo. The
// collectives every communicator shares are in
// communicator_conformance_test.cc.

#include "worker/engine/comm/gloo_communicator.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "tests/unit/engine/communicator_conformance.h"

namespace aidn::engine {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kGlooTimeout{30'000};
constexpr size_t kLarge = size_t{1} << 20;

GlooOptions Options(int rank, int world_size, std::chrono::milliseconds timeout = kGlooTimeout) {
  GlooOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = timeout;
  options.prefix = "test";
  return options;
}

// Runs `body` on `world_size` threads, each with its own communicator over
// one shared store, and returns each rank's status (the communicator's
// creation error, or what `body` returned).
std::vector<absl::Status> RunRanks(int world_size,
                                   const std::function<absl::Status(int, Communicator&)>& body,
                                   std::chrono::milliseconds timeout = kGlooTimeout) {
  return testing::RunRanks(world_size, [&](int rank, KeyValueStore& store) -> absl::Status {
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        CreateGlooCommunicator(Options(rank, world_size, timeout), &store);
    if (!comm.ok()) return comm.status();
    return body(rank, **comm);
  });
}

TEST(GlooCommunicator, RepeatedAllReducesOnFreshAndReusedBuffersStayExact) {
  // Small buffers go through the direct exchange (its staging area grows
  // and is reused), large ones through gloo::allreduce with options cached
  // per buffer; each rank allocates its own buffers, so pointers differ
  // between ranks and between calls.
  constexpr int kWorld = 3;
  ExpectAllOk(RunRanks(kWorld, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> reused(100'000);
    for (int round = 0; round < 2; ++round) {
      for (size_t count = 1; count <= 40; count += 2) {
        std::vector<float> fresh(count);
        for (size_t i = 0; i < count; ++i) fresh[i] = static_cast<float>(rank + i + round);
        if (absl::Status s = comm.AllReduce(fresh.data(), count, ReduceOp::kSum); !s.ok()) {
          return s;
        }
        EXPECT_TRUE(Matches(
            fresh,
            [&](size_t i) {
              return TriangularSum(kWorld) + static_cast<float>(kWorld * (i + round));
            },
            rank));
      }
      for (size_t count : {size_t{100'000}, size_t{20'000}}) {
        for (size_t i = 0; i < count; ++i) reused[i] = static_cast<float>(rank * 2 + round);
        if (absl::Status s = comm.AllReduce(reused.data(), count, ReduceOp::kSum); !s.ok()) {
          return s;
        }
        std::vector<float> got(reused.begin(), reused.begin() + count);
        EXPECT_TRUE(Matches(
            got, [&](size_t) { return static_cast<float>(2 * 3 + kWorld * round); }, rank));
      }
    }
    return absl::OkStatus();
  }));
}

TEST(GlooCommunicator, AllGatherAcceptsItsInputAlreadyInPlace) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 5;
  ExpectAllOk(RunRanks(kWorld, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> out(kCount * kWorld, -1.0f);
    float* mine = out.data() + rank * kCount;
    for (size_t i = 0; i < kCount; ++i) mine[i] = static_cast<float>(10 * rank + i);
    if (absl::Status s = comm.AllGather(mine, kCount, out.data()); !s.ok()) return s;
    EXPECT_TRUE(Matches(
        out, [&](size_t j) { return static_cast<float>(10 * (j / kCount) + j % kCount); }, rank));
    return absl::OkStatus();
  }));
}

TEST(GlooCommunicator, WorldSizeOneNeedsNoStoreAndCopiesLocally) {
  absl::StatusOr<std::unique_ptr<Communicator>> created =
      CreateGlooCommunicator(Options(0, 1), nullptr);
  ASSERT_TRUE(created.ok()) << created.status();
  Communicator& comm = **created;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.world_size(), 1);
  std::vector<float> data = {1.5f, -2.0f, 3.0f};
  ASSERT_TRUE(comm.AllReduce(data.data(), data.size(), ReduceOp::kAvg).ok());
  EXPECT_EQ(data, (std::vector<float>{1.5f, -2.0f, 3.0f}));
  ASSERT_TRUE(comm.Broadcast(data.data(), data.size(), 0).ok());
  std::vector<float> out(3, 0.0f);
  ASSERT_TRUE(comm.AllGather(data.data(), data.size(), out.data()).ok());
  EXPECT_EQ(out, data);
  std::vector<float> scattered(3, 0.0f);
  ASSERT_TRUE(comm.ReduceScatter(data.data(), data.size(), scattered.data(), ReduceOp::kSum).ok());
  EXPECT_EQ(scattered, data);
  ASSERT_TRUE(comm.Barrier().ok());
  EXPECT_EQ(comm.sequence(), 5);
}

// A peer that closes its socket while this rank writes must give this rank
// an error (EPIPE), not kill its process with SIGPIPE: creating a
// communicator leaves SIGPIPE ignored where the process had not chosen.
TEST(GlooCommunicator, CreatingOneLeavesSigpipeIgnored) {
  absl::StatusOr<std::unique_ptr<Communicator>> created =
      CreateGlooCommunicator(Options(0, 1), nullptr);
  ASSERT_TRUE(created.ok()) << created.status();
  struct sigaction current = {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &current), 0);
  EXPECT_EQ(current.sa_handler, SIG_IGN);
}

TEST(GlooCommunicator, BadOptionsAndArgumentsAreInvalidArguments) {
  InMemoryKeyValueStore memory;
  KeyValueStore* store = &memory;
  EXPECT_EQ(CreateGlooCommunicator(Options(0, 0), store).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateGlooCommunicator(Options(2, 2), store).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateGlooCommunicator(Options(-1, 2), store).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateGlooCommunicator(Options(0, 2), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreateGlooCommunicator(Options(0, 2, std::chrono::milliseconds(0)), store).status().code(),
      absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateGlooCommunicator(Options(0, 1), store);
  ASSERT_TRUE(comm.ok()) << comm.status();
  float x = 1.0f;
  EXPECT_EQ((*comm)->Broadcast(&x, 1, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->AllReduce(nullptr, 4, ReduceOp::kSum).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->sequence(), 0);
  // A refused call leaves the communicator usable.
  EXPECT_TRUE((*comm)->AllReduce(&x, 1, ReduceOp::kSum).ok());
}

TEST(GlooCommunicator, APeerThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  constexpr int kWorld = 3;
  constexpr std::chrono::milliseconds kShort{2'000};
  InMemoryKeyValueStore store;
  std::vector<absl::Status> results(kWorld - 1);
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  // Rank 2 never shows up.
  for (int rank = 0; rank < kWorld - 1; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = CreateGlooCommunicator(Options(rank, kWorld, kShort), &store).status();
    });
  }
  for (std::thread& t : threads) t.join();
  const auto elapsed = Clock::now() - start;
  for (int rank = 0; rank < kWorld - 1; ++rank) {
    EXPECT_EQ(results[rank].code(), absl::StatusCode::kDeadlineExceeded)
        << "rank " << rank << ": " << results[rank];
    EXPECT_THAT(std::string(results[rank].message()), HasSubstr("gloo rendezvous of rank"));
  }
  EXPECT_GE(elapsed, kShort);
  EXPECT_LT(elapsed, kShort + std::chrono::seconds(10));
}

TEST(GlooCommunicator, APeerThatLeavesFailsTheNextCollectiveWithoutAHang) {
  constexpr int kWorld = 2;
  constexpr std::chrono::milliseconds kShort{2'000};
  std::vector<absl::Status> results = RunRanks(
      kWorld,
      [&](int rank, Communicator& comm) -> absl::Status {
        if (absl::Status s = comm.Barrier(); !s.ok()) return s;
        if (rank == 1) return absl::OkStatus();  // Its communicator closes.
        std::vector<float> data(kLarge, 1.0f);
        const Clock::time_point start = Clock::now();
        absl::Status failed = comm.AllReduce(data.data(), data.size(), ReduceOp::kSum);
        EXPECT_THAT(failed.code(),
                    AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
            << failed;
        EXPECT_LT(Clock::now() - start, kShort + std::chrono::seconds(10));
        return absl::OkStatus();
      },
      kShort);
  ExpectAllOk(results);
}

// A store that refuses every write the way the coordinator refuses a stale
// generation.
class SupersededStore final : public KeyValueStore {
 public:
  absl::Status Set(const std::string&, const std::string&) override {
    return absl::FailedPreconditionError("generation 1 of job-1 is superseded by 2");
  }
  absl::StatusOr<std::string> Get(const std::string&, std::chrono::milliseconds) override {
    return absl::FailedPreconditionError("generation 1 of job-1 is superseded by 2");
  }
};

TEST(GlooCommunicator, AStoreErrorKeepsItsCodeThroughTheRendezvous) {
  SupersededStore store;
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      CreateGlooCommunicator(Options(0, 2), &store);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("superseded by 2"));
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("gloo rendezvous of rank 0 of 2"));
}

// A peer whose address never appears: the rendezvous fails with the store's
// DEADLINE_EXCEEDED naming the key it waited for.
TEST(GlooCommunicator, TheStoresTimeoutNamesTheMissingKey) {
  InMemoryKeyValueStore store;
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      CreateGlooCommunicator(Options(0, 2, std::chrono::milliseconds(300)), &store);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("test/1"));
}

}  // namespace
}  // namespace aidn::engine
