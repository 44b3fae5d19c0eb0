#include "coordinator/job_state.h"

#include "absl/strings/str_cat.h"

namespace aidn::coordinator {

using v1::Job;

bool IsTerminal(Job::State state) {
  return state == Job::SUCCEEDED || state == Job::FAILED || state == Job::CANCELLED;
}

bool HoldsSlots(Job::State state) { return state == Job::SCHEDULED || state == Job::RUNNING; }

absl::Status CheckTransition(Job::State from, Job::State to) {
  bool ok = false;
  switch (from) {
    case Job::PENDING:
      ok = to == Job::SCHEDULED || to == Job::PAUSED || to == Job::FAILED || to == Job::CANCELLED;
      break;
    case Job::SCHEDULED:
      // SUCCEEDED: every rank exited 0 before the rendezvous completed.
      ok = to == Job::RUNNING || to == Job::RESTARTING || to == Job::PAUSED ||
           to == Job::SUCCEEDED || to == Job::FAILED || to == Job::CANCELLED;
      break;
    case Job::RUNNING:
      ok = to == Job::SUCCEEDED || to == Job::RESTARTING || to == Job::PAUSED ||
           to == Job::FAILED || to == Job::CANCELLED;
      break;
    case Job::RESTARTING:
      ok = to == Job::SCHEDULED || to == Job::PAUSED || to == Job::FAILED || to == Job::CANCELLED;
      break;
    case Job::PAUSED:
      ok = to == Job::PENDING || to == Job::FAILED || to == Job::CANCELLED;
      break;
    default:
      ok = false;
  }
  if (ok) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("job cannot go from ", StateName(from), " to ", StateName(to)));
}

std::string StateName(Job::State state) {
  if (state == Job::STATE_UNSPECIFIED) return "UNSPECIFIED";
  const std::string& name = Job::State_Name(state);
  return name.empty() ? absl::StrCat("STATE_", static_cast<int>(state)) : name;
}

std::string PausedBy(const v1::PauseRequest& pause) {
  return absl::StrCat("paused by ", pause.by().empty() ? "unknown" : pause.by(),
                      pause.reason().empty() ? "" : ": ", pause.reason());
}

}  // namespace aidn::coordinator
