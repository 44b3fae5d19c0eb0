#ifndef AIDN_COORDINATOR_FAILURE_CAUSE_H_
#define AIDN_COORDINATOR_FAILURE_CAUSE_H_

// The root cause of a generation's failure. A generation fails at the first
// failure the coordinator hears of, but that is not always the first to
// happen: when a worker dies, its ranks die with it, and a rank on a healthy
// worker fails at once on the broken connection and is reported within
// milliseconds, while the dead worker is declared lost only after the
// worker timeout. So a failure that came from a rank's exit stays open to
// revision: an earlier exit of another rank of the generation, or a worker
// of the generation silent since before it, becomes the cause. Not
// thread-safe; the coordinator's mutex guards it (in JobEntry).

#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "absl/time/time.h"

namespace aidn::coordinator {

struct FailureCause {
  int64_t generation = 0;
  // When the failure happened: a rank's exit time by its worker's clock, or
  // when the coordinator saw it.
  absl::Time at = absl::InfinitePast();
  // When the coordinator learned of it (its own clock, which a worker's
  // last heartbeat is compared with).
  absl::Time seen_at = absl::InfinitePast();
  std::string reason;
  // A rank's exit, which an earlier failure elsewhere may have caused.
  bool revisable = false;
  // The generation's workers.
  std::set<std::string> workers;

  // Whether a failure of `generation` at `when` came before this one (and so
  // is the root cause instead).
  bool PrecededBy(int64_t failed_generation, absl::Time when) const {
    return revisable && failed_generation == generation && when < at;
  }
  // Whether a worker last heard from at `last_heard` (coordinator clock) was
  // already silent when the coordinator learned of this failure.
  bool SilentBefore(absl::Time last_heard) const { return revisable && last_heard < seen_at; }
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_FAILURE_CAUSE_H_
