// The conformance suite (communicator_conformance.h) over the CPU
// communicators: Gloo on 127.0.0.1 and shared memory with the smallest
// slots (64 KiB = 16,384 floats, so the large count goes in many chunks
// with a ragged last one). Shared memory serves two ranks or more; one rank
// is Gloo's (CreateCpuCommunicator).

#include <chrono>
#include <memory>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "tests/unit/engine/communicator_conformance.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/shm_communicator.h"

namespace aidn::engine {
namespace {

CommBackend Gloo() {
  CommBackend backend;
  backend.name = "gloo";
  backend.create = [](int rank, int world_size, std::chrono::milliseconds timeout,
                      KeyValueStore& store) {
    GlooOptions options;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = timeout;
    options.prefix = "test";
    return CreateGlooCommunicator(options, &store);
  };
  return backend;
}

CommBackend Shm() {
  CommBackend backend;
  backend.name = "shm";
  backend.min_world = 2;
  backend.create = [](int rank, int world_size, std::chrono::milliseconds timeout,
                      KeyValueStore& store) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    ShmOptions options;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = timeout;
    options.slot_bytes = size_t{64} << 10;
    options.spin = 100;
    absl::StatusOr<ShmAttempt> attempt = CreateShmCommunicator(options, &store);
    if (!attempt.ok()) return attempt.status();
    if (attempt->communicator == nullptr) {
      return absl::FailedPreconditionError(attempt->description);
    }
    return std::move(attempt->communicator);
  };
  return backend;
}

INSTANTIATE_TEST_SUITE_P(Gloo, CommunicatorConformanceTest,
                         ::testing::Combine(::testing::Values(Gloo()),
                                            ::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::ValuesIn(ConformanceCounts())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Shm, CommunicatorConformanceTest,
                         ::testing::Combine(::testing::Values(Shm()), ::testing::Values(2, 3, 4, 8),
                                            ::testing::ValuesIn(ConformanceCounts())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Cpu, CommunicatorBackendTest, ::testing::Values(Gloo(), Shm()),
                         BackendName);

}  // namespace
}  // namespace aidn::engine
