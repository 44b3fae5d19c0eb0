#ifndef AIDN_COORDINATOR_KV_STORE_H_
#define AIDN_COORDINATOR_KV_STORE_H_

// The key-value store of one generation of one job: the NCCL unique id and
// the Gloo rendezvous keys live here. It dies with its generation; waiters
// still blocked then are answered with the status given to Close().
//
// Not thread-safe: the coordinator's mutex guards it. Callbacks are never run
// inside a method; they are put on the Deferred to run after unlocking.

#include <cstdint>
#include <functional>
#include <list>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "coordinator/deferred.h"

namespace aidn::coordinator {

struct KvLimits {
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 1 << 20;
  // Keys plus values over the whole store.
  size_t max_total_bytes = 64u << 20;
};

struct CasResult {
  bool swapped = false;
  bool found = false;
  std::string current;
};

class KvStore {
 public:
  using GetCallback = std::function<void(absl::StatusOr<std::string>)>;

  explicit KvStore(const KvLimits& limits) : limits_(limits) {}

  // INVALID_ARGUMENT for a key or value over the limits,
  // RESOURCE_EXHAUSTED when the store is full, and once closed the status
  // given to Close() (FAILED_PRECONDITION if that was OK). A set wakes the
  // key's waiters.
  absl::Status Set(const std::string& key, std::string value, Deferred* deferred);
  // The value, or nullopt-as-NOT_FOUND.
  absl::StatusOr<std::string> Get(const std::string& key) const;
  // Answers `done` with the value once the key is set (at once if it is),
  // or DEADLINE_EXCEEDED at `deadline` (checked by Expire).
  void WaitFor(const std::string& key, Clock::TimePoint deadline, GetCallback done,
               Deferred* deferred);
  // Adds to a decimal counter (a missing key counts from 0).
  // INVALID_ARGUMENT if the key holds something that is not an integer.
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta, Deferred* deferred);
  // Sets `desired` if the key holds `expected` (or, with expect_absent, if
  // it is unset).
  absl::StatusOr<CasResult> CompareAndSet(const std::string& key, bool expect_absent,
                                          const std::string& expected, std::string desired,
                                          Deferred* deferred);

  // Answers waiters whose deadline passed.
  void Expire(Clock::TimePoint now, Deferred* deferred);
  // Ends the store: every waiter gets `status`, later calls fail.
  void Close(const absl::Status& status, Deferred* deferred);

  size_t size() const { return values_.size(); }
  size_t waiters() const { return waiters_.size(); }

 private:
  struct Waiter {
    std::string key;
    Clock::TimePoint deadline;
    GetCallback done;
  };
  absl::Status CheckKey(const std::string& key) const;
  absl::Status Put(const std::string& key, std::string value, Deferred* deferred);

  KvLimits limits_;
  absl::flat_hash_map<std::string, std::string> values_;
  size_t total_bytes_ = 0;
  std::list<Waiter> waiters_;
  absl::Status closed_;  // OK while open
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_KV_STORE_H_
