#include "worker/engine/cuda/status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace aidn::engine::cuda {
namespace {

absl::StatusCode CodeForCuda(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNotSupported:
      return absl::StatusCode::kUnimplemented;
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CodeForCublas(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::StatusCode::kResourceExhausted;
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::StatusCode::kInvalidArgument;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return absl::StatusCode::kUnimplemented;
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CodeForCudnn(cudnnStatus_t status) {
  const int code = static_cast<int>(status);
  if (code == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      code == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    return absl::StatusCode::kResourceExhausted;
  }
  if (code == CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER ||
      code == CUDNN_STATUS_NOT_INITIALIZED) {
    return absl::StatusCode::kFailedPrecondition;
  }
  // cuDNN 9 groups its codes by the thousand: 2xxx bad parameters, 3xxx
  // not supported, 4xxx internal, 5xxx execution failed.
  switch (code / 1000 * 1000) {
    case CUDNN_STATUS_BAD_PARAM:
      return absl::StatusCode::kInvalidArgument;
    case CUDNN_STATUS_NOT_SUPPORTED:
      return absl::StatusCode::kUnimplemented;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

std::string CallSite(const char* call, const char* file, int line) {
  absl::string_view path(file);
  // Keep the message short: the file's name, not the build machine's path.
  const size_t slash = path.rfind('/');
  if (slash != absl::string_view::npos) path.remove_prefix(slash + 1);
  return absl::StrCat(call, " at ", path, ":", line);
}

absl::Status CudaError(absl::string_view context, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::Status(CodeForCuda(err), absl::StrCat(context, ": ", cudaGetErrorString(err), " (",
                                                     cudaGetErrorName(err), ")"));
}

absl::Status CublasError(absl::string_view context, cublasStatus_t status) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::Status(CodeForCublas(status),
                      absl::StrCat(context, ": ", cublasGetStatusString(status), " (",
                                   cublasGetStatusName(status), ")"));
}

absl::Status CudnnError(absl::string_view context, cudnnStatus_t status) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  return absl::Status(CodeForCudnn(status),
                      absl::StrCat(context, ": ", cudnnGetErrorString(status), " (cudnnStatus ",
                                   static_cast<int>(status), ")"));
}

}  // namespace aidn::engine::cuda
