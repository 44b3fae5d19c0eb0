#include "worker/engine/cuda/nccl_steps.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::Status BroadcastBuffersFromRankZero(GpuContext* ctx, NcclCommunicator* nccl,
                                          const std::vector<GpuParameter*>& buffers,
                                          cudaEvent_t ready, cudaEvent_t done) {
  if (buffers.empty()) return absl::OkStatus();
  cudaStream_t comm = nccl->stream();
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(ready, ctx->stream()));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(comm, ready, 0));
  std::vector<std::pair<float*, size_t>> all;
  for (GpuParameter* b : buffers) {
    all.emplace_back(b->value.data(), static_cast<size_t>(b->value.numel()));
  }
  absl::Status s = nccl->EnqueueBroadcasts(all, /*root=*/0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("buffers: ", s.message()));
  // This step's forward reads them.
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done, comm));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(ctx->stream(), done, 0));
  return absl::OkStatus();
}

void SettleAtTeardown(GpuContext* ctx, NcclCommunicator* nccl, bool in_flight,
                      absl::string_view what) {
  if (in_flight) {
    nccl->Abort(absl::StrCat("a step failed with ", what, " in flight"));
  } else {
    nccl->Wait(absl::StrCat(what, " at teardown")).IgnoreError();
  }
  cudaStreamSynchronize(nccl->stream());
  cudaStreamSynchronize(ctx->stream());
}

absl::StatusOr<std::unique_ptr<UsedFlags>> UsedFlags::Create(GpuContext* ctx, size_t count) {
  std::unique_ptr<UsedFlags> f(new UsedFlags());
  f->count_ = count;
  if (count == 0) return f;
  AIDN_RETURN_IF_CUDA_ERROR(cudaMallocHost(&f->host_, sizeof(float) * count));
  // A step whose trainer reports nothing used everything.
  std::fill(f->host_, f->host_ + count, 1.0f);
  AIDN_ASSIGN_OR_RETURN(f->device_, ctx->allocator().Allocate(sizeof(float) * count));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&f->done_, cudaEventDisableTiming));
  return f;
}

UsedFlags::~UsedFlags() {
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (host_ != nullptr) cudaFreeHost(host_);
}

absl::Status UsedFlags::Set(const std::vector<bool>& used, const char* who) {
  if (used.size() != count_) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", used.size(), " used flags for ", count_, " parameters"));
  }
  // The previous step's sums were read (Sum waited), so the pinned flags
  // are free.
  for (size_t i = 0; i < count_; ++i) host_[i] = used[i] ? 1.0f : 0.0f;
  return absl::OkStatus();
}

absl::Status UsedFlags::MarkUnused(NcclCommunicator* nccl,
                                   const std::vector<GpuParameter*>& parameters,
                                   const std::vector<GpuParameter*>& shards,
                                   const std::vector<size_t>& shard_whole) {
  if (count_ == 0) return absl::OkStatus();
  if (parameters.size() != count_) {
    return absl::InvalidArgumentError(
        absl::StrCat(parameters.size(), " parameters for ", count_, " used flags"));
  }
  cudaStream_t comm = nccl->stream();
  float* device = static_cast<float*>(device_.data());
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(device, host_, sizeof(float) * count_, cudaMemcpyHostToDevice, comm));
  // Sums of zeros and ones: exact in float.
  AIDN_RETURN_IF_ERROR(
      Annotate(nccl->EnqueueAllReduce(device, count_, ReduceOp::kSum), "used parameter flags"));
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(host_, device, sizeof(float) * count_, cudaMemcpyDeviceToHost, comm));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done_, comm));
  AIDN_RETURN_IF_ERROR(nccl->WaitForEvent(done_, "used parameter flags"));
  for (size_t i = 0; i < count_; ++i) parameters[i]->no_grad = host_[i] == 0.0f;
  // A shard is left alone with its whole parameter (as
  // ShardMap::CopyNoGradToShards on the CPU).
  for (size_t k = 0; k < shards.size(); ++k)
    shards[k]->no_grad = parameters[shard_whole[k]]->no_grad;
  std::fill(host_, host_ + count_, 1.0f);
  return absl::OkStatus();
}

absl::Status NcclDeviceLink::ExchangeOn(cudaStream_t stream, const float* send, size_t send_count,
                                        float* recv, size_t recv_count) {
  AIDN_RETURN_IF_ERROR(comm_->WaitFor(stream));
  AIDN_RETURN_IF_ERROR(comm_->EnqueueExchange(peer_, send, send_count, recv, recv_count));
  return comm_->Before(stream);
}

}  // namespace aidn::engine::cuda
