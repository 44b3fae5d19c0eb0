#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_DDP_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_DDP_H_

// Data-parallel gradient averaging on GPUs with NCCL, overlapped with
// backward (torch DDP's reducer, on streams instead of a thread):
//
//   * The gradients are grouped into buckets of about bucket_mb, in reverse
//     registration order (ddp.h's PlanBuckets, the CPU reducer's plan), and
//     each gradient becomes a view into its bucket's flat device buffer
//     (torch's gradient_as_bucket_view): backward writes where NCCL reads,
//     and the averages land where the optimizer reads, with no copies.
//   * OnGradReady (the trainer's grad-ready hook, called as each layer's
//     backward is queued) launches a bucket once its last gradient is in:
//     an event recorded on the compute stream, the NCCL stream waits for
//     it, ncclAllReduce(ncclAvg) on the bucket. Later layers' backward
//     kernels go on queuing on the compute stream meanwhile, so the
//     allreduce of the last layers overlaps the backward of the first.
//   * AfterBackward (before the optimizer): an event on the NCCL stream
//     after the last bucket, and the compute stream waits for it. The host
//     does not wait: the update is simply ordered after the averages.
//   * Wait (the trainer's end-of-step wait): the host waits for the step's
//     last event while polling NCCL for asynchronous errors against the
//     communicator's timeout; a dead peer fails the step (the communicator
//     is aborted) instead of hanging the trainer.
//
// Only the last micro-batch of a step (gradient accumulation) reports its
// gradients ready; the earlier ones accumulate locally.
//
// Compression (DdpOptions::half, spec ddp.compression fp16 | bf16, the CPU
// reducer's semantics): each bucket is multiplied by 1 / world size,
// rounded to 16 bits and summed in 16 bits by NCCL, then widened back, all
// on the NCCL stream. PowerSGD (DdpOptions::powersgd, cuda/gpu_powersgd.h)
// compresses each bucket on the NCCL stream too, once its start_step is
// reached.
//
// ZeRO-1 (DdpOptions::shard_optimizer, with the layout of a HostShards
// built from the same plan): each bucket, padded to 16 x world_size floats,
// is reduce-scattered (averaged) in place instead of allreduced, so the
// rank's slice of it holds the averages of its shard; the weights move
// into per-bucket buffers of the same layout; shard_parameters() are this
// rank's shards (named as the CPU reducer names them, values and gradients
// views into the rank's slices) for an optimizer over them; Wait
// all-gathers every bucket's weights in place after the update, before
// the next forward (find_unused_parameters: a shard is left alone with its
// whole parameter). Not with compression.
//
// Unused parameters (a forward that skipped a block: GpuTrainer's
// before-last-backward hook calls BeginBackward): without
// find_unused_parameters a step that leaves one without a gradient fails,
// naming it (its bucket is still launched, so the ranks stay in step).
// With it, as the CPU reducer and torch: the last forward's unused
// parameters are ready at once (their zero gradients join the averages),
// and after the buckets one float per parameter, whether the rank used it
// in any forward of the step, is summed over the ranks; what no rank used
// is marked no_grad for the optimizer. That sum is read on the host before
// the update (a wait bounded by the communicator's timeout), as torch's
// reducer reads its used map.
//
// A step that failed part-way (an error from a hook, a backward error)
// leaves the reducer's per-step state behind: the trainer fails the
// generation then, and a new generation builds a new reducer.
//
// Not thread-safe: the trainer's thread. The parameters, the context and the
// communicator must outlive the reducer. When the reducer goes, the
// gradients get storage of their own again (with their values).

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_powersgd.h"
#include "worker/engine/cuda/nccl_steps.h"
#include "worker/engine/ddp.h"

namespace aidn::engine::cuda {

class GpuDdpReducer {
 public:
  // `parameters` in registration order (GpuModel::Parameters()).
  // INVALID_ARGUMENT for a bad bucket size, a null or duplicate parameter.
  static absl::StatusOr<std::unique_ptr<GpuDdpReducer>> Create(
      GpuContext* ctx, const std::vector<GpuParameter*>& parameters, NcclCommunicator* nccl,
      const DdpOptions& options, const ShardMap* shards = nullptr);
  ~GpuDdpReducer();
  GpuDdpReducer(const GpuDdpReducer&) = delete;
  GpuDdpReducer& operator=(const GpuDdpReducer&) = delete;

  // These gradients are complete in the compute stream's order; launches
  // the buckets this completes, in plan order (a full bucket waits for the
  // ones before it). INVALID_ARGUMENT for a parameter the
  // reducer does not know; FAILED_PRECONDITION for one reported twice in a
  // backward.
  absl::Status OnGradReady(const std::vector<GpuParameter*>& parameters);
  // Before the last micro-batch's backward (GpuTrainer::UsedFn): `used` in
  // registration order. INVALID_ARGUMENT for a size that is not the
  // parameters'.
  absl::Status BeginBackward(const std::vector<bool>& used,
                             const std::vector<GpuParameter*>& unused_now);
  // Orders the compute stream after every bucket's allreduce
  // (find_unused_parameters: and sets no_grad from the summed used flags).
  // INVALID_ARGUMENT naming the parameters that got no gradient, after
  // launching their buckets anyway so the ranks stay in step.
  absl::Status AfterBackward();
  // broadcast_buffers: rank 0's `buffers` (running statistics) to every
  // rank, on the NCCL stream after what the compute stream queued so far,
  // and the compute stream ordered after it; no host wait (Wait reports an
  // error). Call before a step's first forward, on every rank alike.
  absl::Status BroadcastBuffers(const std::vector<GpuParameter*>& buffers);
  // The end-of-step wait: for `done` (recorded on the compute stream after
  // the update), polling NCCL; then measures the allreduce time. ZeRO-1: first queues
  // the weights' all-gathers after `done`, orders the compute stream after
  // them, and waits for them instead.
  absl::Status Wait(cudaEvent_t done);
  // A host wait mid-step (fp16's overflow check after the averages): for
  // `event`, polling NCCL, with none of Wait's end-of-step work.
  absl::Status WaitForCheck(cudaEvent_t event) {
    return nccl_->WaitForEvent(event, "gradient averages");
  }

  // From the first bucket's launch to the last bucket's end, on the NCCL
  // stream, in the last step (0 before one).
  double last_allreduce_seconds() const { return allreduce_seconds_; }
  // The part of it backward did not hide: from the end of backward on the
  // compute stream to the end of the last allreduce (0 if that came first).
  double last_exposed_seconds() const { return exposed_seconds_; }
  // Bytes the last step handed NCCL per rank (PowerSGD: its P, Q and
  // uncompressed gradients; fp16 / bf16: two bytes a value), and what
  // plain float allreduces would have taken (DdpReducer's figures).
  int64_t last_bytes_sent() const { return bytes_sent_; }
  int64_t last_bytes_uncompressed() const { return bytes_uncompressed_; }
  // ZeRO-1: this rank's shards, for the optimizer (empty otherwise).
  const std::vector<GpuParameter*>& shard_parameters() const { return shard_view_; }
  // PowerSGD's state (null without it): tests read its error.
  const GpuPowerSgd* powersgd() const { return powersgd_.get(); }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Bytes of the gradient buckets (the gradients live in them, padding
  // included) and of their 16-bit copies.
  int64_t bucket_bytes() const {
    int64_t n = 0;
    for (const Bucket& b : buckets_) n += static_cast<int64_t>(b.buffer.bytes() + b.half.bytes());
    return n;
  }
  // ZeRO-1: bytes of the weights' buffers (0 otherwise: the weights are
  // the model's own).
  int64_t weight_bytes() const {
    int64_t n = 0;
    for (const Bucket& b : buckets_) n += static_cast<int64_t>(b.values.bytes());
    return n;
  }
  // The buckets the last step launched, in the order it launched them (the
  // plan's on every rank).
  const std::vector<int>& last_launch_order() const { return launch_order_; }
  // Parameter names per bucket, in launch order.
  std::vector<std::vector<std::string>> BucketLayout() const;

 private:
  struct Bucket {
    std::vector<GpuParameter*> parameters;
    DeviceBuffer buffer;
    size_t floats = 0;
    int pending = 0;  // gradients still to come in this backward
    // Compression (DdpOptions::half): the bucket's 16-bit copy.
    DeviceBuffer half;
    // ZeRO-1: the weights in the bucket's layout, and each rank's slice.
    DeviceBuffer values;
    size_t chunk = 0;
  };

  GpuDdpReducer(GpuContext* ctx, NcclCommunicator* nccl) : ctx_(ctx), nccl_(nccl) {}
  // A compressed bucket's allreduce on the NCCL stream: scaled by 1 /
  // world size, rounded to 16 bits, summed, widened back into the bucket.
  absl::Status LaunchHalf(Bucket& bucket);
  absl::Status Launch(int bucket);
  // ZeRO-1: the plan padded, and checked against the shards' layout.
  static absl::Status CheckShardLayout(const std::vector<GpuParameter*>& parameters,
                                       const ShardMap* shards, int world_size, BucketPlan* plan);
  // ZeRO-1: the weights into the buckets' layout, and the shards.
  absl::Status ShardBuckets(const ShardMap& shards, const BucketPlan& plan);
  // find_unused_parameters: the used flags summed over the ranks, read on
  // the host, and each parameter's no_grad set from them.
  absl::Status ExchangeUsedFlags();
  // "ddp: 2 parameters got no gradient this step (a, b): ..." for what no
  // backward reported.
  absl::Status MissingGradients() const;

  GpuContext* ctx_;
  NcclCommunicator* nccl_;
  std::vector<Bucket> buckets_;
  std::unordered_map<GpuParameter*, int> bucket_of_;
  std::unordered_map<GpuParameter*, bool> reported_;
  // Registration order (find_unused_parameters' flags follow it).
  std::vector<GpuParameter*> parameters_;
  bool find_unused_ = false;
  // find_unused_parameters: the rank's used flags.
  std::unique_ptr<UsedFlags> used_;
  int launched_ = 0;
  // The next bucket to launch (they go in plan order), and the order of
  // this step's launches.
  size_t next_launch_ = 0;
  std::vector<int> launch_order_;
  std::optional<HalfFormat> half_;
  std::unique_ptr<GpuPowerSgd> powersgd_;
  // ZeRO-1.
  bool sharded_ = false;
  size_t rank_ = 0;
  std::vector<std::unique_ptr<GpuParameter>> shards_;
  std::vector<GpuParameter*> shard_view_;
  std::vector<size_t> shard_whole_;     // each shard's parameter, registration index
  cudaEvent_t gather_start_ = nullptr;  // timed: the all-gathers' span
  cudaEvent_t gathered_ = nullptr;
  int64_t bytes_sent_ = 0;
  int64_t bytes_uncompressed_ = 0;
  // ready_: compute stream -> NCCL stream (reused: a wait binds to the
  // record before it). start_, end_: the NCCL stream's span, timed; the
  // compute stream waits for end_.
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t end_ = nullptr;
  // Backward's end on the compute stream, timed.
  cudaEvent_t backward_end_ = nullptr;
  // BroadcastBuffers: the NCCL stream's broadcasts done.
  cudaEvent_t buffers_done_ = nullptr;
  bool timed_ = false;
  double allreduce_seconds_ = 0;
  double exposed_seconds_ = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_DDP_H_
