#ifndef AIDN_WORKER_ENGINE_CUDA_SESSION_SETUP_H_
#define AIDN_WORKER_ENGINE_CUDA_SESSION_SETUP_H_

// What every GpuSession implementation (gpu_session.cc: a Sequential's;
// gpu_gpt_session.cc: a GPT's) sets up the same way: the options checked,
// the device found and its context made, and with more than one rank the
// NCCL communicator and the reducer over the model's parameters (DDP and
// ZeRO-1: gpu_ddp.h; ZeRO-2 and FSDP: gpu_fsdp.h), with the step's calls
// into whichever there is. Internal to aidn_gpu_session.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/gpu_units.h"
#include "worker/engine/gpu_session.h"
#if AIDN_HAVE_NCCL
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/gpu_ddp.h"
#include "worker/engine/cuda/gpu_fsdp.h"
#endif

namespace aidn::engine::cuda {

// GpuSession::Evaluate's count of right predictions: how many rows of
// `logits` [rows, classes] have their first largest at their label (host
// `labels`, rows of them), on the device (LaunchCorrectRows), so that only
// one flag per row comes back to the host. Waits for the stream.
struct EvalScratch {
  DeviceBuffer labels;
  DeviceBuffer correct;
};
absl::StatusOr<int64_t> CountCorrectOnDevice(GpuContext* ctx, const GpuTensor& logits,
                                             const std::vector<int32_t>& labels,
                                             EvalScratch* scratch);

struct SessionDevice {
  std::unique_ptr<GpuContext> ctx;
  // "NVIDIA H100 80GB HBM3 (device 0), bf16"
  std::string description;
};

// INVALID_ARGUMENT for a bad rank, precision or a missing store;
// FAILED_PRECONDITION without the device, or for bf16 below compute
// capability 8.0.
absl::StatusOr<SessionDevice> SetUpSessionDevice(const GpuSessionOptions& options);

// The gradient averaging of world_size > 1 (nothing for one rank): the
// communicator (its id through options.store) and a reducer over
// `parameters` in registration order (compressed or sharded as the options
// say), appended to `description`. UNIMPLEMENTED in a build without NCCL.
struct SessionDdp {
#if AIDN_HAVE_NCCL
  std::unique_ptr<NcclCommunicator> nccl;
  std::unique_ptr<GpuDdpReducer> reducer;  // DDP, ZeRO-1
  std::unique_ptr<GpuFsdpReducer> fsdp;    // ZeRO-2, FSDP
#endif
  // Whether a reducer runs (more than one rank).
  bool active() const;
  // The step's calls into the reducer, in this order (OK with none):
  // before the first forward (ZeRO-2, FSDP: the gradient shards zeroed;
  // `buffers`, broadcast_buffers: rank 0's to every rank);
  absl::Status BeginStep(const std::vector<GpuParameter*>& buffers);
  // DDP's grad-ready report for the last backward (null without DDP);
  std::function<absl::Status(const std::vector<GpuParameter*>&)> GradReady() const;
  // before the last micro-batch's backward, with the parameters some
  // forward of the step used and those the last one left unused;
  absl::Status BeginBackward(const std::vector<bool>& used,
                             const std::vector<GpuParameter*>& unused_now);
  // after backward, before the optimizer;
  absl::Status AfterBackward();
  // host waits: mid-step (fp16's overflow check) and at the step's end.
  absl::Status WaitForCheck(cudaEvent_t event);
  absl::Status Wait(cudaEvent_t done);
  // ZeRO-2, FSDP: the model's unit hooks (null otherwise).
  GpuUnitHooks* unit_hooks() const;
  // GpuSession's GatherFullParameters / ReleaseFullParameters.
  absl::Status GatherFullParameters();
  void ReleaseFullParameters();
  // broadcast_buffers was asked for (and there are ranks to share them).
  bool broadcast_buffers = false;

  // The last step's communication span and the part of it backward did
  // not hide, and the collectives completed (0 with one rank): GpuSession's
  // figures.
  double allreduce_seconds() const;
  double exposed_seconds() const;
  int64_t collective_sequence() const;
  // GpuSession::memory() of a model with these parameters and buffers and
  // this optimizer's state: the gradients in the buckets with DDP, the
  // shards with ZeRO-2 and FSDP.
  GpuSession::StateMemory Memory(const std::vector<GpuParameter*>& parameters,
                                 const std::vector<GpuParameter*>& buffers,
                                 int64_t optimizer_state_bytes) const;
  // ZeRO: this rank's shards, for the optimizer (null otherwise).
  const std::vector<GpuParameter*>* shards() const;
  // GpuSession::CopyShardsTo from shards().
  absl::Status CopyShardsTo(GpuContext* ctx, const std::vector<Parameter*>& host) const;
  // ZeRO in fp16: the overflow flag's maximum over the ranks on `ctx`'s
  // stream (GpuTrainer::SetOverflowAllReduce).
  std::function<absl::Status(int32_t*)> OverflowAllReduce(GpuContext* ctx) const;
  // ZeRO: the optimizer's clipping hook (GpuOptimizer::SetNormAllReduce):
  // the squared norm summed over the ranks on `ctx`'s stream.
  std::function<absl::Status(double*)> NormAllReduce(GpuContext* ctx) const;
  // The reducer's bytes figures (0 with one rank).
  int64_t bytes_sent() const;
  int64_t bytes_uncompressed() const;
};
absl::Status SetUpSessionDdp(const GpuSessionOptions& options, GpuContext* ctx,
                             const std::vector<GpuParameter*>& parameters, SessionDdp* ddp,
                             std::string* description);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_SESSION_SETUP_H_
