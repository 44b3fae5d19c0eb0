#ifndef AIDN_COORDINATOR_SCHEDULER_H_
#define AIDN_COORDINATOR_SCHEDULER_H_

// Gang placement: all ranks of a job at once or none, on the fewest workers.
// PlaceGang is a pure function over a snapshot of the cluster (thread-safe);
// SlotTable builds that snapshot from the workers and the placements of the
// jobs holding slots (a value, not thread-safe).

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "common/job_paths.h"

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

// What a job of `spec` asks for.
GangRequest GangRequestOf(const v1::JobSpec& spec);

// The first absolute path of `spec` outside the roots `worker` reports
// (WorkerInfo.path_roots, compared lexically); nothing when all lie inside
// or the worker reports no roots.
std::optional<PathOutside> PathRefusedBy(const v1::JobSpec& spec, const v1::WorkerInfo& worker);

// Free-slot accounting: every slot of the workers added, and which of them
// the placements marked take.
class SlotTable {
 public:
  // A worker with `cpu_slots` CPU slots and `gpus` GPUs, all free.
  void AddWorker(const std::string& worker_id, int cpu_slots, int gpus);
  // The slots the job's placement takes (a GPU rank one GPU, a CPU rank
  // threads_per_rank consecutive slots) are used. Workers not added, and
  // slots beyond a worker's, are ignored.
  void MarkUsed(const v1::Job& job);
  // The workers for which `eligible` holds, in worker id order.
  std::vector<WorkerSlots> Snapshot(
      const std::function<bool(const std::string& worker_id)>& eligible) const;
  bool empty() const { return workers_.empty(); }

 private:
  std::map<std::string, WorkerSlots> workers_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SCHEDULER_H_
