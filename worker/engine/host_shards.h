#ifndef AIDN_WORKER_ENGINE_HOST_SHARDS_H_
#define AIDN_WORKER_ENGINE_HOST_SHARDS_H_

// The sharded strategies' layout of a model whose collectives run
// elsewhere (a GPU job's: cuda/gpu_ddp.h shards ZeRO-1's buckets and
// cuda/gpu_fsdp.h ZeRO-2's and FSDP's units on the device), kept on the
// host: the groups exactly as the CPU's reducers lay them (ddp.h,
// fsdp.h), and this rank's shards with host memory for their weights and
// for an optimizer's state over them. Sharded checkpoints and their
// resumes go through it, named and cut as a CPU job's: the two devices'
// checkpoints are the same files. Not thread-safe.

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

class HostShards {
 public:
  // ZeRO-1: the groups are DDP's buckets of about bucket_mb (PlanBuckets
  // with no extra floats, ShardedBucketGroups). INVALID_ARGUMENT as those.
  static absl::StatusOr<std::unique_ptr<HostShards>> ForBuckets(
      const std::vector<Parameter*>& parameters, double bucket_mb, int rank, int world_size);
  // ZeRO-2 and FSDP: the groups are the model's units (UnitGroups).
  // INVALID_ARGUMENT as UnitGroups.
  static absl::StatusOr<std::unique_ptr<HostShards>> ForUnits(
      std::vector<std::vector<Parameter*>> units, const std::vector<Parameter*>& parameters,
      int rank, int world_size);

  const ShardMap& map() const { return *map_; }
  // The shards' weights from their whole parameters' values (after those
  // came back from the device, or were loaded).
  void CopyWeightsFromWhole();

 private:
  HostShards() = default;
  static std::unique_ptr<HostShards> Make(std::vector<ShardMap::Group> groups,
                                          const std::vector<Parameter*>& parameters, int rank,
                                          int world_size);
  std::unique_ptr<ShardMap> map_;
  // Per group, this rank's slice of the weights (the shards' values) and
  // of the gradients (unused: the optimizer over the shards only holds
  // state here).
  std::vector<Tensor> values_, grads_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_HOST_SHARDS_H_
