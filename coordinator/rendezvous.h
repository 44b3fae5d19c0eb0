#ifndef AIDN_COORDINATOR_RENDEZVOUS_H_
#define AIDN_COORDINATOR_RENDEZVOUS_H_

// The rendezvous of one generation of one job: each rank joins and waits;
// when the last one arrives the coordinator answers them all at once. A rank
// that joins again (a retried call) replaces its earlier wait, or, after
// completion, gets the same answer again.
//
// Not thread-safe: the coordinator's mutex guards it. Callbacks run through
// the Deferred, after the caller unlocks.

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/cluster.pb.h"
#include "common/clock.h"
#include "coordinator/deferred.h"

namespace aidn::coordinator {

class Rendezvous {
 public:
  using Callback = std::function<void(absl::StatusOr<v1::JoinRendezvousResponse>)>;

  Rendezvous(int world_size, Clock::TimePoint deadline)
      : world_size_(world_size), deadline_(deadline) {}

  // Records `peer` (its rank must be in [0, world_size)) and parks `done`
  // until Complete or Fail. After completion, answers at once.
  // INVALID_ARGUMENT (through `done`) for a rank out of range.
  void Join(const v1::Peer& peer, Callback done, Deferred* deferred);

  bool AllJoined() const { return static_cast<int>(peers_.size()) == world_size_; }
  bool completed() const { return completed_.has_value(); }
  Clock::TimePoint deadline() const { return deadline_; }
  // Ranks not joined yet, ascending.
  std::vector<int> MissingRanks() const;
  // Every rank, in rank order (only complete after AllJoined()).
  std::vector<v1::Peer> Peers() const;

  // Answers every waiter with `base` (its rank filled in) and remembers it
  // for later joins. `base.peers` should be Peers().
  void Complete(const v1::JoinRendezvousResponse& base, Deferred* deferred);
  // Answers every waiter with `status`; later joins get it too.
  void Fail(const absl::Status& status, Deferred* deferred);

 private:
  int world_size_;
  Clock::TimePoint deadline_;
  std::map<int, v1::Peer> peers_;
  std::map<int, Callback> waiters_;
  std::optional<v1::JoinRendezvousResponse> completed_;
  absl::Status failed_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_RENDEZVOUS_H_
