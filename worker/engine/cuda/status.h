#ifndef AIDN_WORKER_ENGINE_CUDA_STATUS_H_
#define AIDN_WORKER_ENGINE_CUDA_STATUS_H_

// CUDA runtime, cuBLAS and cuDNN results as absl::Status, converted where the
// call is made so the message says what failed and where:
//
//   AIDN_RETURN_IF_CUDA_ERROR(cudaMalloc(&p, bytes));
//   -> RESOURCE_EXHAUSTED "cudaMalloc(&p, bytes) at allocator.cc:42: out of memory
//      (cudaErrorMemoryAllocation)"
//
// Codes: out-of-memory and allocation failures map to RESOURCE_EXHAUSTED, bad
// arguments to INVALID_ARGUMENT, "not supported" to UNIMPLEMENTED, a missing
// or too old driver / no device to FAILED_PRECONDITION, everything else
// (launch failures, illegal addresses, ...) to INTERNAL.

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace aidn::engine::cuda {

// OK for cudaSuccess, else "<context>: <error string> (<error name>)".
absl::Status CudaError(absl::string_view context, cudaError_t err);
absl::Status CublasError(absl::string_view context, cublasStatus_t status);
absl::Status CudnnError(absl::string_view context, cudnnStatus_t status);

// "<call text> at <file>:<line>", the context the macros below give.
std::string CallSite(const char* call, const char* file, int line);

}  // namespace aidn::engine::cuda

#define AIDN_CUDA_STATUS_RETURN_(convert, expr)                                        \
  do {                                                                                 \
    auto aidn_cuda_result_ = (expr);                                                   \
    ::absl::Status aidn_cuda_status_ = ::aidn::engine::cuda::convert(                  \
        ::aidn::engine::cuda::CallSite(#expr, __FILE__, __LINE__), aidn_cuda_result_); \
    if (!aidn_cuda_status_.ok()) return aidn_cuda_status_;                             \
  } while (false)

// Return from the enclosing function (which returns absl::Status or
// absl::StatusOr<T>) when the call fails.
#define AIDN_RETURN_IF_CUDA_ERROR(expr) AIDN_CUDA_STATUS_RETURN_(CudaError, expr)
#define AIDN_RETURN_IF_CUBLAS_ERROR(expr) AIDN_CUDA_STATUS_RETURN_(CublasError, expr)
#define AIDN_RETURN_IF_CUDNN_ERROR(expr) AIDN_CUDA_STATUS_RETURN_(CudnnError, expr)

// After a kernel launch: a bad configuration (grid too large, too much
// shared memory) is reported by cudaGetLastError, naming the kernel.
#define AIDN_RETURN_IF_LAUNCH_FAILED(kernel_name)                                  \
  do {                                                                             \
    ::absl::Status aidn_cuda_status_ = ::aidn::engine::cuda::CudaError(            \
        ::aidn::engine::cuda::CallSite("launch " kernel_name, __FILE__, __LINE__), \
        cudaGetLastError());                                                       \
    if (!aidn_cuda_status_.ok()) return aidn_cuda_status_;                         \
  } while (false)

#endif  // AIDN_WORKER_ENGINE_CUDA_STATUS_H_
