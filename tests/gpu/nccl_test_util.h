#ifndef AIDN_TESTS_GPU_NCCL_TEST_UTIL_H_
#define AIDN_TESTS_GPU_NCCL_TEST_UTIL_H_

// A real NcclCommunicator of world size 1 through the in-memory KV
// rendezvous, for the device tests of what runs over NCCL (one GPU: one
// rank; two need two GPUs). Null, with a test failure, if it cannot start.

#include <stdlib.h>

#include <chrono>
#include <memory>

#include <gtest/gtest.h>

#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/nccl_communicator.h"

namespace aidn::engine::testing {

inline std::unique_ptr<NcclCommunicator> WorldOfOne(InMemoryKeyValueStore* store) {
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  NcclOptions options;
  options.timeout = std::chrono::seconds(60);
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::Create(options, store);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

}  // namespace aidn::engine::testing

#endif  // AIDN_TESTS_GPU_NCCL_TEST_UTIL_H_
