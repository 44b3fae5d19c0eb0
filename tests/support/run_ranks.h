#ifndef AIDN_TESTS_SUPPORT_RUN_RANKS_H_
#define AIDN_TESTS_SUPPORT_RUN_RANKS_H_

// Multi-rank tests in one process, as gloo's spawn(transport, size, fn):
// each rank a thread, all meeting through one in-memory KeyValueStore (the
// rendezvous store every communicator takes).
//
//   std::vector<absl::Status> results = RunRanks(4, [&](int rank, KeyValueStore& store) {
//     AIDN_ASSIGN_OR_RETURN(auto comm, CreateGlooCommunicator(OptionsFor(rank), &store));
//     ...
//   });
//   EXPECT_TRUE(AllOk(results));

#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::testing {

// Runs `fn(rank, store)` for every rank in [0, world_size) on a thread of
// its own, all with one fresh InMemoryKeyValueStore, and returns each
// rank's status once every thread has returned.
std::vector<absl::Status> RunRanks(
    int world_size, const std::function<absl::Status(int rank, engine::KeyValueStore& store)>& fn);

// Success when every rank's status is OK; else names each failed rank.
::testing::AssertionResult AllOk(const std::vector<absl::Status>& results);

}  // namespace aidn::testing

#endif  // AIDN_TESTS_SUPPORT_RUN_RANKS_H_
