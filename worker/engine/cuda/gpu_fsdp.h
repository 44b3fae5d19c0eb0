#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_FSDP_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_FSDP_H_

// ZeRO-2 and fully sharded data parallelism (FSDP, ZeRO-3) on GPUs with
// NCCL: fsdp.h's semantics, with the CPU reducer's layout (a HostShards'
// map over the model's units: one flat group per unit, its parameters at
// multiples of 16 floats, padded to 16 x world_size; rank r owns the r-th
// slice of each), on the NCCL stream instead of a communication thread.
//
// What a rank holds between steps, on the device:
//   kGradients (ZeRO-2): every unit's weights, in one buffer per unit; its
//     slice of the averaged gradients and of the optimizer state.
//   kShardGradOp, kFullShard (FSDP): its slice of the weights, of the
//     averaged gradients and of the optimizer state.
//
// During a step, through the model's unit hooks (gpu_units.h), each call
// ordering NCCL against the compute stream with events, never with a host
// wait:
//   - Weights. Before a unit's forward its weights are all-gathered into a
//     buffer from a pool, and the next unit's gather is queued with it, so
//     NCCL fetches one unit ahead while the compute stream runs this one
//     (a gather waits for the compute stream's work queued before it: the
//     last update, and whatever read the pool buffer before). full_shard
//     gives a unit's buffer back after its forward and gathers it again,
//     prefetched likewise, for its backward; shard_grad_op keeps it until
//     the unit's backward is done. The root (unit 0) stays gathered from
//     its forward to the end of backward. ZeRO-2 keeps every unit's
//     weights; after an update each unit's slices are all-gathered in
//     place before its next forward, one unit ahead again.
//   - Gradients. BeforeBackward gives the unit a zeroed buffer of its
//     layout (the compute stream waits until that buffer's last
//     reduce-scatter is done) and points its gradients there;
//     AfterBackward reduce-scatters it (ncclAvg, in place) on the NCCL
//     stream and adds the rank's slice to its gradient shard. The
//     buffers rotate: max_pending_gradients of them besides the root's, so
//     a unit's reduce-scatter overlaps the next unit's backward.
//   - Gradient accumulation: every micro-batch's backward reduce-scatters,
//     and the shards sum the averages (fsdp.h says why).
//   - AfterBackward (the trainer's, before the optimizer): the compute
//     stream waits for the last reduce-scatter; find_unused_parameters:
//     the used flags are summed over the ranks (a host wait) and what no
//     rank used is marked no_grad, its shards too.
//   - Wait (the step's end): the weights the next forward gathers are the
//     updated ones; the host waits for the step, polling NCCL.
//
// Reading the weights outside a step (evaluation, checkpoints) needs
// GatherFullParameters first: every rank calls it at the same point.
//
// Not thread-safe: the trainer's thread. The parameters, the context and
// the communicator must outlive the reducer. When it goes, the parameters
// get storage of their own again: the weights where they were whole and
// current (after GatherFullParameters, all of them), zeros elsewhere, and
// zeroed gradients.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_units.h"
#include "worker/engine/cuda/nccl_steps.h"
#include "worker/engine/half.h"
#include "worker/engine/shard_map.h"

namespace aidn::engine::cuda {

struct GpuFsdpOptions {
  // kGradients (ZeRO-2), kShardGradOp or kFullShard (FSDP).
  Sharding sharding = Sharding::kFullShard;
  // Gradient buffers of units other than the root in rotation (>= 1).
  int max_pending_gradients = 2;
  // A forward may skip units (stochastic depth): their zero gradients are
  // reduce-scattered, and what no rank used is not stepped.
  bool find_unused_parameters = false;
  // Mixed precision (torch FSDP's MixedPrecision; spec fsdp.param_dtype and
  // reduce_dtype). param_half: a unit's weights are gathered in 16 bits,
  // each rank's fp32 slice (the master weights) rounded, and widened into
  // the gathered buffer, so the step computes on the rounded values; not
  // with kGradients (its whole units are kept in fp32). GatherFullParameters
  // gathers in fp32 still. reduce_half: each unit's gradients are divided
  // by the world size, rounded to 16 bits, reduce-scattered (summed) in 16
  // bits, and the rank's slice widened into its fp32 gradient shard.
  std::optional<HalfFormat> param_half;
  std::optional<HalfFormat> reduce_half;
};

class GpuFsdpReducer final : public GpuUnitHooks {
 public:
  // `layout`: HostShards::ForUnits' map over the CPU model's units, for
  // this rank and the communicator's world size (not owned; read here
  // only). `parameters`: the GPU model's, in registration order, named as
  // the layout's. Their values move into the units' layout (the current
  // values: equal on every rank). INVALID_ARGUMENT for another sharding,
  // max_pending_gradients below 1, or a layout that is not these
  // parameters' (another world size, a name or size that differs).
  static absl::StatusOr<std::unique_ptr<GpuFsdpReducer>> Create(
      GpuContext* ctx, NcclCommunicator* nccl, const ShardMap& layout,
      const std::vector<GpuParameter*>& parameters, const GpuFsdpOptions& options);
  ~GpuFsdpReducer() override;
  GpuFsdpReducer(const GpuFsdpReducer&) = delete;
  GpuFsdpReducer& operator=(const GpuFsdpReducer&) = delete;

  // This rank's shards, for the optimizer, named and ordered as the
  // layout's: values in the rank's slice of the weights, gradients in its
  // slice of the averaged gradients (valid after AfterBackward).
  const std::vector<GpuParameter*>& shard_parameters() const { return shard_view_; }

  // The trainer's hooks, in this order each step:
  // Before the step's first forward: zeroes the gradient shards.
  absl::Status BeginStep();
  // Before the last micro-batch's backward (GpuTrainer::UsedFn): this
  // rank's used flags, in registration order (find_unused_parameters;
  // ignored otherwise). INVALID_ARGUMENT for another count.
  absl::Status BeginBackward(const std::vector<bool>& used);
  // After the last backward, before the optimizer.
  absl::Status AfterBackward();
  // The end-of-step wait for `done` (recorded on the compute stream after
  // the update), polling NCCL; the next forward gathers updated weights.
  absl::Status Wait(cudaEvent_t done);
  // A host wait mid-step (fp16's overflow check), with none of Wait's
  // end-of-step work.
  absl::Status WaitForCheck(cudaEvent_t event) {
    return nccl_->WaitForEvent(event, "gradient reduce-scatters");
  }
  // broadcast_buffers, as GpuDdpReducer::BroadcastBuffers.
  absl::Status BroadcastBuffers(const std::vector<GpuParameter*>& buffers);

  // Every unit's whole, current weights in the parameters (collective:
  // every rank calls it at the same point; the compute stream waits for
  // the gathers; in fp32 whatever param_half says), until
  // ReleaseFullParameters; the hooks do nothing meanwhile (evaluation,
  // checkpoints). FAILED_PRECONDITION during a step or twice in a row.
  absl::Status GatherFullParameters();
  void ReleaseFullParameters();

  // GpuUnitHooks.
  absl::Status BeforeForward(int unit) override;
  absl::Status AfterForward(int unit) override;
  absl::Status BeforeBackward(int unit) override;
  absl::Status AfterBackward(int unit) override;

  // Bytes held on the device: the weights (ZeRO-2: whole units; FSDP: the
  // slices), the gradient shards, and the pools' buffers for gathered
  // weights and unit gradients at their most during the last step (with
  // the 16-bit staging).
  struct Memory {
    int64_t weights = 0;
    int64_t gradients = 0;
    int64_t buffers = 0;
  };
  Memory memory() const;
  int num_units() const { return static_cast<int>(units_.size()); }
  // From the step's first collective to its last reduce-scatter on the
  // NCCL stream, and the part of it after backward's end on the compute
  // stream (0 if it ended first), in the last step.
  double last_comm_seconds() const { return comm_seconds_; }
  double last_exposed_seconds() const { return exposed_seconds_; }
  // Bytes handed NCCL in the last step: each reduce-scatter and each
  // all-gather counted as its whole unit (two bytes a value in 16 bits),
  // and what they would have taken in fp32.
  int64_t last_bytes_sent() const { return bytes_sent_; }
  int64_t last_bytes_uncompressed() const { return bytes_fp32_; }

 private:
  enum class Weights { kStale, kGathering, kGathered };
  // Device buffers for gathered units or unit gradients, kept for reuse:
  // a request takes the smallest free one that fits it (holds it, and is
  // at most twice its size), the least recently given back among equals
  // (so that its next user waits for its last one as little as can be),
  // or a new one of its exact size while fewer than `keep` fitting ones
  // exist (gradients rotate through `keep` of them).
  class Pool {
   public:
    Pool() = default;
    ~Pool();
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;
    void set_keep(size_t keep) { keep_ = keep; }
    absl::StatusOr<int> Take(GpuContext* ctx, size_t floats);
    void Give(int slot) { free_.push_back(slot); }
    float* data(int slot) const { return static_cast<float*>(at(slot).buffer.data()); }
    // Recorded on the stream of a buffer's last user when it is given back
    // (gradient buffers: after the reduce-scatter).
    cudaEvent_t event(int slot) const { return at(slot).event; }
    bool recorded(int slot) const { return at(slot).recorded; }
    void set_recorded(int slot) { slots_[static_cast<size_t>(slot)].recorded = true; }
    // Frees buffers given back beyond `keep` (the caller makes sure their
    // last users come before the compute stream's next work, as the
    // allocator needs).
    void Trim();
    // The most bytes held at once since the last ResetPeak.
    int64_t peak_bytes() const { return peak_; }
    void ResetPeak() { peak_ = bytes_; }

   private:
    struct Slot {
      DeviceBuffer buffer;
      size_t floats = 0;
      cudaEvent_t event = nullptr;
      bool recorded = false;
      bool live = true;
    };
    const Slot& at(int slot) const { return slots_[static_cast<size_t>(slot)]; }
    size_t keep_ = 1;
    std::vector<Slot> slots_;
    std::deque<int> free_;
    int64_t bytes_ = 0;
    int64_t peak_ = 0;
  };
  struct Unit {
    std::vector<GpuParameter*> parameters;  // in the layout's order
    std::vector<size_t> offsets;
    size_t floats = 0;
    size_t chunk = 0;
    DeviceBuffer whole;       // ZeRO-2: the unit's weights, kept
    DeviceBuffer shard;       // FSDP: this rank's slice of the weights
    DeviceBuffer shard_grad;  // this rank's slice of the averaged gradients
    int weight_slot = -1;     // FSDP: the pool buffer holding the gathered weights
    int grad_slot = -1;       // in backward: the pool buffer of the gradients
    Weights state = Weights::kStale;
    bool rounded = false;            // gathered in 16 bits (param_half)
    cudaEvent_t gathered = nullptr;  // on the NCCL stream, after the gather
  };

  GpuFsdpReducer(GpuContext* ctx, NcclCommunicator* nccl, const GpuFsdpOptions& options)
      : ctx_(ctx), nccl_(nccl), options_(options) {}
  bool sharded_weights() const { return options_.sharding != Sharding::kGradients; }
  Pool& weight_pool(int u) { return u == 0 ? root_weights_ : weights_; }
  Pool& grad_pool(int u) { return u == 0 ? root_grads_ : grads_; }
  // Points the unit's values (or gradients) into `base` laid out as the
  // unit; null: nowhere (shapes kept).
  void PointValues(int u, float* base);
  void PointGrads(int u, float* base);
  // The NCCL stream after everything the compute stream queued so far.
  absl::Status NcclAfterCompute();
  // Records the step's start on the NCCL stream before its first
  // collective.
  absl::Status StartTiming();
  // Queues the unit's gather unless its weights are gathered or on the way
  // (in 16 bits with param_half, unless `full_precision`).
  absl::Status Gather(int u, bool full_precision = false);
  // The unit's gradients in `grads` reduce-scattered (averaged) on the NCCL
  // stream, the rank's slice added to its gradient shard.
  absl::Status ReduceScatter(int u, float* grads);
  // The compute stream after the unit's gather.
  absl::Status WaitGathered(int u);
  absl::Status FreeWeights(int u);

  GpuContext* ctx_;
  NcclCommunicator* nccl_;
  GpuFsdpOptions options_;
  size_t rank_ = 0;
  std::vector<Unit> units_;
  std::vector<GpuParameter*> parameters_;  // registration order
  std::vector<std::unique_ptr<GpuParameter>> shards_;
  std::vector<GpuParameter*> shard_view_;
  std::vector<size_t> shard_whole_;  // each shard's parameter, registration index
  // FSDP's gathered weights, and every unit's gradients during backward;
  // the root's apart (it is larger than a block, and alive throughout).
  Pool weights_, root_weights_, grads_, root_grads_;
  std::unique_ptr<UsedFlags> used_;
  // Mixed precision's 16-bit staging, used on the NCCL stream only (so
  // reused in its order): a rank's slice and a whole unit for gathers, a
  // whole unit for reduce-scatters; sized for the largest unit.
  DeviceBuffer send_half_, gather_half_, reduce_half_;
  bool summoned_ = false;
  bool in_step_ = false;
  // The parameters point into the units (Create went through).
  bool moved_ = false;
  bool timing_ = false;  // the step's start is recorded
  // mark_: compute stream -> NCCL stream (reused); start_, end_: the NCCL
  // stream's span; backward_end_: on the compute stream.
  cudaEvent_t mark_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t end_ = nullptr;
  cudaEvent_t backward_end_ = nullptr;
  cudaEvent_t buffers_done_ = nullptr;
  bool timed_ = false;  // the last step has figures
  double comm_seconds_ = 0;
  double exposed_seconds_ = 0;
  int64_t bytes_sent_ = 0;
  int64_t bytes_fp32_ = 0;
  int64_t bytes_step_ = 0;
  int64_t fp32_step_ = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_FSDP_H_
