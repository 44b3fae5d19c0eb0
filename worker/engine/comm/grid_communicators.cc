#include "worker/engine/comm/grid_communicators.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn::engine {

PipelineSessionOptions GridCommunicators::SessionOptions(PipelineSchedule schedule,
                                                         double bucket_mb) {
  PipelineSessionOptions o;
  o.schedule = schedule;
  o.prev = prev.has_value() ? &*prev : nullptr;
  o.next = next.has_value() ? &*next : nullptr;
  o.pipeline = pipeline.get();
  o.data = data.get();
  o.tied = ends.get();
  o.bucket_mb = bucket_mb;
  return o;
}

absl::StatusOr<GridCommunicators> CreateGridCommunicators(const CpuCommunicatorOptions& options,
                                                          const ProcessGrid& grid,
                                                          KeyValueStore* store) {
  const int rank = options.gloo.rank;
  if (grid.shape().tensor != 1 || grid.world_size() != options.gloo.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grid communicators: a data x pipeline grid of world size ", options.gloo.world_size,
        ", got ", grid.shape().data, " x ", grid.shape().tensor, " x ", grid.shape().pipeline));
  }
  GridCommunicators g;
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator data,
                        CreateCpuGroupCommunicator(options, grid.Group(rank, GridDim::kData),
                                                   grid.GroupName(rank, GridDim::kData), store));
  g.data = std::move(data.communicator);
  g.transport = data.transport;
  const int stages = grid.shape().pipeline;
  if (stages == 1) return g;
  const std::vector<int> pipe = grid.Group(rank, GridDim::kPipeline);
  const std::string name = grid.GroupName(rank, GridDim::kPipeline);
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator pipeline,
                        CreateCpuGroupCommunicator(options, pipe, name, store));
  g.pipeline = std::move(pipeline.communicator);
  const int stage = grid.CoordsOf(rank).pipeline;
  auto link = [&](int a) -> absl::StatusOr<PeerLink> {
    AIDN_ASSIGN_OR_RETURN(
        CpuCommunicator pair,
        CreateCpuGroupCommunicator(options, {pipe[static_cast<size_t>(a)],
                                             pipe[static_cast<size_t>(a) + 1]},
                                   absl::StrCat(name, "/link", a), store));
    return PeerLink::Create(std::move(pair.communicator));
  };
  if (stage > 0) {
    AIDN_ASSIGN_OR_RETURN(PeerLink prev, link(stage - 1));
    g.prev.emplace(std::move(prev));
  }
  if (stage < stages - 1) {
    AIDN_ASSIGN_OR_RETURN(PeerLink next, link(stage));
    g.next.emplace(std::move(next));
  }
  if (stage == 0 || stage == stages - 1) {
    AIDN_ASSIGN_OR_RETURN(CpuCommunicator ends,
                          CreateCpuGroupCommunicator(options, {pipe.front(), pipe.back()},
                                                     absl::StrCat(name, "/ends"), store));
    g.ends = std::move(ends.communicator);
  }
  return g;
}

}  // namespace aidn::engine
