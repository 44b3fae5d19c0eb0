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

namespace {

// The pipeline group, the links to the neighbouring stages and the ends'
// group (several stages only).
absl::Status AddPipeline(const CpuCommunicatorOptions& options, const ProcessGrid& grid,
                         KeyValueStore* store, GridCommunicators* out) {
  GridCommunicators& g = *out;
  const int rank = options.gloo.rank;
  const int stages = grid.shape().pipeline;
  if (stages == 1) return absl::OkStatus();
  const std::vector<int> pipe = grid.Group(rank, GridDim::kPipeline);
  const std::string name = grid.GroupName(rank, GridDim::kPipeline);
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator pipeline,
                        CreateCpuGroupCommunicator(options, pipe, name, store));
  g.pipeline = std::move(pipeline.communicator);
  const int stage = grid.CoordsOf(rank).pipeline;
  auto link = [&](int a) -> absl::StatusOr<PeerLink> {
    AIDN_ASSIGN_OR_RETURN(
        CpuCommunicator pair,
        CreateCpuGroupCommunicator(options,
                                   {pipe[static_cast<size_t>(a)], pipe[static_cast<size_t>(a) + 1]},
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
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GridCommunicators> CreateGridCommunicators(const CpuCommunicatorOptions& options,
                                                          const ProcessGrid& grid,
                                                          KeyValueStore* store) {
  const int rank = options.gloo.rank;
  if (grid.world_size() != options.gloo.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("grid communicators: a grid of world size ", options.gloo.world_size, ", got ",
                     grid.shape().data, " x ", grid.shape().tensor, " x ", grid.shape().pipeline));
  }
  GridCommunicators g;
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator data,
                        CreateCpuGroupCommunicator(options, grid.Group(rank, GridDim::kData),
                                                   grid.GroupName(rank, GridDim::kData), store));
  g.data = std::move(data.communicator);
  g.transport = data.transport;
  if (grid.shape().tensor > 1) {
    AIDN_ASSIGN_OR_RETURN(
        CpuCommunicator tensor,
        CreateCpuGroupCommunicator(options, grid.Group(rank, GridDim::kTensor),
                                   grid.GroupName(rank, GridDim::kTensor), store));
    g.tensor = std::move(tensor.communicator);
  }
  AIDN_RETURN_IF_ERROR(AddPipeline(options, grid, store, &g));
  if (grid.shape().tensor * grid.shape().pipeline > 1) {
    // The ranks of this rank's replica: every one with its data index.
    const int replica = grid.CoordsOf(rank).data;
    std::vector<int> members;
    for (int p = 0; p < grid.shape().pipeline; ++p) {
      for (int t = 0; t < grid.shape().tensor; ++t) members.push_back(grid.RankOf({replica, t, p}));
    }
    AIDN_ASSIGN_OR_RETURN(
        CpuCommunicator group,
        CreateCpuGroupCommunicator(options, members, absl::StrCat("replica/d", replica), store));
    g.replica = std::move(group.communicator);
  }
  return g;
}

}  // namespace aidn::engine
