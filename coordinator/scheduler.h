#ifndef AIDN_COORDINATOR_SCHEDULER_H_
#define AIDN_COORDINATOR_SCHEDULER_H_

// Gang placement: all ranks of a job at once or none, on the fewest workers.
// Pure functions over a snapshot of the cluster; thread-safe.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

// One alive worker's slots: used[i] is true when slot i is taken.
struct WorkerSlots {
  std::string worker_id;
  std::vector<bool> cpu_used;
  std::vector<bool> gpu_used;
};

struct GangRequest {
  int world_size = 1;
  bool gpu = false;
  // CPU slots per rank (consecutive on one worker); GPU ranks take one GPU.
  int slots_per_rank = 1;
};

// The placement of ranks 0..world_size-1, ranks contiguous per worker, rank 0
// on the first worker chosen. If one worker can hold the whole job, the
// fullest such worker is chosen (best fit); otherwise the workers with the
// most room first, so the job spans as few workers as possible.
//
// Errors: FAILED_PRECONDITION when the job could not fit even with every
// slot of these workers free (it must not hold up the queue);
// RESOURCE_EXHAUSTED when it fits the cluster but not the free slots now.
// Both messages say what is needed and what there is.
absl::StatusOr<std::vector<v1::RankPlacement>> PlaceGang(const GangRequest& request,
                                                         const std::vector<WorkerSlots>& workers);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SCHEDULER_H_
