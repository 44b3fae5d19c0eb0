#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_CONTEXT_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_CONTEXT_H_

// What one trainer needs to run on one GPU: the device, a compute stream,
// a cuBLAS and a cuDNN handle bound to that stream, and the caching
// allocator every device tensor of the trainer comes from. Everything the
// GPU engine does for the trainer is queued on this one stream, in order, so
// nothing inside the engine needs events or host synchronisation; the host
// waits only where it reads results back (Synchronize, downloads).
//
// Not thread-safe. The context must outlive every GpuTensor, layer, model and
// optimizer created with it. The calling thread's current device is set to
// the context's device by Create; work for another device in the same
// thread must set it back (Activate).

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"

namespace aidn::engine::cuda {

// What GEMMs and convolutions multiply in (spec precision). Weights,
// gradients, optimizer state and the activations between layers stay fp32
// either way; in bf16 and fp16 the layers round their operands to 16 bits
// just before cuBLAS / cuDNN, which sum in fp32 on the tensor cores. Linear
// writes its results in fp32; cuDNN writes a convolution's output, input
// gradient and weight gradient in the 16-bit type (as torch's autocast
// does), and the layer converts them back (the weight gradient is added
// into the fp32 one), so in fp16 a loss-scaled convolution weight gradient
// can overflow 65504 and skip a step.
enum class Precision { kFp32, kBf16, kFp16 };

struct GpuContextOptions {
  // CUDA device ordinal (after CUDA_VISIBLE_DEVICES).
  int device = 0;
  Precision precision = Precision::kFp32;
  // Let cuBLAS and cuDNN use TF32 tensor cores for fp32 GEMMs and
  // convolutions (10-bit mantissa products: ~1e-3 relative error). Off by
  // default so results compare with the CPU path at fp32 precision.
  bool allow_tf32 = false;
  // The largest cuDNN workspace a convolution algorithm may ask for;
  // algorithms needing more are not chosen.
  size_t max_workspace_bytes = size_t{256} << 20;
  // Let cuDNN use FFT and Winograd convolution algorithms. Their transforms
  // lose a few bits against a direct sum, so they are off by default and
  // fp32 convolutions use the GEMM-based and direct algorithms only, which
  // agree with the CPU path to ~1e-6.
  bool allow_transform_convolutions = false;
  // Prefer deterministic convolution algorithms (two runs of a step give
  // the same bits), falling back to the others only for a shape that has
  // none. Off: the fastest usable algorithm, as PyTorch with
  // cudnn.benchmark and without cudnn.deterministic.
  bool deterministic_convolutions = true;
  // Choose convolution algorithms by timing them (cudnnFind*) rather than
  // by cuDNN's heuristics alone (cudnnGet*_v7). Once per shape either way.
  bool benchmark_convolutions = true;
};

class GpuContext {
 public:
  // FAILED_PRECONDITION when there is no driver or no such device;
  // otherwise the status of the failed CUDA / cuBLAS / cuDNN call.
  static absl::StatusOr<std::unique_ptr<GpuContext>> Create(const GpuContextOptions& options);
  ~GpuContext();
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  const GpuContextOptions& options() const { return options_; }
  int device() const { return options_.device; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  cudnnHandle_t cudnn() const { return cudnn_; }
  CachingAllocator& allocator() { return *allocator_; }

  // A scratch area of at least `bytes` (cuDNN workspaces), shared by all
  // users of the context: safe because they all queue on the one stream,
  // so one user's kernels finish before the next user's start. Valid until
  // the next call.
  absl::StatusOr<void*> Workspace(size_t bytes);
  // Bumped each time Workspace moves the area (a CUDA graph that baked its
  // address in is stale then).
  uint64_t workspace_generation() const { return workspace_generation_; }

  // cudaSetDevice(device()).
  absl::Status Activate() const;
  // Waits for everything queued on the stream; reports an asynchronous
  // kernel failure if one happened.
  absl::Status Synchronize() const;

 private:
  explicit GpuContext(const GpuContextOptions& options) : options_(options) {}
  GpuContextOptions options_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  // Destroyed (cudaFree) after the handles, before the stream.
  std::unique_ptr<CachingAllocator> allocator_;
  DeviceBuffer workspace_;
  uint64_t workspace_generation_ = 0;
  // cuBLAS's (NVIDIA's advice for Hopper: 32 MiB).
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
  DeviceBuffer cublas_workspace_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_CONTEXT_H_
