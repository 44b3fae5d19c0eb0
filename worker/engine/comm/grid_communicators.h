#ifndef AIDN_WORKER_ENGINE_COMM_GRID_COMMUNICATORS_H_
#define AIDN_WORKER_ENGINE_COMM_GRID_COMMUNICATORS_H_

// The CPU communicators one rank of a data x tensor x pipeline grid
// (process_grid.h) trains with: its data group (DDP among the replicas of
// its part of the model), its tensor group (the ranks that split its
// layers), its pipeline group (the stages of its replica), point-to-point
// links to the neighbouring stages, with several stages a group of the first
// and the last stage (a GPT's tied embedding), and with model parallelism
// its replica's group (all the ranks of one copy of the model: they write
// its checkpoints). All meet through the job's one store
// (CreateCpuGroupCommunicator), created in an order that no two ranks can
// wait on each other in: data, tensor, pipeline, the link to the previous
// stage, the link to the next, the ends, the replica.
//
// Every rank of the job calls it at the same point. Errors are the
// communicators' (a timeout names the group).

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/comm/peer_link.h"
#include "worker/engine/comm/process_grid.h"
#include "worker/engine/pipeline_session.h"

namespace aidn::engine {

struct GridCommunicators {
  std::unique_ptr<Communicator> data;
  // Null with one rank a tensor group.
  std::unique_ptr<Communicator> tensor;
  // Null with one stage, as are the links and the ends' group.
  std::unique_ptr<Communicator> pipeline;
  std::optional<PeerLink> prev;
  std::optional<PeerLink> next;
  std::unique_ptr<Communicator> ends;
  // Null without model parallelism (tensor x pipeline of 1).
  std::unique_ptr<Communicator> replica;
  // "shm" or "gloo", as the data group's.
  std::string transport;

  // The pipeline session's communicators (pipeline_session.h); the ends'
  // group is passed as the tied parameter's, which a model without one
  // leaves unused.
  PipelineSessionOptions SessionOptions(PipelineSchedule schedule, double bucket_mb);
};

// INVALID_ARGUMENT for a grid whose world size is not
// options.gloo.world_size.
absl::StatusOr<GridCommunicators> CreateGridCommunicators(const CpuCommunicatorOptions& options,
                                                          const ProcessGrid& grid,
                                                          KeyValueStore* store);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_GRID_COMMUNICATORS_H_
