#ifndef AIDN_COORDINATOR_JOB_STATE_H_
#define AIDN_COORDINATOR_JOB_STATE_H_

// The job lifecycle as a table of allowed transitions:
//   PENDING → SCHEDULED → RUNNING → {SUCCEEDED, FAILED, CANCELLED}
//   SCHEDULED | RUNNING → RESTARTING → SCHEDULED
//   SCHEDULED → SUCCEEDED (every rank exited 0 before the rendezvous ended)
//   PENDING | SCHEDULED | RUNNING | RESTARTING → PAUSED → PENDING
//   any non-terminal state → FAILED | CANCELLED
// Pure functions; thread-safe.

#include <string>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

bool IsTerminal(v1::Job::State state);
// SCHEDULED or RUNNING: the job holds slots and has trainers.
bool HoldsSlots(v1::Job::State state);
// OK, or FAILED_PRECONDITION naming both states.
absl::Status CheckTransition(v1::Job::State from, v1::Job::State to);
// "RUNNING", "PENDING", ...
std::string StateName(v1::Job::State state);
// "paused by alice: maintenance" (the PAUSED job's message).
std::string PausedBy(const v1::PauseRequest& pause);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_JOB_STATE_H_
