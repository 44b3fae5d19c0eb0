#include "worker/engine/host_shards.h"

#include <cstring>
#include <utility>

#include "common/status.h"
#include "worker/engine/ddp.h"
#include "worker/engine/fsdp.h"

namespace aidn::engine {

absl::StatusOr<std::unique_ptr<HostShards>> HostShards::ForBuckets(
    const std::vector<Parameter*>& parameters, double bucket_mb, int rank, int world_size) {
  std::vector<int64_t> numels;
  for (const Parameter* p : parameters) numels.push_back(p->value.numel());
  AIDN_ASSIGN_OR_RETURN(BucketPlan plan, PlanBuckets(numels, bucket_mb, 0));
  AIDN_ASSIGN_OR_RETURN(std::vector<ShardMap::Group> groups,
                        ShardedBucketGroups(parameters, &plan, world_size));
  return Make(std::move(groups), parameters, rank, world_size);
}

absl::StatusOr<std::unique_ptr<HostShards>> HostShards::ForUnits(
    std::vector<std::vector<Parameter*>> units, const std::vector<Parameter*>& parameters, int rank,
    int world_size) {
  AIDN_ASSIGN_OR_RETURN(std::vector<ShardMap::Group> groups,
                        UnitGroups(std::move(units), parameters, world_size));
  return Make(std::move(groups), parameters, rank, world_size);
}

std::unique_ptr<HostShards> HostShards::Make(std::vector<ShardMap::Group> groups,
                                             const std::vector<Parameter*>& parameters, int rank,
                                             int world_size) {
  std::unique_ptr<HostShards> shards(new HostShards());
  for (const ShardMap::Group& g : groups) {
    const int64_t chunk = static_cast<int64_t>(g.floats / static_cast<size_t>(world_size));
    shards->values_.emplace_back(std::vector<int64_t>{chunk});
    shards->grads_.emplace_back(std::vector<int64_t>{chunk});
  }
  shards->map_ = std::make_unique<ShardMap>(std::move(groups), parameters, rank, world_size);
  shards->map_->MakeShards([&](int g) { return shards->values_[static_cast<size_t>(g)].data(); },
                           [&](int g) { return shards->grads_[static_cast<size_t>(g)].data(); });
  shards->CopyWeightsFromWhole();
  return shards;
}

void HostShards::CopyWeightsFromWhole() {
  const std::vector<Parameter*>& shards = map_->shards();
  for (size_t k = 0; k < shards.size(); ++k) {
    const ShardMap::ShardPlace at = map_->place(k);
    const Parameter* whole = map_->parameters()[at.parameter];
    std::memcpy(shards[k]->value.data(), whole->value.data() + (at.lo - at.offset),
                sizeof(float) * (at.hi - at.lo));
  }
}

}  // namespace aidn::engine
