#ifndef AIDN_WORKER_ENGINE_COMM_KV_STORE_H_
#define AIDN_WORKER_ENGINE_COMM_KV_STORE_H_

// The small key-value store a communicator meets its peers through, without
// Gloo or gRPC in the engine: in a trainer it is the coordinator's job KV of
// one (job, generation) (trainer/coordinator_store.h adapts it), in tests
// and single-process runs an InMemoryKeyValueStore shared by threads.
//
// Thread-safe: implementations may be called from any thread.

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aidn::engine {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets `key` (values are bytes).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting until it is set; DEADLINE_EXCEEDED naming
  // the key after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
};

class InMemoryKeyValueStore final : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_KV_STORE_H_
