#ifndef AIDN_WORKER_ENGINE_SHARD_MAP_H_
#define AIDN_WORKER_ENGINE_SHARD_MAP_H_

// Which piece of which parameter each rank owns under the sharded
// strategies (ZeRO-1 in ddp.h, ZeRO-2 and FSDP in fsdp.h), and the
// optimizer state that goes with them.
//
// The parameters are laid out in flat groups (DDP's gradient buckets, or
// FSDP's units): each parameter at a multiple of 16 floats, each group
// padded to a multiple of 16 x world_size floats. Rank r owns the r-th
// 1/world_size slice of every group, so its slices start at 64-byte
// boundaries. A rank's shards are one flat Parameter per parameter its
// slices cover, named "<parameter>[begin:end]" (a flat element range),
// with the whole parameter's shape in whole_shape (weight decay follows
// it). The optimizer steps the shards; checkpoints hold the whole state.
//
// Not thread-safe.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

// How data-parallel ranks share the model's state.
enum class Sharding {
  kNone,         // DDP: every rank holds everything (ddp.h)
  kOptimizer,    // ZeRO-1: the optimizer state (ddp.h)
  kGradients,    // ZeRO-2: the optimizer state and the gradients (fsdp.h)
  kShardGradOp,  // FSDP shard_grad_op: and the weights between steps (fsdp.h)
  kFullShard,    // FSDP full_shard (ZeRO-3): and the weights outside their unit's use (fsdp.h)
};

class ShardMap {
 public:
  struct Group {
    std::vector<Parameter*> parameters;  // in the group's layout order
    std::vector<size_t> offsets;         // floats into the group, per parameter
    size_t floats = 0;                   // a multiple of 16 x world_size
  };
  // `parameters` in the group's order, one after the other at multiples of
  // 16 floats, then `extra_floats`, the whole padded to 16 x world_size.
  static Group Lay(const std::vector<Parameter*>& parameters, int world_size,
                   size_t extra_floats = 0);

  // `groups` as laid out (offsets and padded sizes); `parameters` in
  // registration order (the order of the whole optimizer state).
  ShardMap(std::vector<Group> groups, std::vector<Parameter*> parameters, int rank, int world_size);
  // INVALID_ARGUMENT when some rank's slices hold only padding (a model too
  // small for world_size ranks): that rank would have nothing to optimize.
  // The same answer on every rank, so all of them refuse together.
  static absl::Status CheckEveryRankOwnsSome(const std::vector<Group>& groups, int world_size);
  ShardMap(const ShardMap&) = delete;
  ShardMap& operator=(const ShardMap&) = delete;

  int num_groups() const { return static_cast<int>(groups_.size()); }
  const Group& group(int g) const { return groups_[static_cast<size_t>(g)]; }
  // Floats of group g each rank owns.
  size_t chunk(int g) const { return group(g).floats / static_cast<size_t>(world_); }
  // Floats of the padding over every group, `extra` of them counted as
  // used in the last.
  size_t padding_floats(size_t extra = 0) const;
  const std::vector<Parameter*>& parameters() const { return parameters_; }

  // Makes this rank's shards: for group g, their values are views into
  // value_slice(g) and their gradients into grad_slice(g), each pointing
  // at this rank's chunk(g) floats of the group. Call once.
  void MakeShards(const std::function<float*(int)>& value_slice,
                  const std::function<float*(int)>& grad_slice);
  // In the registration order of the parameters they are pieces of.
  const std::vector<Parameter*>& shards() const { return shard_view_; }
  // Where shard k (of shards()) lies: its group, floats [lo, hi) of the
  // group, and its whole parameter's registration index and offset in the
  // group (another engine's copy of the layout: the GPU reducer's).
  struct ShardPlace {
    int group = 0;
    size_t lo = 0, hi = 0;
    size_t parameter = 0;
    size_t offset = 0;
  };
  ShardPlace place(size_t k) const;
  // Each shard's no_grad from its whole parameter's (a parameter no rank
  // used this step is not stepped, in any of its pieces).
  void CopyNoGradToShards();

  // A piece of a whole tensor that this rank holds: flat elements [begin,
  // end) of `whole`, a parameter ("fc1.weight") or a whole-parameter
  // optimizer entry ("fc1.weight.exp_avg"), whose shape is whole_shape.
  // `name` is the piece's own name where it is a shard ("fc1.weight[0:96]",
  // "fc1.weight[0:96].exp_avg", as Optimizer::State() lists it over the
  // shards), `tensor` its values. Sharded checkpoints are made of these.
  using StateEntry = std::pair<std::string, const Tensor*>;
  struct Piece {
    std::string name;
    std::string whole;
    std::vector<int64_t> whole_shape;
    size_t begin = 0;
    size_t end = 0;
    const Tensor* tensor = nullptr;
  };
  // The shards' weights, in shards() order.
  std::vector<Piece> WeightPieces() const;
  // The shards' optimizer state (Optimizer::State() over shards(): entries
  // "<shard>.<buffer>"), in its order. INVALID_ARGUMENT for an entry of no
  // shard, or one whose size is not its shard's.
  absl::StatusOr<std::vector<Piece>> StatePieces(const std::vector<StateEntry>& shard_state) const;

 private:
  struct Place {
    Parameter* whole;
    int group;
    size_t offset;         // the whole parameter's, in the group
    size_t lo, hi;         // floats of the group
    size_t parameter = 0;  // the whole parameter's registration index
  };
  std::vector<Group> groups_;
  std::vector<Parameter*> parameters_;
  int rank_;
  int world_;
  std::vector<std::unique_ptr<Parameter>> shards_;
  std::vector<Place> places_;  // by shard, as shards_
  std::vector<Parameter*> shard_view_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_SHARD_MAP_H_
