#ifndef AIDN_COORDINATOR_HELD_HEARTBEATS_H_
#define AIDN_COORDINATOR_HELD_HEARTBEATS_H_

// Long-poll heartbeats: a worker whose assignments are unchanged is not
// answered at once but held until something concerns it or its max_wait
// runs out. This keeps every held call, per worker, and a deadline queue
// that says when to look.
//
// Not thread-safe: the coordinator's mutex guards it. Callbacks are put on
// the Deferred, to run after the caller unlocks.

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

class HeldHeartbeats {
 public:
  using Callback = std::function<void(absl::StatusOr<v1::HeartbeatResponse>)>;
  // Builds the answer for a worker (called under the coordinator's mutex,
  // once per held call, in the order they are answered).
  using Builder = std::function<v1::HeartbeatResponse(const std::string& worker_id)>;

  // Holds `done` until `deadline` or until the worker is answered.
  void Hold(const std::string& worker_id, Clock::TimePoint deadline, Callback done);

  // Whether any held call's deadline is at or before `now` (cheap: a look
  // at the front of the queue).
  bool AnyDue(Clock::TimePoint now) const;
  // The earliest deadline of a held call, if any (possibly of one answered
  // early: looking then finds nothing due, which is harmless).
  std::optional<Clock::TimePoint> NextDeadline() const;
  // Answers every held call whose deadline is at or before `now`.
  void AnswerDue(Clock::TimePoint now, const Builder& build, Deferred* deferred);
  // Answers every held call of the worker now (its assignments changed).
  void AnswerWorker(const std::string& worker_id, const Builder& build, Deferred* deferred);
  // Answers every held call of the worker with `status`.
  void FailWorker(const std::string& worker_id, const absl::Status& status, Deferred* deferred);
  // Answers every held call with `status`.
  void FailAll(const absl::Status& status, Deferred* deferred);

  // Held calls of the worker.
  size_t held(const std::string& worker_id) const;

 private:
  struct Held {
    Clock::TimePoint deadline;
    Callback done;
  };
  // Per worker, in the order they came.
  std::map<std::string, std::vector<Held>> held_;
  // (deadline, worker id) of every call held, earliest first. An entry may
  // outlive its call (answered early, worker lost): `held_` is the truth,
  // this only says when to look.
  std::multimap<Clock::TimePoint, std::string> deadlines_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_HELD_HEARTBEATS_H_
