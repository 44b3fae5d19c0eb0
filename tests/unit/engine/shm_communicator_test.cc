// What only the shared-memory communicator does, with ranks as threads of
// this process meeting through an InMemoryKeyValueStore, and, for a peer
// that dies, as a forked process meeting through a FileKeyValueStore: slot
// reuse across collectives, ranks on other hosts, no segment left behind,
// a silent or exited peer; and the CPU factory's choice. Slots are the
// minimum (64 KiB = 16,384 floats). The collectives every communicator
// shares are in communicator_conformance_test.cc.

#include "worker/engine/comm/shm_communicator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "tests/unit/engine/communicator_conformance.h"
#include "worker/engine/comm/cpu_communicator.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kShmTimeout{30'000};
constexpr size_t kSlotBytes = size_t{64} << 10;

ShmOptions ShmRankOptions(int rank, int world_size,
                          std::chrono::milliseconds timeout = kShmTimeout) {
  ShmOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = timeout;
  options.slot_bytes = kSlotBytes;
  options.spin = 100;
  return options;
}

// Runs `body` on `world_size` threads, each with its own communicator over
// one store; returns each rank's status. `options` may adjust a rank's
// options. A rank whose set-up found shared memory unusable fails with
// FAILED_PRECONDITION and the description.
std::vector<absl::Status> RunShmRanks(
    int world_size, const std::function<absl::Status(int, Communicator&)>& body,
    const std::function<void(ShmOptions&)>& options = [](ShmOptions&) {}) {
  return testing::RunRanks(world_size, [&](int rank, KeyValueStore& store) -> absl::Status {
    ShmOptions o = ShmRankOptions(rank, world_size);
    options(o);
    absl::StatusOr<ShmAttempt> attempt = CreateShmCommunicator(o, &store);
    if (!attempt.ok()) return attempt.status();
    if (attempt->communicator == nullptr) {
      return absl::FailedPreconditionError(attempt->description);
    }
    return body(rank, *attempt->communicator);
  });
}

float Value(int rank, size_t i) { return static_cast<float>(rank * 1000 + (i % 997)); }

// Each rank sums its share of a chunk: the ranks must still agree bit for
// bit when the sums are not exact.
TEST(ShmCommunicator, AllReduceAvgGivesEveryRankTheSameBits) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 3 * 16384 + 77;
  std::vector<std::vector<float>> out(kWorld);
  ExpectAllOk(RunShmRanks(kWorld, [&](int rank, Communicator& comm) {
    std::vector<float> data(kCount);
    // Not exactly divisible by 3.
    for (size_t i = 0; i < kCount; ++i) data[i] = Value(rank, i) + 0.1f;
    AIDN_RETURN_IF_ERROR(comm.AllReduce(data.data(), kCount, ReduceOp::kAvg));
    out[rank] = data;
    return absl::OkStatus();
  }));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(out[r], out[0]) << "rank " << r;
  float sum = 0;
  for (int r = 0; r < kWorld; ++r) sum += Value(r, 0) + 0.1f;
  EXPECT_EQ(out[0][0], sum / static_cast<float>(kWorld));
}

// Back-to-back collectives of different kinds share the slots: an
// allreduce's result slot is still being read when a broadcast starts.
TEST(ShmCommunicator, MixedCollectivesBackToBackStayExact) {
  constexpr int kWorld = 3;
  ExpectAllOk(RunShmRanks(kWorld, [](int rank, Communicator& comm) {
    for (int round = 0; round < 200; ++round) {
      const size_t count = 1 + (round * 7919) % 40000;
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = Value(rank, i + round);
      AIDN_RETURN_IF_ERROR(comm.AllReduce(data.data(), count, ReduceOp::kSum));
      EXPECT_TRUE(Matches(
          data,
          [round](size_t i) {
            return Value(0, i + round) + Value(1, i + round) + Value(2, i + round);
          },
          rank))
          << "round " << round;
      std::vector<float> b(count, static_cast<float>(rank == round % kWorld ? round : -1));
      AIDN_RETURN_IF_ERROR(comm.Broadcast(b.data(), count, round % kWorld));
      EXPECT_EQ(b[count - 1], static_cast<float>(round)) << "round " << round;
      if (round % 50 == 0) AIDN_RETURN_IF_ERROR(comm.Barrier());
    }
    EXPECT_EQ(comm.sequence(), 200 * 2 + 4);
    return absl::OkStatus();
  }));
}

TEST(ShmCommunicator, RanksOnDifferentHostsGetNoCommunicatorAndAgreeWhy) {
  std::vector<absl::Status> results = RunShmRanks(
      3, [](int, Communicator&) { return absl::OkStatus(); },
      [](ShmOptions& o) { o.host_identity = o.rank == 2 ? "other" : "here"; });
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("only 2 of 3 ranks share rank 0's host"));
  }
}

TEST(ShmCommunicator, NoSegmentIsLeftInDevShm) {
  const std::string mine = absl::StrCat("aidn-", getpid(), "-");
  ExpectAllOk(RunShmRanks(2, [&](int, Communicator& comm) {
    AIDN_RETURN_IF_ERROR(comm.Barrier());
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(mine)));
    }
    return absl::OkStatus();
  }));
}

TEST(ShmCommunicator, BadOptionsAreInvalidArguments) {
  InMemoryKeyValueStore store;
  EXPECT_EQ(CreateShmCommunicator(ShmRankOptions(2, 2), &store).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmCommunicator(ShmRankOptions(0, 2), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmCommunicator(ShmRankOptions(0, 2, std::chrono::milliseconds(0)), &store)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A rank that never arrives: the set-up fails with the store's
// DEADLINE_EXCEEDED, said to be the shared-memory set-up's.
TEST(ShmCommunicator, ARankThatNeverArrivesFailsTheSetUpWithinTheTimeout) {
  InMemoryKeyValueStore store;
  absl::StatusOr<ShmAttempt> attempt =
      CreateShmCommunicator(ShmRankOptions(0, 2, std::chrono::milliseconds(300)), &store);
  ASSERT_FALSE(attempt.ok());
  EXPECT_EQ(attempt.status().code(), absl::StatusCode::kDeadlineExceeded) << attempt.status();
  EXPECT_THAT(attempt.status().message(), HasSubstr("shared-memory set-up"));
  EXPECT_THAT(attempt.status().message(), HasSubstr("shm/host/1"));
}

TEST(ShmCommunicator, APeerThatStopsCallingTimesOutAndItsPeerIsToldAtOnce) {
  // Rank 0 (300 ms timeout) calls twice; rank 1 (30 s) calls once, then
  // comes back after rank 0 gave up: it must fail at once, not in 30 s.
  std::vector<absl::Status> results(2);
  Clock::duration rank1_wait{};
  results = RunShmRanks(
      2,
      [&](int rank, Communicator& comm) -> absl::Status {
        float x = 1.0f;
        AIDN_RETURN_IF_ERROR(comm.AllReduce(&x, 1, ReduceOp::kSum));
        if (rank == 0) {
          absl::Status s = comm.AllReduce(&x, 1, ReduceOp::kSum);
          EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
          EXPECT_THAT(s.message(), HasSubstr("rank 1 did not arrive"));
          absl::Status again = comm.Barrier();
          EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
          return absl::OkStatus();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        const Clock::time_point start = Clock::now();
        // Its first phase meets the one rank 0 arrived at before giving
        // up; the second must see the failure.
        absl::Status s = comm.AllReduce(&x, 1, ReduceOp::kSum);
        rank1_wait = Clock::now() - start;
        EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
        EXPECT_THAT(s.message(), HasSubstr("rank 0 failed"));
        return absl::OkStatus();
      },
      [](ShmOptions& o) {
        if (o.rank == 0) o.timeout = std::chrono::milliseconds(300);
      });
  ExpectAllOk(results);
  EXPECT_LT(rank1_wait, std::chrono::seconds(10));
}

TEST(ShmCommunicator, APeerProcessThatExitsIsNoticedWithoutWaitingForTheTimeout) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/shm-exit-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    FileKeyValueStore store(dir);
    absl::StatusOr<ShmAttempt> attempt = CreateShmCommunicator(ShmRankOptions(1, 2), &store);
    // Joins, then leaves without the collective rank 0 waits in.
    _exit(attempt.ok() && attempt->communicator != nullptr ? 0 : 3);
  }
  FileKeyValueStore store(dir);
  absl::StatusOr<ShmAttempt> attempt = CreateShmCommunicator(ShmRankOptions(0, 2), &store);
  ASSERT_TRUE(attempt.ok()) << attempt.status();
  ASSERT_NE(attempt->communicator, nullptr) << attempt->description;
  const Clock::time_point start = Clock::now();
  float x = 1.0f;
  // The child is not reaped yet: a zombie must count as gone.
  absl::Status s = attempt->communicator->AllReduce(&x, 1, ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("rank 1 (pid ", child, ") exited")));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::filesystem::remove_all(dir);
}

// The factory: automatic choice, and shared memory insisted on.
TEST(CpuCommunicator, AutoPicksSharedMemoryOnOneHostAndGlooAcrossHosts) {
  for (bool one_host : {true, false}) {
    InMemoryKeyValueStore store;
    std::vector<std::string> transports(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        CpuCommunicatorOptions options;
        options.gloo.rank = rank;
        options.gloo.world_size = 2;
        options.gloo.timeout = kShmTimeout;
        options.gloo.prefix = "t";
        options.shm_host_identity = one_host ? "" : absl::StrCat("host-", rank);
        absl::StatusOr<CpuCommunicator> comm = CreateCpuCommunicator(options, &store);
        ASSERT_TRUE(comm.ok()) << comm.status();
        float x = static_cast<float>(rank + 1);
        ASSERT_TRUE(comm->communicator->AllReduce(&x, 1, ReduceOp::kSum).ok());
        EXPECT_EQ(x, 3.0f);
        transports[rank] = comm->transport;
      });
    }
    for (std::thread& t : threads) t.join();
    const std::string want = one_host ? "shm" : "gloo";
    EXPECT_EQ(transports[0], want);
    EXPECT_EQ(transports[1], want);
  }
}

TEST(CpuCommunicator, SharedMemoryAskedForAcrossHostsIsUnavailable) {
  InMemoryKeyValueStore store;
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      CpuCommunicatorOptions options;
      options.gloo.rank = rank;
      options.gloo.world_size = 2;
      options.gloo.timeout = kShmTimeout;
      options.transport = CpuTransport::kShm;
      options.shm_host_identity = absl::StrCat("host-", rank);
      results[rank] = CreateCpuCommunicator(options, &store).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(s.message(), HasSubstr("only 1 of 2 ranks share"));
  }
}

}  // namespace
}  // namespace aidn::engine
