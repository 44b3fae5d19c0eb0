#include "worker/engine/cuda/gpu_context.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::StatusOr<std::unique_ptr<GpuContext>> GpuContext::Create(const GpuContextOptions& options) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA driver: cudaGetDeviceCount: ", cudaGetErrorString(err)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", options.device, " requested, ", count, " present"));
  }
  std::unique_ptr<GpuContext> ctx(new GpuContext(options));
  AIDN_RETURN_IF_ERROR(ctx->Activate());
  // Non-blocking: the legacy default stream (which other libraries in the
  // process may use) does not serialise with ours.
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&ctx->stream_, cudaStreamNonBlocking));
  ctx->allocator_ = std::make_unique<CachingAllocator>();

  AIDN_RETURN_IF_CUBLAS_ERROR(cublasCreate(&ctx->cublas_));
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetStream(ctx->cublas_, ctx->stream_));
  // Scalars (alpha, beta) are passed from the host.
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetPointerMode(ctx->cublas_, CUBLAS_POINTER_MODE_HOST));
  // Default math keeps fp32 GEMMs in fp32 (products and sums in fp32 FMAs,
  // as on the CPU); TF32 math lets cuBLAS round the inputs to TF32 on
  // tensor cores.
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetMathMode(
      ctx->cublas_, options.allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  // A workspace of our own (after cublasSetStream, which resets it): cuBLAS
  // then allocates nothing while a CUDA graph is captured.
  AIDN_ASSIGN_OR_RETURN(ctx->cublas_workspace_, ctx->allocator_->Allocate(kCublasWorkspaceBytes));
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetWorkspace(ctx->cublas_, ctx->cublas_workspace_.data(),
                                                 ctx->cublas_workspace_.bytes()));

  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreate(&ctx->cudnn_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetStream(ctx->cudnn_, ctx->stream_));
  return ctx;
}

GpuContext::~GpuContext() {
  // Let queued work finish before its memory and handles go away.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (cudnn_ != nullptr) cudnnDestroy(cudnn_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  workspace_.Release();
  cublas_workspace_.Release();
  allocator_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<void*> GpuContext::Workspace(size_t bytes) {
  if (bytes > workspace_.bytes()) {
    // Queued work may still use the old block; the allocator's one-stream
    // contract makes handing it back now safe.
    workspace_.Release();
    ++workspace_generation_;
    AIDN_ASSIGN_OR_RETURN(workspace_, allocator_->Allocate(bytes));
  }
  return workspace_.data();
}

absl::Status GpuContext::Activate() const {
  AIDN_RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device));
  return absl::OkStatus();
}

absl::Status GpuContext::Synchronize() const {
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
