#ifndef AIDN_TESTS_UNIT_ENGINE_COMMUNICATOR_CONFORMANCE_H_
#define AIDN_TESTS_UNIT_ENGINE_COMMUNICATOR_CONFORMANCE_H_

// One conformance suite for every Communicator (communicator_conformance.cc):
// each backend is a CommBackend, instantiated by the test binary that can
// build it (communicator_conformance_test.cc: shared memory and Gloo;
// tests/gpu/nccl_communicator_test.cc: NCCL). Ranks are threads over one
// in-memory KeyValueStore (tests/support/run_ranks.h). Rank r contributes
// values built from r and the element index, so every expected result is
// an exact float (all sums stay below 2^24): the sum of r over the ranks is
// n(n-1)/2.

#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::engine {

struct CommBackend {
  std::string name;
  // Rank `rank` of `world_size`, meeting its peers through `store`.
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
      int rank, int world_size, std::chrono::milliseconds timeout, KeyValueStore& store)>
      create;
  // Why this machine cannot run the backend (the suite skips); empty: it can.
  std::function<std::string()> unavailable = [] { return std::string(); };
  // World sizes the backend serves in one process.
  int min_world = 1;
  int max_world = 8;
  // Where the communicator's buffers live: host memory by default, device
  // memory for NCCL. `allocate(0)` may return null.
  std::function<float*(size_t count)> allocate = [](size_t count) -> float* {
    return count == 0 ? nullptr : new float[count];
  };
  std::function<void(float*)> release = [](float* p) { delete[] p; };
  std::function<void(float* dst, const float* host, size_t count)> upload =
      [](float* dst, const float* host, size_t count) {
        if (count > 0) std::memcpy(dst, host, count * sizeof(float));
      };
  std::function<void(float* host, const float* src, size_t count)> download =
      [](float* host, const float* src, size_t count) {
        if (count > 0) std::memcpy(host, src, count * sizeof(float));
      };
};

inline void PrintTo(const CommBackend& backend, std::ostream* os) { *os << backend.name; }

// Every rank's result is OK (each failure reported with its rank).
void ExpectAllOk(const std::vector<absl::Status>& results);
// Compares element by element and reports the first difference only.
::testing::AssertionResult Matches(const std::vector<float>& got,
                                   const std::function<float(size_t)>& want, int rank);
// n(n-1)/2: what ranks 0..n-1 contributing their own rank sum to.
float TriangularSum(int n);

// Element counts: none, one, odd, and large (several shared-memory slots
// with a ragged last one; Gloo's ring rather than its direct exchange).
constexpr size_t kConformanceLarge = (size_t{1} << 20) + 77;
std::vector<size_t> ConformanceCounts();

// (backend, world size, element count).
using ConformanceParam = std::tuple<CommBackend, int, size_t>;
class CommunicatorConformanceTest : public ::testing::TestWithParam<ConformanceParam> {
 protected:
  // Skips where the backend is unavailable.
  void SetUp() override;
  const CommBackend& backend() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  size_t elements() const { return std::get<2>(GetParam()); }
  // Per-rank count for AllGather and ReduceScatter, whose buffers are
  // world_size times larger: the large case keeps the total about the same.
  size_t per_rank_elements() const {
    return elements() == kConformanceLarge ? kConformanceLarge / world() : elements();
  }
};
std::string ConformanceName(const ::testing::TestParamInfo<ConformanceParam>& info);

// Behaviour that does not depend on sizes, once per backend.
class CommunicatorBackendTest : public ::testing::TestWithParam<CommBackend> {
 protected:
  void SetUp() override;
  const CommBackend& backend() const { return GetParam(); }
};
std::string BackendName(const ::testing::TestParamInfo<CommBackend>& info);

}  // namespace aidn::engine

#endif  // AIDN_TESTS_UNIT_ENGINE_COMMUNICATOR_CONFORMANCE_H_
