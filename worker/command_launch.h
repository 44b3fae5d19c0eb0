#ifndef AIDN_WORKER_COMMAND_LAUNCH_H_
#define AIDN_WORKER_COMMAND_LAUNCH_H_

// The launch of one rank of a command job (JobSpec.command: a user's own
// program): its argv, working directory and torchrun's environment contract,
// so that a PyTorch script cannot tell aidn from torchrun. Pure, like
// LaunchSpecFor (worker/launch.h) for the built-in trainer; the daemon runs
// the agents' rendezvous first (worker/command_agent.h), which says where
// the generation's store is and where every rank runs.
//
//   CommandPlacement placement = CommandPlacementOf(rendezvous, assignment.rank());
//   AIDN_ASSIGN_OR_RETURN(LaunchSpec launch,
//                         CommandLaunchSpecFor(assignment, placement, options));
//   // launch.env: {"RANK=1", "LOCAL_RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=10.0.0.1", ...}

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/cluster.pb.h"
#include "worker/launch.h"

namespace aidn::worker {

// Where a command rank sits in its generation: the store and the grid of
// nodes, from the agents' rendezvous.
struct CommandPlacement {
  // The c10d store every rank connects to (MASTER_ADDR, MASTER_PORT).
  std::string master_addr;
  int master_port = 0;
  // Among the ranks of the job on this worker (ordered by rank).
  int local_rank = 0;
  int local_world_size = 1;
  // This worker among the job's workers, ordered by their lowest rank.
  int group_rank = 0;
  int group_world_size = 1;
  // The newest committed checkpoint to resume from, if any.
  std::optional<v1::Checkpoint> resume_from;
  // device: gpu: the slots (GPUs) of the job's ranks on this worker, in
  // local-rank order; empty: the assignment's own.
  std::vector<int> local_gpu_slots;
};

// The placement of `rank` from the rendezvous answer: peers[0].address is
// the store ("host:port"). INVALID_ARGUMENT when the answer lacks the rank
// or the store address.
absl::StatusOr<CommandPlacement> CommandPlacementOf(const v1::JoinRendezvousResponse& rendezvous,
                                                    int rank);

// The directory of a job's checkpoints on this worker:
// <checkpoint_root or the absolute spec dir>/<spec dir>/<job id>, as the
// built-in trainer computes it; "" when the spec has no checkpoint.dir.
std::string CommandCheckpointDir(const v1::TrainerAssignment& assignment,
                                 const std::string& checkpoint_root);

// The launch of a command rank. Beyond LaunchSpecFor's checks:
// INVALID_ARGUMENT when the assignment has no command.
absl::StatusOr<LaunchSpec> CommandLaunchSpecFor(const v1::TrainerAssignment& assignment,
                                                const CommandPlacement& placement,
                                                const LaunchOptions& options);

// What a rank wrote to its TORCHELASTIC_ERROR_FILE (torch's @record writes
// {"message": {"message": "ValueError: ...", "extraInfo": {...}}}): the
// message, at most 2 KiB; "" when there is no file or no message in it. The
// file must be a regular file of `owner` (the rank's user), opened without
// following a link or blocking (a FIFO there must not hang the caller).
std::string ReadErrorFile(const std::string& path, uid_t owner);

}  // namespace aidn::worker

#endif  // AIDN_WORKER_COMMAND_LAUNCH_H_
