#ifndef AIDN_COORDINATOR_CHECKPOINT_REGISTRY_H_
#define AIDN_COORDINATOR_CHECKPOINT_REGISTRY_H_

// The jobs' checkpoints as the coordinator records them in the store: a
// checkpoint commits once every writer rank reported it and the job's
// metrics up to its step are durable (until then it is written, awaiting
// metrics: a resume from it would never report the steps before it); keep_last
// retention retires older ones; a rank that finds one bad marks it invalid;
// a new generation resumes from the newest valid one of an earlier
// generation.
//
// Not thread-safe: the coordinator's mutex guards it and every job's
// JobCheckpoints, and its store writes happen under that mutex, so that
// memory and disk change together.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/job.pb.h"
#include "common/clock.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

// One job's checkpoint state in memory (the checkpoints live in the store).
struct JobCheckpoints {
  // The checkpoint step the current generation resumed from (-1: none);
  // retention never retires it.
  int64_t resumed_from_step = -1;
  // Checkpoints every writer reported whose metrics are not yet durable:
  // step -> generation. Rebuilt from the store on load (written, not
  // committed).
  std::map<int64_t, int64_t> awaiting_metrics;
  // Steps retired by a commit that completed outside a CommitCheckpoint
  // call (its metrics became durable later), for the next response.
  std::vector<int64_t> retired_untold;
};

// Whether the job's combined TRAIN steps of `generation` up to `step` are
// in the store.
using MetricsDurable = std::function<bool(int64_t step, int64_t generation)>;

// What a CommitCheckpoint report did.
struct CommitOutcome {
  // Every writer has reported.
  bool written = false;
  // Written, and its metrics are durable: a resume point.
  bool committed = false;
  // This report completed it.
  bool newly_committed = false;
  // The job's checkpoints as the store holds them now, this one included.
  std::vector<v1::Checkpoint> checkpoints;
};

// Checkpoints that waited for their metrics and are now committed.
struct AwaitedOutcome {
  std::vector<v1::Checkpoint> committed;
  // The job's checkpoints as the store holds them now.
  std::vector<v1::Checkpoint> checkpoints;
};

// What a ReportCheckpointInvalid did.
struct InvalidOutcome {
  // It was already marked invalid: nothing changed.
  bool already = false;
  std::string path;
  // The reason recorded (shortened).
  std::string reason;
  // The step of the newest valid committed checkpoint now, 0 if none.
  int64_t newest_valid_step = 0;
};

class CheckpointRegistry {
 public:
  // `store` and `clock` are not owned.
  CheckpointRegistry(Store* store, Clock* clock) : store_(store), clock_(clock) {}

  // INVALID_ARGUMENT for a request that is malformed whatever the job.
  static absl::Status ValidateCommit(const v1::CommitCheckpointRequest& request);

  // Records rank `request.rank()`'s report of the checkpoint at
  // `request.step()` of `job` (of the request's generation, current), and
  // stores it. A checkpoint an earlier generation left at that step is
  // started over. Once every writer reported it commits if `durable`
  // says its metrics are; otherwise it awaits them (CompleteAwaiting).
  absl::StatusOr<CommitOutcome> Commit(const v1::Job& job, JobCheckpoints* state,
                                       const v1::CommitCheckpointRequest& request,
                                       const MetricsDurable& durable);

  // Commits the checkpoints awaiting metrics that `durable` now says are
  // durable. Reads the store only when one is.
  absl::StatusOr<AwaitedOutcome> CompleteAwaiting(const v1::Job& job, JobCheckpoints* state,
                                                  const MetricsDurable& durable);

  // A coordinator loading the job: its written checkpoints that are not
  // committed await their metrics.
  absl::Status LoadAwaiting(const v1::Job& job, JobCheckpoints* state);

  // keep_last retention over `checkpoints` (all of the job's): deletes the
  // retired ones from the store, drops them from `checkpoints` (and from
  // those awaiting metrics), and returns their steps, ascending.
  std::vector<int64_t> ApplyRetention(const v1::Job& job, JobCheckpoints* state,
                                      std::vector<v1::Checkpoint>* checkpoints);

  // Marks the checkpoint at `request.step()` invalid (idempotent): it is
  // never offered for a resume again; if the generation resumed from it,
  // it goes on from the next valid one below. NOT_FOUND for a step with no
  // checkpoint.
  absl::StatusOr<InvalidOutcome> MarkInvalid(const v1::Job& job, JobCheckpoints* state,
                                             const v1::ReportCheckpointInvalidRequest& request);

  // Fills resume_from and resume_candidates from the checkpoints of
  // generations before the job's current one, and remembers what it
  // resumes from; without any, from the spec's checkpoint.resume_from
  // (another job's).
  void FillResume(const v1::Job& job, JobCheckpoints* state, v1::JoinRendezvousResponse* response);

  // Every writer reported it.
  static bool Written(const v1::Checkpoint& c);
  // Committed and not known to be invalid.
  static bool Valid(const v1::Checkpoint& c) { return c.committed() && c.invalid_reason().empty(); }
  // The step of the newest valid checkpoint, 0 if there is none.
  static int64_t NewestValidStep(const std::vector<v1::Checkpoint>& checkpoints);

 private:
  Store* const store_;
  Clock* const clock_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_CHECKPOINT_REGISTRY_H_
