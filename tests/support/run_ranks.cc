#include "tests/support/run_ranks.h"

#include <thread>

namespace aidn::testing {

std::vector<absl::Status> RunRanks(
    int world_size, const std::function<absl::Status(int rank, engine::KeyValueStore& store)>& fn) {
  engine::InMemoryKeyValueStore store;
  std::vector<absl::Status> results(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] { results[static_cast<size_t>(rank)] = fn(rank, store); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

::testing::AssertionResult AllOk(const std::vector<absl::Status>& results) {
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  bool ok = true;
  for (size_t rank = 0; rank < results.size(); ++rank) {
    if (results[rank].ok()) continue;
    if (ok) result = ::testing::AssertionFailure();
    ok = false;
    result << "rank " << rank << ": " << results[rank] << "\n";
  }
  return result;
}

}  // namespace aidn::testing
