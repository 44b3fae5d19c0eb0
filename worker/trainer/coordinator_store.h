#ifndef AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_
#define AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_

// The engine's rendezvous store (engine::KeyValueStore) over the
// coordinator's key-value store of one (job, generation): ClusterService
// KvSet / KvGet (with wait), authenticated with the job's trainer token.
// Every communicator of the generation (Gloo, shared memory, NCCL) meets
// here, so no rank has to host a store.
//
// Failures come back with the coordinator's code:
//   FAILED_PRECONDITION  the generation is over ("generation 1 of job-1 is
//                        superseded by 2", or the job ended): exit;
//   DEADLINE_EXCEEDED    a key did not appear within the timeout;
//   others               as the coordinator answered (UNAUTHENTICATED,
//                        PERMISSION_DENIED, NOT_FOUND, INVALID_ARGUMENT...).
// Transient failures (rpc::Transient: the coordinator restarting, a
// dropped connection) are retried with backoff until the call's timeout.
// Messages read
// `coordinator KV get "gloo/1" (job-1 generation 1): <coordinator's text>`.
//
// Thread-safe: it holds no mutable state.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::trainer {

class CoordinatorStore final : public engine::KeyValueStore {
 public:
  // `stub` talks to the coordinator; `token` is the trainer token of the
  // job; `timeout` bounds Set (with its retries).
  CoordinatorStore(std::shared_ptr<v1::ClusterService::Stub> stub, std::string token,
                   std::string job_id, int64_t generation,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // KvSet. Values are bytes, up to the coordinator's limit (1 MiB).
  absl::Status Set(const std::string& key, const std::string& value) override;
  // KvGet, waiting up to `timeout` for the key to be set.
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override;

 private:
  const std::shared_ptr<v1::ClusterService::Stub> stub_;
  const std::string token_;
  const std::string job_id_;
  const int64_t generation_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_COORDINATOR_STORE_H_
