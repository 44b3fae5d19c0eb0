#ifndef AIDN_WORKER_ENGINE_CPU_SESSION_H_
#define AIDN_WORKER_ENGINE_CPU_SESSION_H_

// One rank's training step on the CPU, the counterpart of GpuSession
// (gpu_session.h): a model (trainable.h: an image classifier or a language
// model), its optimizer and, with a communicator, a DDP
// reducer (ddp.h) that averages the gradients over the ranks in buckets
// whose allreduce overlaps the rest of backward. A Step reads as llm.c's:
//
//   zero grad ; per micro-batch: forward, loss, backward ; allreduce ; update
//
// Gradient accumulation: a Step takes several micro-batches, each one's
// gradients scaled by 1/k and summed, and communicates only after the last
// one's backward. Clipping (OptimizerConfig::grad_clip_norm) is folded into
// the optimizer's update.
//
// The trainer, the engine benchmark (bench/engine_step.cc) and the tests
// that check training against PyTorch all run this one step.
//
// Not thread-safe: one session per training thread. The model and the
// optimizer are borrowed (the trainer also reads them for checkpoints and
// evaluation) and must outlive the session.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/data.h"
#include "worker/engine/ddp.h"
#include "worker/engine/fsdp.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/tensor.h"
#include "worker/engine/trainable.h"

namespace aidn::engine {

// Dropout's seed for micro-batch `micro` of optimizer step `step` (steps
// counted from 0, `accum` micro-batches a step) on `rank` of `world_size`:
// a different stream for every forward of every rank, derived from the
// step alone, so that a resumed run draws what an uninterrupted one would.
// The CPU and GPU paths both seed with it; a checkpoint's state.txt names
// the rule (its "rng" line).
inline uint64_t DropoutSeed(uint64_t seed, int64_t step, int64_t accum, int64_t micro,
                            int world_size, int rank) {
  return seed * 1'000'003 +
         static_cast<uint64_t>(step * accum + micro) * static_cast<uint64_t>(world_size) +
         static_cast<uint64_t>(rank);
}

// The sum over `comm`'s ranks of each rank's sum of squares, the same bits
// on every rank: the norm of a gradient split over ranks (ZeRO's shards, a
// pipeline's stages) for clipping. A collective.
Optimizer::SumOfSquaresReduction SumOfSquaresOver(Communicator* comm);

struct CpuSessionOptions {
  // The ranks to average gradients over (not owned; must outlive the
  // session). Null: one rank and no DDP reducer, the gradients are used as
  // backward leaves them. With a communicator of one rank the reducer only
  // checks that every parameter got its gradient.
  Communicator* communicator = nullptr;
  // DDP gradient bucket size in MB (spec bucket_mb).
  double bucket_mb = 25.0;
  // How the ranks share the model's state (shard_map.h): kNone is DDP;
  // kOptimizer ZeRO-1 (ddp.h); kGradients ZeRO-2 and kShardGradOp,
  // kFullShard FSDP (fsdp.h, over the model's units). Any sharding needs a
  // communicator and the Create that takes an OptimizerConfig (the
  // optimizer is made here, over this rank's shards). The parameters'
  // gradients are not the averaged ones after a Step (the shards' are),
  // and under ZeRO-2 and FSDP the weights are to be read only between
  // GatherFullParameters and ReleaseFullParameters.
  Sharding sharding = Sharding::kNone;
  // DDP (kNone with a communicator): PowerSGD or fp16/bf16 compression of
  // the buckets (ddp.h).
  std::optional<PowerSgdOptions> powersgd;
  std::optional<HalfFormat> half;
  // With a communicator: rank 0's buffers (TrainableModel::Buffers) copied
  // to every rank before each step's first forward, as torch's DDP
  // broadcast_buffers does (its forwards under no_sync, and the one after
  // them, skip it). Once a step, before any collective of the step: ZeRO-2's
  // and FSDP's communication thread is idle then, and only then.
  bool broadcast_buffers = true;
  // DdpOptions::find_unused_parameters (DDP and ZeRO-1), fed with the
  // parameters each forward did not use (TrainableModel::UnusedParameters).
  // ZeRO-2 and FSDP: a skipped unit still runs its hooks and
  // reduce-scatters zeros (the collectives stay in step); with this set,
  // the used flags are summed over the ranks after the step's backward
  // and a parameter no rank used is not stepped, as under DDP. Without
  // it, torch's FSDP semantics: such a parameter is stepped with a zero
  // gradient.
  bool find_unused_parameters = false;
};

class CpuSession {
 public:
  // A session over `model` and `optimizer` (created over the model's
  // parameters). With a communicator, sets the model's grad-ready callback
  // (cleared again by the destructor); no collective runs here. The
  // parameters must already be equal on every rank
  // (DdpReducer::BroadcastParameters). INVALID_ARGUMENT for a null model or
  // optimizer, or (with a communicator) a bad bucket size.
  static absl::StatusOr<std::unique_ptr<CpuSession>> Create(const CpuSessionOptions& options,
                                                            TrainableModel* model,
                                                            Optimizer* optimizer);
  // The same with an optimizer of `config` made here and owned by the
  // session: over the model's parameters, or with sharding over this
  // rank's shards of them (clipping by the norm of the whole gradient).
  static absl::StatusOr<std::unique_ptr<CpuSession>> Create(const CpuSessionOptions& options,
                                                            TrainableModel* model,
                                                            const OptimizerConfig& config);
  // An image classifier: `model`'s logits against the labels (Classifier).
  static absl::StatusOr<std::unique_ptr<CpuSession>> Create(const CpuSessionOptions& options,
                                                            Sequential* model,
                                                            Optimizer* optimizer);
  ~CpuSession();
  CpuSession(const CpuSession&) = delete;
  CpuSession& operator=(const CpuSession&) = delete;

  // One optimizer step over `micro` (at least one micro-batch of the
  // model's kind; each with
  // its dropout seed if it has one, else the model's current one) with
  // learning rate `lr`. Returns the loss, the mean over the micro-batches:
  // averaged over the ranks (rounded to float) with a communicator, this
  // rank's without. A failed allreduce or update is returned with what
  // failed named; the step is then not to be repeated.
  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr);
  // One batch (images [N, C, H, W], labels [N]), with the current seed.
  absl::StatusOr<double> Step(const Tensor& images, const std::vector<int32_t>& labels, double lr) {
    return Step({MicroBatch{&images, &labels, std::nullopt}}, lr);
  }

  // Seconds the bucket allreduces took in the last Step (0 without a
  // communicator or with one rank), overlapped with backward.
  double last_allreduce_seconds() const { return allreduce_seconds_; }
  // The part of it backward did not hide (the step waited for it).
  double last_allreduce_wait_seconds() const { return wait_seconds_; }
  // Bytes the last Step's bucket collectives carried for this rank, and
  // what uncompressed buckets would have (DdpReducer's; 0 without a
  // reducer).
  int64_t last_bytes_sent() const { return reducer_ ? reducer_->last_bytes_sent() : 0; }
  int64_t last_bytes_uncompressed() const {
    return reducer_ ? reducer_->last_bytes_uncompressed() : 0;
  }

  TrainableModel& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  // The DDP/ZeRO-1 gradient reducer (null without a communicator, or
  // under ZeRO-2 and FSDP).
  DdpReducer* reducer() { return reducer_.get(); }
  // Where this rank's shards lie (null without sharding, or with ZeRO-1 on
  // one rank).
  const ShardMap* shard_map() const;

  // The whole parameters' weights, current, in the model's parameters: a
  // collective under ZeRO-2 and FSDP (every rank calls it at the same
  // point; no Step until ReleaseFullParameters), nothing otherwise.
  absl::Status GatherFullParameters();
  void ReleaseFullParameters();

  // This rank's weights and optimizer state as pieces of the whole ones
  // (shard_map.h), for checkpoints: with sharding its shards' (current
  // between steps, which under ZeRO-2 and FSDP the model's parameters are
  // not), without the whole tensors, one piece each.
  using Piece = ShardMap::Piece;
  std::vector<Piece> WeightPieces() const;
  absl::StatusOr<std::vector<Piece>> StatePieces() const;

  // Bytes held for the model's state, by what they hold: the weights, the
  // gradients (DDP's buckets, where they live with more than one rank), the
  // optimizer's state (sharded: this rank's shards' only) and other buffers
  // of the strategy (ZeRO-2 and FSDP: the gathered units' and gradients'
  // buffers at their most; ZeRO-1's collectives run in place).
  // Activations and the data are not counted (the peak memory metric has
  // them).
  struct Memory {
    int64_t parameters = 0;
    int64_t gradients = 0;
    int64_t optimizer_state = 0;
    int64_t buffers = 0;
  };
  Memory memory() const;

 private:
  // CpuSessionOptions::broadcast_buffers, before a step's first forward.
  absl::Status BroadcastBuffers();
  CpuSession(TrainableModel* model, Optimizer* optimizer) : model_(model), optimizer_(optimizer) {}

  // The Sequential overload's adapter (model_ points at it); null otherwise.
  std::unique_ptr<TrainableModel> owned_;
  // The optimizer Create made from a config (optimizer_ points at it); null
  // otherwise.
  std::unique_ptr<Optimizer> owned_optimizer_;
  TrainableModel* model_;
  Optimizer* optimizer_;
  std::unique_ptr<DdpReducer> reducer_;
  std::unique_ptr<FsdpReducer> fsdp_;
  Communicator* communicator_ = nullptr;
  bool broadcast_buffers_ = true;
  bool find_unused_parameters_ = false;
  double allreduce_seconds_ = 0.0;
  double wait_seconds_ = 0.0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_CPU_SESSION_H_
