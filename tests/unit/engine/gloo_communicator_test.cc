// The Gloo communicator with every rank a thread of this process, meeting
// through one in-memory gloo::rendezvous::HashStore on 127.0.0.1. Rank r
// contributes values built from r and the element index, so every expected
// result is an exact float (all sums stay below 2^24).

#include "worker/engine/comm/gloo_communicator.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::engine {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kTimeout{30'000};
constexpr size_t kLarge = size_t{1} << 20;

GlooOptions Options(int rank, int world_size, std::chrono::milliseconds timeout = kTimeout) {
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
                                   std::chrono::milliseconds timeout = kTimeout) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<absl::Status> results(world_size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          CreateGlooCommunicator(Options(rank, world_size, timeout), store);
      if (!comm.ok()) {
        results[rank] = comm.status();
        return;
      }
      results[rank] = body(rank, **comm);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

void ExpectAllOk(const std::vector<absl::Status>& results) {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
  }
}

// Compares element by element and reports the first difference only.
::testing::AssertionResult Matches(const std::vector<float>& got,
                                   const std::function<float(size_t)>& want, int rank) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want(i)) {
      return ::testing::AssertionFailure()
             << "rank " << rank << ": element " << i << " of " << got.size() << " is " << got[i]
             << ", want " << want(i);
    }
  }
  return ::testing::AssertionSuccess();
}

float TriangularSum(int n) { return static_cast<float>(n * (n - 1) / 2); }

class GlooCollectiveTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  size_t elements() const { return std::get<1>(GetParam()); }
  // Per-rank count for AllGather and ReduceScatter, whose buffers are
  // world_size times larger: the large case keeps the total at kLarge.
  size_t per_rank_elements() const { return elements() == kLarge ? kLarge / world() : elements(); }
};

TEST_P(GlooCollectiveTest, AllReduceSumGivesEveryRankTheExactSum) {
  const int n = world();
  const size_t count = elements();
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>(rank + i);
    if (absl::Status s = comm.AllReduce(data.data(), count, ReduceOp::kSum); !s.ok()) return s;
    EXPECT_TRUE(Matches(
        data, [&](size_t i) { return TriangularSum(n) + static_cast<float>(n * i); }, rank));
    EXPECT_EQ(comm.sequence(), 1);
    return absl::OkStatus();
  }));
}

TEST_P(GlooCollectiveTest, AllReduceAvgDividesTheSumByWorldSize) {
  const int n = world();
  const size_t count = elements();
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>(rank + i);
    if (absl::Status s = comm.AllReduce(data.data(), count, ReduceOp::kAvg); !s.ok()) return s;
    EXPECT_TRUE(Matches(
        data,
        [&](size_t i) {
          return (TriangularSum(n) + static_cast<float>(n * i)) / static_cast<float>(n);
        },
        rank));
    return absl::OkStatus();
  }));
}

TEST_P(GlooCollectiveTest, BroadcastFromTheLastRankReachesEveryRank) {
  const int n = world();
  const size_t count = elements();
  const int root = n - 1;
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> data(count, -1.0f);
    if (rank == root) {
      for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>(3 * i + 7);
    }
    if (absl::Status s = comm.Broadcast(data.data(), count, root); !s.ok()) return s;
    EXPECT_TRUE(Matches(
        data, [](size_t i) { return static_cast<float>(3 * i + 7); }, rank));
    return absl::OkStatus();
  }));
}

TEST_P(GlooCollectiveTest, AllGatherPutsEachRanksBlockInRankOrder) {
  const int n = world();
  const size_t count = per_rank_elements();
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> in(count);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(i * n + rank);
    std::vector<float> out(count * n, -1.0f);
    if (absl::Status s = comm.AllGather(in.data(), count, out.data()); !s.ok()) return s;
    EXPECT_TRUE(Matches(
        out,
        [&](size_t j) {
          const size_t block = j / count;
          const size_t i = j % count;
          return static_cast<float>(i * n + block);
        },
        rank));
    return absl::OkStatus();
  }));
}

TEST_P(GlooCollectiveTest, ReduceScatterGivesEachRankItsReducedBlock) {
  const int n = world();
  const size_t count = per_rank_elements();
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<float> in(count * n);
    for (size_t j = 0; j < in.size(); ++j) in[j] = static_cast<float>(rank + j);
    const std::vector<float> original = in;
    std::vector<float> sum(count, -1.0f);
    std::vector<float> avg(count, -1.0f);
    if (absl::Status s = comm.ReduceScatter(in.data(), count, sum.data(), ReduceOp::kSum);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = comm.ReduceScatter(in.data(), count, avg.data(), ReduceOp::kAvg);
        !s.ok()) {
      return s;
    }
    auto exact = [&](size_t i) {
      return TriangularSum(n) + static_cast<float>(n * (rank * count + i));
    };
    EXPECT_TRUE(Matches(sum, exact, rank));
    EXPECT_TRUE(Matches(
        avg, [&](size_t i) { return exact(i) / static_cast<float>(n); }, rank));
    EXPECT_EQ(in, original) << "rank " << rank << ": the input was modified";
    return absl::OkStatus();
  }));
}

TEST_P(GlooCollectiveTest, SequenceCountsEveryCompletedCollective) {
  const int n = world();
  const size_t count = std::min(elements(), size_t{4096});
  ExpectAllOk(RunRanks(n, [&](int rank, Communicator& comm) -> absl::Status {
    EXPECT_EQ(comm.sequence(), 0);
    std::vector<float> data(count * n, 1.0f);
    std::vector<float> out(count * n);
    for (const auto& step : std::vector<std::function<absl::Status()>>{
             [&] { return comm.AllReduce(data.data(), count, ReduceOp::kSum); },
             [&] { return comm.Broadcast(data.data(), count, 0); },
             [&] { return comm.AllGather(data.data(), count, out.data()); },
             [&] { return comm.ReduceScatter(data.data(), count, out.data(), ReduceOp::kSum); },
             [&] { return comm.Barrier(); }}) {
      const int64_t before = comm.sequence();
      if (absl::Status s = step(); !s.ok()) return s;
      EXPECT_EQ(comm.sequence(), before + 1) << "rank " << rank;
    }
    EXPECT_EQ(comm.sequence(), 5);
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndCounts, GlooCollectiveTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{1023},
                                                              kLarge)),
                         [](const ::testing::TestParamInfo<std::tuple<int, size_t>>& info) {
                           return absl::StrCat("world", std::get<0>(info.param), "_count",
                                               std::get<1>(info.param));
                         });

TEST(GlooCommunicator, BarrierReleasesNoRankBeforeAllArrived) {
  constexpr int kWorld = 4;
  std::atomic<int> arrived{0};
  ExpectAllOk(RunRanks(kWorld, [&](int rank, Communicator& comm) -> absl::Status {
    // The last rank arrives late; a barrier that does not wait lets the
    // others see fewer than kWorld arrivals.
    if (rank == kWorld - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    arrived.fetch_add(1);
    if (absl::Status s = comm.Barrier(); !s.ok()) return s;
    EXPECT_EQ(arrived.load(), kWorld) << "rank " << rank << " left the barrier early";
    return absl::OkStatus();
  }));
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
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
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
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<absl::Status> results(kWorld - 1);
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  // Rank 2 never shows up.
  for (int rank = 0; rank < kWorld - 1; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = CreateGlooCommunicator(Options(rank, kWorld, kShort), store).status();
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

TEST(GlooCommunicator, APeerThatStopsCallingFailsTheCollectiveAndBreaksTheCommunicator) {
  constexpr int kWorld = 2;
  constexpr std::chrono::milliseconds kShort{1'000};
  std::atomic<bool> rank0_done{false};
  std::vector<absl::Status> results = RunRanks(
      kWorld,
      [&](int rank, Communicator& comm) -> absl::Status {
        std::vector<float> data(1000, 1.0f);
        if (absl::Status s = comm.AllReduce(data.data(), data.size(), ReduceOp::kSum); !s.ok()) {
          return s;
        }
        if (rank == 1) {
          // Alive but silent until rank 0 gave up, then gone.
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return absl::OkStatus();
        }
        const Clock::time_point start = Clock::now();
        absl::Status failed = comm.AllReduce(data.data(), data.size(), ReduceOp::kSum);
        const auto elapsed = Clock::now() - start;
        rank0_done = true;
        EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
        EXPECT_THAT(std::string(failed.message()), HasSubstr("gloo allreduce of 1000 floats"));
        EXPECT_LT(elapsed, kShort + std::chrono::seconds(10));
        EXPECT_EQ(comm.sequence(), 1);
        absl::Status after = comm.Barrier();
        EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
        return absl::OkStatus();
      },
      kShort);
  ExpectAllOk(results);
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
class SupersededStore final : public gloo::rendezvous::HashStore {
 public:
  void set(const std::string&, const std::vector<char>&) override {
    throw StoreStatusError(
        absl::FailedPreconditionError("generation 1 of job-1 is superseded by 2"));
  }
};

TEST(GlooCommunicator, AStoreStatusErrorKeepsItsCodeThroughTheRendezvous) {
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      CreateGlooCommunicator(Options(0, 2), std::make_shared<SupersededStore>());
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("superseded by 2"));
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("gloo rendezvous of rank 0 of 2"));
}

}  // namespace
}  // namespace aidn::engine
