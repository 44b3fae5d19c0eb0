#ifndef AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_
#define AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_

// Gloo's rendezvous store over the coordinator's key-value store of one
// (job, generation): ClusterService KvSet / KvGet (with wait), authenticated
// with the job's trainer token. The Gloo communicator of every rank of the
// generation meets here, so no rank has to host a store.
//
// Gloo's Store interface reports failures by throwing. This store throws
// engine::StoreStatusError (a gloo::IoException) carrying the coordinator's
// status, so CreateGlooCommunicator returns it with its code:
//   FAILED_PRECONDITION  the generation is over ("generation 1 of job-1 is
//                        superseded by 2", or the job ended): exit;
//   DEADLINE_EXCEEDED    a key did not appear within the timeout;
//   others               as the coordinator answered (UNAUTHENTICATED,
//                        PERMISSION_DENIED, NOT_FOUND, INVALID_ARGUMENT...).
// UNAVAILABLE (the coordinator restarting, a dropped connection) is retried
// with backoff until the call's timeout. Messages read
// `coordinator KV get "gloo/1" (job-1 generation 1): <coordinator's text>`.
//
// Thread-safe: it holds no mutable state.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "gloo/rendezvous/store.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::trainer {

class CoordinatorStore final : public gloo::rendezvous::Store {
 public:
  // `stub` talks to the coordinator; `token` is the trainer token of the
  // job; `timeout` bounds get(), wait() without a timeout, and set() (with
  // its retries).
  CoordinatorStore(std::shared_ptr<v1::ClusterService::Stub> stub, std::string token,
                   std::string job_id, int64_t generation,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // KvSet. Values are bytes, up to the coordinator's limit (1 MiB).
  void set(const std::string& key, const std::vector<char>& data) override;
  // The value, waiting until the key is set (up to the default timeout).
  std::vector<char> get(const std::string& key) override;
  // Returns once every key is set; DEADLINE_EXCEEDED after `timeout` (the
  // default timeout if it is not positive) for all keys together.
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  using Deadline = std::chrono::steady_clock::time_point;

  // The value of `key` once it is set, blocking until `deadline`. Throws.
  std::string WaitForKey(const std::string& key, Deadline deadline, const char* operation);

  const std::shared_ptr<v1::ClusterService::Stub> stub_;
  const std::string token_;
  const std::string job_id_;
  const int64_t generation_;
  const std::chrono::milliseconds timeout_;
};

// The engine's KeyValueStore (the NCCL id hand-out) over a CoordinatorStore:
// the same keys, timeouts and status codes, as absl::Status instead of
// exceptions.
class CoordinatorKeyValueStore final : public engine::KeyValueStore {
 public:
  explicit CoordinatorKeyValueStore(std::shared_ptr<CoordinatorStore> store)
      : store_(std::move(store)) {}
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override;

 private:
  const std::shared_ptr<CoordinatorStore> store_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_
