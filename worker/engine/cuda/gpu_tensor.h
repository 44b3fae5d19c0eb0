#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_TENSOR_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_TENSOR_H_

// A dense float32 tensor in device memory, row-major with the CPU Tensor's
// shapes (NCHW, torch layouts). It is its own type rather than a device tag
// on engine::Tensor so that the CPU engine stays free of CUDA. Storage comes
// from the GpuContext's caching allocator and is kept by Resize when the new
// size fits, so a training loop at a fixed batch size allocates only in its
// first step.
//
// A view (View()) borrows another tensor's memory with a different shape
// (Flatten's output); the memory must outlive it.
//
// Copies between host and device are queued on the context's stream; the
// host-side functions that return data (ToHost, Download) wait for it.
// Not thread-safe; move-only.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/tensor.h"

namespace aidn::engine::cuda {

class GpuTensor {
 public:
  GpuTensor() = default;
  // A moved-from tensor is empty (shape [], no storage).
  GpuTensor(GpuTensor&& other) noexcept;
  GpuTensor& operator=(GpuTensor&& other) noexcept;
  GpuTensor(const GpuTensor&) = delete;
  GpuTensor& operator=(const GpuTensor&) = delete;

  // Uninitialised device storage for `shape`.
  static absl::StatusOr<GpuTensor> Empty(GpuContext* ctx, std::vector<int64_t> shape);
  // A device copy of a CPU tensor (queued; `host` may be reused on return:
  // pageable copies are staged by the driver before cudaMemcpyAsync returns).
  static absl::StatusOr<GpuTensor> FromHost(GpuContext* ctx, const Tensor& host);
  // Borrows `data` (numel floats of device memory) with `shape`.
  static GpuTensor View(float* data, std::vector<int64_t> shape);

  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int64_t numel() const { return numel_; }
  bool is_view() const { return data_ != nullptr && buffer_.data() == nullptr; }
  float* data() { return data_; }
  const float* data() const { return data_; }
  std::string ShapeString() const;

  // Gives the tensor `shape`, keeping its storage if it is large enough
  // (contents then unspecified). A view that needs more gets storage of its
  // own. No-op when the shape is unchanged.
  absl::Status Resize(GpuContext* ctx, const std::vector<int64_t>& shape);
  // Queued cudaMemsetAsync to zero.
  absl::Status Zero(GpuContext* ctx);
  // Copies `host` (same numel) in; the shape becomes the host tensor's.
  absl::Status CopyFromHost(GpuContext* ctx, const Tensor& host);
  // Copies out into `host`, resized to this shape; waits for the stream.
  absl::Status CopyToHost(GpuContext* ctx, Tensor* host) const;
  // A CPU copy (waits for the stream).
  absl::StatusOr<Tensor> ToHost(GpuContext* ctx) const;
  // Device-to-device copy of `src` (resized to its shape), queued.
  absl::Status CopyFrom(GpuContext* ctx, const GpuTensor& src);

 private:
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  DeviceBuffer buffer_;
  float* data_ = nullptr;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_TENSOR_H_
