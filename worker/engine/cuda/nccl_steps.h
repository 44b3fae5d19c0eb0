#ifndef AIDN_WORKER_ENGINE_CUDA_NCCL_STEPS_H_
#define AIDN_WORKER_ENGINE_CUDA_NCCL_STEPS_H_

// Pieces of a data-parallel step on NCCL that the DDP reducer
// (gpu_ddp.h) and the sharded one (gpu_fsdp.h) both take: rank 0's
// buffers broadcast before a step, and find_unused_parameters' used flags
// summed over the ranks. Not thread-safe: the trainer's thread.

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"

namespace aidn::engine::cuda {

// broadcast_buffers: rank 0's `buffers` (running statistics) to every
// rank, on the NCCL stream after what the compute stream queued so far
// (the last step's forward updated them), and the compute stream ordered
// after it; no host wait. `ready` and `done` are the caller's events
// (reused: a wait binds to the record before it).
absl::Status BroadcastBuffersFromRankZero(GpuContext* ctx, NcclCommunicator* nccl,
                                          const std::vector<GpuParameter*>& buffers,
                                          cudaEvent_t ready, cudaEvent_t done);

// A reducer's teardown: with a failed step's collectives in flight (which
// peers may never join) the communicator is aborted, otherwise its queue
// waited for (bounded, as every NCCL wait); then both streams drained, so
// that nothing reads or writes the reducer's buffers any more. `what`
// names the collectives ("gradient buckets").
void SettleAtTeardown(GpuContext* ctx, NcclCommunicator* nccl, bool in_flight,
                      absl::string_view what);

// find_unused_parameters' flags: per parameter (registration order),
// whether any forward of the step used it on this rank, summed over the
// ranks and read on the host (as torch's reducer reads its used map).
class UsedFlags {
 public:
  static absl::StatusOr<std::unique_ptr<UsedFlags>> Create(GpuContext* ctx, size_t count);
  ~UsedFlags();
  UsedFlags(const UsedFlags&) = delete;
  UsedFlags& operator=(const UsedFlags&) = delete;

  // This rank's flags for the step. INVALID_ARGUMENT for another count
  // (naming `who`).
  absl::Status Set(const std::vector<bool>& used, const char* who);
  // The flags summed over the ranks, on the NCCL stream, then read here (a
  // host wait bounded by the communicator's timeout): each of
  // `parameters` (the flags' order) no rank used is marked no_grad, and so
  // is each of `shards` (ZeRO's pieces; shard k of parameter
  // shard_whole[k]) with its whole parameter. The flags read "all used"
  // after, for a step whose trainer sets none.
  absl::Status MarkUnused(NcclCommunicator* nccl, const std::vector<GpuParameter*>& parameters,
                          const std::vector<GpuParameter*>& shards,
                          const std::vector<size_t>& shard_whole);

 private:
  UsedFlags() = default;
  size_t count_ = 0;
  float* host_ = nullptr;  // pinned
  DeviceBuffer device_;
  cudaEvent_t done_ = nullptr;
};

// A pipeline stage's link to a neighbour over NCCL (stream_collectives.h):
// each ExchangeOn is one NCCL group of a send and a receive with `peer` on
// the communicator's stream, ordered against the caller's stream with
// events, with no host wait. The communicator (the pipeline's ranks, or
// any holding both) must outlive the link.
class NcclDeviceLink final : public DeviceLink {
 public:
  NcclDeviceLink(NcclCommunicator* comm, int peer) : comm_(comm), peer_(peer) {}
  absl::Status ExchangeOn(cudaStream_t stream, const float* send, size_t send_count, float* recv,
                          size_t recv_count) override;

 private:
  NcclCommunicator* comm_;
  int peer_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_NCCL_STEPS_H_
