#ifndef AIDN_COORDINATOR_CHECKPOINT_AGREEMENT_H_
#define AIDN_COORDINATOR_CHECKPOINT_AGREEMENT_H_

// A checkpoint at a step every rank agrees on, asked for outside the spec's
// schedule (a pause). The ranks have no collective of their own to agree
// through (a command job's program has none the service can use), and each
// learns of the request on its own progress beat, a second apart, while it
// trains a step every few milliseconds. So the agreement runs through the
// beats:
//
//   1. The coordinator proposes a step a little ahead of the furthest rank:
//      about `lead` of training at the job's step time (by default two
//      progress beats, so that every rank hears of it before it gets
//      there).
//   2. A rank that learns of it at or before that step acks it and promises
//      not to train past it before `go`; one already past it says it missed
//      it. A miss brings a new proposal past every rank, with twice the
//      lead (so a step time that was underestimated cannot miss forever);
//      acks of the old step are forgotten, and a rank waiting at it goes on
//      to the new one.
//   3. Once every rank acked the proposal, `go`: each checkpoints at it.
//
// No rank can miss a step another rank acked while that rank waits there:
// in a data-parallel job a rank cannot train two steps past a rank that
// stands still. So an agreed checkpoint never needs a collective the ranks
// did not all enter.
//
// Pure and not thread-safe: the coordinator's mutex guards each job's
// agreement.

#include <chrono>
#include <cstdint>
#include <set>

#include "aidn/v1/cluster.pb.h"

namespace aidn::coordinator {

struct CheckpointAgreement {
  // The step proposed; 0: none.
  int64_t step = 0;
  bool go = false;
  // Ranks that acked `step`.
  std::set<int> acked;
  // Proposals made so far (each miss doubles the lead).
  int proposals = 0;
};

struct AgreementInputs {
  int world_size = 1;
  // The furthest step any rank reported.
  int64_t max_step = 0;
  // Steps in the job, 0 if unknown: no proposal goes past the last step.
  int64_t total_steps = 0;
  // The job's typical step time, 0 if unknown.
  double step_seconds = 0;
  // How far ahead of the furthest rank a proposal lies, in training time.
  std::chrono::milliseconds lead = std::chrono::milliseconds(2000);
};

class CheckpointAgreements {
 public:
  // The lead in steps when the step time is unknown.
  static constexpr int64_t kUnknownLeadSteps = 16;

  // Proposes a step (the first, or after a miss). Returns it.
  static int64_t Propose(CheckpointAgreement* agreement, const AgreementInputs& in);

  // A progress beat of `rank` with its answer to the current proposal (if
  // any). Proposes a new step after a miss of the current one. Returns
  // true when the agreement changed (a new step, or go).
  static bool Beat(CheckpointAgreement* agreement, int rank, int64_t ack, int64_t missed,
                   const AgreementInputs& in);
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_CHECKPOINT_AGREEMENT_H_
