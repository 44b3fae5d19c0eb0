#include "tests/unit/engine/communicator_conformance.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <gmock/gmock.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tests/support/run_ranks.h"

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kTimeout{60'000};

// A buffer of the backend's memory, filled from and read back to the host.
class Buffer {
 public:
  Buffer(const CommBackend& backend, const std::vector<float>& host)
      : backend_(backend), count_(host.size()), data_(backend.allocate(host.size())) {
    backend_.upload(data_, host.data(), count_);
  }
  ~Buffer() {
    if (data_ != nullptr) backend_.release(data_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() { return data_; }
  std::vector<float> Read() const {
    std::vector<float> host(count_);
    backend_.download(host.data(), data_, count_);
    return host;
  }

 private:
  const CommBackend& backend_;
  const size_t count_;
  float* const data_;
};

// Runs `body` on `world` ranks of `backend`, each with its own
// communicator; each rank's status (its creation error, or what `body`
// returned).
std::vector<absl::Status> OnRanks(const CommBackend& backend, int world,
                                  const std::function<absl::Status(int, Communicator&)>& body,
                                  std::chrono::milliseconds timeout = kTimeout) {
  return testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                          backend.create(rank, world, timeout, store));
    return body(rank, *comm);
  });
}

std::vector<float> Iota(size_t count, size_t start, size_t step) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(start + i * step);
  return v;
}

}  // namespace

void ExpectAllOk(const std::vector<absl::Status>& results) {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
  }
}

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

std::vector<size_t> ConformanceCounts() { return {0, 1, 1023, kConformanceLarge}; }

std::string ConformanceName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return absl::StrCat(std::get<0>(info.param).name, "_world", std::get<1>(info.param), "_count",
                      std::get<2>(info.param));
}

std::string BackendName(const ::testing::TestParamInfo<CommBackend>& info) {
  return info.param.name;
}

void CommunicatorConformanceTest::SetUp() {
  if (const std::string why = backend().unavailable(); !why.empty()) GTEST_SKIP() << why;
}

void CommunicatorBackendTest::SetUp() {
  if (const std::string why = backend().unavailable(); !why.empty()) GTEST_SKIP() << why;
}

// The suites are defined here and instantiated by each backend's binary.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CommunicatorConformanceTest);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CommunicatorBackendTest);

TEST_P(CommunicatorConformanceTest, AllReduceSumGivesEveryRankTheExactSum) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    Buffer data(backend, Iota(count, rank, 1));
    AIDN_RETURN_IF_ERROR(comm.AllReduce(data.data(), count, ReduceOp::kSum));
    EXPECT_TRUE(Matches(
        data.Read(), [&](size_t i) { return TriangularSum(n) + static_cast<float>(n * i); }, rank));
    EXPECT_EQ(comm.sequence(), 1);
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorConformanceTest, AllReduceAvgDividesTheSumByWorldSize) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    Buffer data(backend, Iota(count, rank, 1));
    AIDN_RETURN_IF_ERROR(comm.AllReduce(data.data(), count, ReduceOp::kAvg));
    // Sum, then divide (as PyTorch DDP): the correctly rounded mean.
    EXPECT_TRUE(Matches(
        data.Read(),
        [&](size_t i) {
          return (TriangularSum(n) + static_cast<float>(n * i)) / static_cast<float>(n);
        },
        rank));
    return absl::OkStatus();
  })));
}

// Halves (fp16 and bf16) of small multiples of 0.5: every partial sum is
// exact in both formats, so every rank must get the exact sum.
TEST_P(CommunicatorConformanceTest, AllReduceHalfGivesEveryRankTheExactSum) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = elements();
  for (HalfFormat format : {HalfFormat::kFp16, HalfFormat::kBf16}) {
    EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
      // Two halves per float of the backend's memory.
      std::vector<uint16_t> halves(count + 1);
      for (size_t i = 0; i < count; ++i) {
        halves[i] = FloatToHalf(0.5f * static_cast<float>(rank + static_cast<int>(i % 7)), format);
      }
      std::vector<float> packed((count + 1) / 2);
      if (!packed.empty()) std::memcpy(packed.data(), halves.data(), packed.size() * sizeof(float));
      Buffer data(backend, packed);
      AIDN_RETURN_IF_ERROR(
          comm.AllReduceHalf(reinterpret_cast<uint16_t*>(data.data()), count, format));
      const std::vector<float> got = data.Read();
      if (!got.empty()) std::memcpy(halves.data(), got.data(), got.size() * sizeof(float));
      std::vector<float> values(count);
      for (size_t i = 0; i < count; ++i) values[i] = HalfToFloat(halves[i], format);
      EXPECT_TRUE(Matches(
          values,
          [&](size_t i) {
            return 0.5f * (TriangularSum(n) + static_cast<float>(n * static_cast<int>(i % 7)));
          },
          rank))
          << HalfFormatName(format);
      EXPECT_EQ(comm.sequence(), 1);
      return absl::OkStatus();
    })));
  }
}

TEST_P(CommunicatorConformanceTest, BroadcastFromTheLastRankReachesEveryRank) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = elements();
  const int root = n - 1;
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    Buffer data(backend, rank == root ? Iota(count, 7, 3) : std::vector<float>(count, -1.0f));
    AIDN_RETURN_IF_ERROR(comm.Broadcast(data.data(), count, root));
    EXPECT_TRUE(Matches(
        data.Read(), [](size_t i) { return static_cast<float>(3 * i + 7); }, rank));
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorConformanceTest, AllGatherPutsEachRanksBlockInRankOrder) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = per_rank_elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    Buffer in(backend, Iota(count, rank, n));
    Buffer out(backend, std::vector<float>(count * n, -1.0f));
    AIDN_RETURN_IF_ERROR(comm.AllGather(in.data(), count, out.data()));
    EXPECT_TRUE(Matches(
        out.Read(),
        [&](size_t j) {
          const size_t block = j / count;
          const size_t i = j % count;
          return static_cast<float>(i * n + block);
        },
        rank));
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorConformanceTest, ReduceScatterGivesEachRankItsReducedBlock) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = per_rank_elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    const std::vector<float> original = Iota(count * n, rank, 1);
    Buffer in(backend, original);
    Buffer sum(backend, std::vector<float>(count, -1.0f));
    Buffer avg(backend, std::vector<float>(count, -1.0f));
    AIDN_RETURN_IF_ERROR(comm.ReduceScatter(in.data(), count, sum.data(), ReduceOp::kSum));
    AIDN_RETURN_IF_ERROR(comm.ReduceScatter(in.data(), count, avg.data(), ReduceOp::kAvg));
    auto exact = [&](size_t i) {
      return TriangularSum(n) + static_cast<float>(n * (rank * count + i));
    };
    EXPECT_TRUE(Matches(sum.Read(), exact, rank));
    EXPECT_TRUE(Matches(
        avg.Read(), [&](size_t i) { return exact(i) / static_cast<float>(n); }, rank));
    EXPECT_EQ(in.Read(), original) << "rank " << rank << ": the input was modified";
    return absl::OkStatus();
  })));
}

// In place, as ZeRO uses them: the rank's block of the output is the
// all-gather's input, and the reduce-scatter's output is the rank's block of
// its input.
TEST_P(CommunicatorConformanceTest, AllGatherInPlaceTakesTheRanksBlockFromTheOutput) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = per_rank_elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    std::vector<float> initial(count * n, -1.0f);
    for (size_t i = 0; i < count; ++i) initial[rank * count + i] = static_cast<float>(i * n + rank);
    Buffer out(backend, initial);
    AIDN_RETURN_IF_ERROR(comm.AllGather(out.data() + rank * count, count, out.data()));
    EXPECT_TRUE(Matches(
        out.Read(), [&](size_t j) { return static_cast<float>((j % count) * n + j / count); },
        rank));
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorConformanceTest, ReduceScatterInPlaceReducesTheRanksBlock) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = per_rank_elements();
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    Buffer data(backend, Iota(count * n, rank, 1));
    AIDN_RETURN_IF_ERROR(
        comm.ReduceScatter(data.data(), count, data.data() + rank * count, ReduceOp::kAvg));
    const std::vector<float> got = data.Read();
    const std::vector<float> block(got.begin() + rank * count, got.begin() + (rank + 1) * count);
    EXPECT_TRUE(Matches(
        block,
        [&](size_t i) {
          return (TriangularSum(n) + static_cast<float>(n * (rank * count + i))) /
                 static_cast<float>(n);
        },
        rank));
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorConformanceTest, SequenceCountsEveryCompletedCollective) {
  const CommBackend& backend = this->backend();
  const int n = world();
  const size_t count = std::min(elements(), size_t{4096});
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, n, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.sequence(), 0);
    Buffer data(backend, std::vector<float>(count * n, 1.0f));
    Buffer out(backend, std::vector<float>(count * n, 0.0f));
    const std::vector<std::function<absl::Status()>> steps = {
        [&] { return comm.AllReduce(data.data(), count, ReduceOp::kSum); },
        [&] { return comm.Broadcast(data.data(), count, 0); },
        [&] { return comm.AllGather(data.data(), count, out.data()); },
        [&] { return comm.ReduceScatter(data.data(), count, out.data(), ReduceOp::kSum); },
        [&] { return comm.Barrier(); }};
    for (const auto& step : steps) {
      const int64_t before = comm.sequence();
      AIDN_RETURN_IF_ERROR(step());
      EXPECT_EQ(comm.sequence(), before + 1) << "rank " << rank;
    }
    EXPECT_EQ(comm.sequence(), 5);
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorBackendTest, BarrierReleasesNoRankBeforeAllArrived) {
  const CommBackend& backend = this->backend();
  const int world = std::min(4, backend.max_world);
  if (world < 2) GTEST_SKIP() << backend.name << " runs one rank per process here";
  std::atomic<int> arrived{0};
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, world, [&](int rank, Communicator& comm) {
    // The last rank arrives late; a barrier that does not wait lets the
    // others see fewer than `world` arrivals.
    if (rank == world - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    arrived.fetch_add(1);
    AIDN_RETURN_IF_ERROR(comm.Barrier());
    EXPECT_EQ(arrived.load(), world) << "rank " << rank << " left the barrier early";
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorBackendTest, RefusedCallsAreInvalidArgumentsAndLeaveItUsable) {
  const CommBackend& backend = this->backend();
  const int world = backend.min_world;
  EXPECT_TRUE(testing::AllOk(OnRanks(backend, world, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.world_size(), world);
    Buffer x(backend, {1.0f});
    absl::Status s = comm.Broadcast(x.data(), 1, world);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    s = comm.AllReduce(nullptr, 4, ReduceOp::kSum);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(comm.sequence(), 0);
    // Refused calls leave the communicator usable.
    AIDN_RETURN_IF_ERROR(comm.AllReduce(x.data(), 1, ReduceOp::kSum));
    EXPECT_EQ(x.Read(), std::vector<float>{static_cast<float>(world)});
    return absl::OkStatus();
  })));
}

TEST_P(CommunicatorBackendTest, AFailedCollectiveBreaksTheCommunicator) {
  const CommBackend& backend = this->backend();
  if (backend.max_world < 2) GTEST_SKIP() << backend.name << " runs one rank per process here";
  constexpr std::chrono::milliseconds kShort{1'000};
  std::mutex mu;
  std::condition_variable cv;
  bool rank0_done = false;
  EXPECT_TRUE(testing::AllOk(OnRanks(
      backend, 2,
      [&](int rank, Communicator& comm) -> absl::Status {
        Buffer data(backend, std::vector<float>(1000, 1.0f));
        AIDN_RETURN_IF_ERROR(comm.AllReduce(data.data(), 1000, ReduceOp::kSum));
        if (rank == 1) {
          // Alive but silent until rank 0 gave up, then gone.
          std::unique_lock<std::mutex> lock(mu);
          cv.wait_for(lock, std::chrono::seconds(60), [&] { return rank0_done; });
          return absl::OkStatus();
        }
        const Clock::time_point start = Clock::now();
        const absl::Status failed = comm.AllReduce(data.data(), 1000, ReduceOp::kSum);
        const auto elapsed = Clock::now() - start;
        {
          std::lock_guard<std::mutex> lock(mu);
          rank0_done = true;
        }
        cv.notify_all();
        EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
        EXPECT_LT(elapsed, kShort + std::chrono::seconds(10));
        EXPECT_EQ(comm.sequence(), 1);
        const absl::Status after = comm.Barrier();
        EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
        EXPECT_EQ(comm.sequence(), 1);
        return absl::OkStatus();
      },
      kShort)));
}

}  // namespace aidn::engine
