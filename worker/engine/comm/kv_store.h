#ifndef AIDN_WORKER_ENGINE_COMM_KV_STORE_H_
#define AIDN_WORKER_ENGINE_COMM_KV_STORE_H_

// The one rendezvous store every communicator meets its peers through
// (Gloo, shared memory and NCCL alike), without Gloo or gRPC in its
// interface. In a trainer it is the coordinator's job KV of one (job,
// generation) (trainer/coordinator_store.h); ranks that are threads of one
// process share an InMemoryKeyValueStore; ranks that are processes of one
// host without a coordinator (benchmarks, fork tests) a FileKeyValueStore.
//
// Communicators use the store only while they are created: it need not
// outlive them.
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
  // Sets `key` (values are bytes; setting a key again replaces its value).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting until it is set; DEADLINE_EXCEEDED naming
  // the key after `timeout` (0: look once, do not wait). Other errors are
  // the store's (a fenced generation: FAILED_PRECONDITION).
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
};

// Ranks as threads of one process.
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

// Ranks as processes of one host: one file per key in `directory` (which
// must exist), written to a temporary name and renamed, so a reader sees a
// whole value or none. Get polls every millisecond or so until the
// deadline. Keys may hold any bytes (they are escaped into file names).
class FileKeyValueStore final : public KeyValueStore {
 public:
  explicit FileKeyValueStore(std::string directory) : directory_(std::move(directory)) {}
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override;

 private:
  std::string PathOf(const std::string& key) const;

  const std::string directory_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_KV_STORE_H_
