#ifndef AIDN_WORKER_ENGINE_FSDP_H_
#define AIDN_WORKER_ENGINE_FSDP_H_

// ZeRO-2 and fully sharded data parallelism (ZeRO-3, torch's FSDP) over a
// model's units (units.h). Each unit is one flat buffer laid out as
// shard_map.h says (its parameters at multiples of 16 floats, padded to
// 16 x world_size); rank r owns the r-th slice of every unit.
//
// What a rank holds between steps:
//   kGradients (ZeRO-2): every unit's weights; its slice of the averaged
//     gradients and of the optimizer state.
//   kShardGradOp, kFullShard (FSDP): its slice of the weights, of the
//     gradients and of the optimizer state.
//
// During a step, through the hooks the model calls:
//   - Weights. Before a unit's forward its weights are all-gathered into a
//     buffer, and the next unit's gather is queued, so it runs while this
//     one computes. full_shard frees a unit's weights after its forward
//     and gathers them again (prefetched likewise) for its backward;
//     shard_grad_op keeps them until the unit's backward is done. The root
//     (unit 0, used at both ends of forward and first in backward) stays
//     gathered from its forward to its backward. ZeRO-2 keeps every
//     unit's weights; after an update each unit's slices are all-gathered
//     in place before the unit's next forward, again one unit ahead, so
//     the all-gather overlaps the forward instead of ending the step.
//   - Gradients. BeforeBackward gives the unit a zeroed buffer of its
//     layout and points its gradients there; AfterBackward hands the
//     buffer to the communication thread, which reduce-scatters it
//     (averaged) and adds the rank's slice to its gradient shard; the
//     buffer is then reused. Besides the root's, at most
//     max_pending_gradients units' buffers are alive: backward waits for a
//     reduce-scatter to finish rather than hold more.
//   - Gradient accumulation: every micro-batch's backward reduce-scatters,
//     and the shards sum the averages. Gradient memory stays at the
//     shard's 1/N through accumulation, for k times the reduce-scatter
//     traffic with k micro-batches. Keeping whole gradients until the last
//     micro-batch would hold 4 bytes a parameter on every rank, which is
//     what ZeRO-2 exists to avoid (DeepSpeed's ZeRO-2 and torch's FSDP
//     without no_sync make the same choice).
//
// One communication thread runs the collectives in the order the training
// thread queues them, which is the same on every rank.
//
// Reading the weights outside a step (evaluation, checkpoints, the end of
// training) needs GatherFullParameters first: FSDP holds slices only, and
// ZeRO-2's weights are current only once gathered after an update.
//
// Not thread-safe apart from the hand-off to the communication thread;
// the communicator must not be used by anyone else during a step. The
// parameters must outlive the reducer, which gives them storage of their
// own again when destroyed: the weights of the units gathered then (after
// GatherFullParameters, all of them, whole and current), zeros for the
// others, zeroed gradients.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"
#include "worker/engine/units.h"

namespace aidn::engine {

// ZeRO-2's and FSDP's groups (shard_map.h): one per unit, laid out in the
// unit's order and padded to 16 x world_size floats. `units` as a model's
// Units() (the root first; none: an empty root); `parameters` in
// registration order. INVALID_ARGUMENT for a parameter in no unit or in
// two, a unit's parameter the model does not list, or some rank owning
// only padding (CheckEveryRankOwnsSome).
absl::StatusOr<std::vector<ShardMap::Group>> UnitGroups(std::vector<std::vector<Parameter*>> units,
                                                        const std::vector<Parameter*>& parameters,
                                                        int world_size);

struct FsdpOptions {
  // kGradients, kShardGradOp or kFullShard.
  Sharding sharding = Sharding::kFullShard;
  // Gradient buffers of units other than the root alive at once (>= 1).
  int max_pending_gradients = 2;
};

class FsdpReducer final : public UnitHooks {
 public:
  // `units` as the model's Units() (the root first); `parameters` in
  // registration order; every parameter in exactly one unit. The values
  // move into the units' storage (the current values: equal on every
  // rank). The communicator is not owned. INVALID_ARGUMENT for another
  // sharding, a parameter in no unit or in two, or max_pending_gradients
  // below 1.
  static absl::StatusOr<std::unique_ptr<FsdpReducer>> Create(
      const FsdpOptions& options, std::vector<std::vector<Parameter*>> units,
      const std::vector<Parameter*>& parameters, Communicator* communicator);
  ~FsdpReducer() override;
  FsdpReducer(const FsdpReducer&) = delete;
  FsdpReducer& operator=(const FsdpReducer&) = delete;

  // This rank's shards, for the optimizer (shard_map.h): values in the
  // rank's slice of the weights, gradients in its slice of the averaged
  // gradients (valid after Finish).
  const std::vector<Parameter*>& ShardParameters() const { return map_->shards(); }
  const ShardMap& map() const { return *map_; }

  // Before a step's first forward: zeroes the gradient shards.
  void BeginStep();
  // After the step's last backward: waits for every queued collective.
  // Seconds the training thread waited during the step (for gathers,
  // gradient buffers and this drain) go into *wait_seconds, and the
  // collectives' own time into *comm_seconds (either may be null). The
  // first failed collective's error, naming it.
  absl::Status Finish(double* wait_seconds, double* comm_seconds);
  // After the optimizer stepped the shards: the weights the next forward
  // gathers are the updated ones.
  void AfterUpdate();
  // The shards' no_grad from their parameters' (ShardMap::CopyNoGradToShards).
  void CopyNoGradToShards() { map_->CopyNoGradToShards(); }

  // Every unit's whole, current weights in the parameters (a collective:
  // every rank calls it at the same point), until ReleaseFullParameters;
  // the hooks do nothing meanwhile (evaluation, checkpoints). Not during a
  // step.
  absl::Status GatherFullParameters();
  void ReleaseFullParameters();

  // Bytes held: the weights (ZeRO-2: whole units; FSDP: the slices), the
  // gradient shards, and the most the gathered units' and gradients'
  // buffers held at once so far (kept for reuse).
  struct Memory {
    int64_t weights = 0;
    int64_t gradients = 0;
    int64_t buffers = 0;
  };
  Memory memory() const;

  void BeforeForward(int unit) override;
  void AfterForward(int unit) override;
  void BeforeBackward(int unit) override;
  void AfterBackward(int unit) override;

 private:
  // Buffers of whole units, kept for reuse (a few) once given back.
  class Pool {
   public:
    Tensor Take(size_t floats);
    void Give(Tensor buffer);
    int64_t peak_bytes() const { return peak_; }

   private:
    std::vector<Tensor> free_;
    int64_t bytes_ = 0;
    int64_t peak_ = 0;
  };
  enum class Weights { kStale, kGathering, kGathered };
  struct Unit {
    // ZeRO-2: the whole unit (kept); FSDP: a buffer from weight_pool_
    // while gathered, else empty.
    Tensor weights;
    Tensor shard;       // FSDP: this rank's slice of the weights
    Tensor shard_grad;  // this rank's slice of the averaged gradients
    Tensor grad;        // in backward: the unit's gradients
    Weights state = Weights::kStale;
    bool gathered = false;  // the queued gather is done (under mu_)
  };
  struct Op {
    bool gather;  // else reduce-scatter
    int unit;
    float* out;     // the unit's whole weights, or its gradients
    Tensor buffer;  // reduce-scatter: the gradients' buffer (back to the pool after)
  };

  FsdpReducer(const FsdpOptions& options, Communicator* communicator)
      : options_(options), communicator_(communicator) {}
  bool sharded_weights() const { return options_.sharding != Sharding::kGradients; }
  size_t floats(int unit) const { return map_->group(unit).floats; }
  // Points the unit's parameter values (or gradients) into `base` laid out
  // as the unit; null: nowhere.
  void PointValues(int unit, float* base);
  void PointGrads(int unit, float* base);
  // Queues the unit's gather unless its weights are gathered or on the way.
  void Gather(int unit);
  void WaitGathered(int unit);
  void FreeWeights(int unit);
  void Enqueue(Op op);
  void CommLoop();
  absl::Status RunOp(Op& op);

  FsdpOptions options_;
  Communicator* communicator_;
  std::unique_ptr<ShardMap> map_;
  std::vector<Unit> units_;
  Pool weight_pool_;  // the training thread's
  bool summoned_ = false;
  double wait_seconds_ = 0.0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  int in_flight_ = 0;          // queued or running
  int pending_grads_ = 0;      // gradient buffers of non-root units alive
  bool root_pending_ = false;  // the root's gradient buffer is alive
  Pool grad_pool_;             // under mu_
  absl::Status error_;         // the first failed collective's
  double comm_seconds_ = 0.0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_FSDP_H_
