#include "worker/engine/cuda/gpu_tensor.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckShape(const std::vector<int64_t>& shape) {
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension in shape [", absl::StrJoin(shape, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

GpuTensor::GpuTensor(GpuTensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      numel_(std::exchange(other.numel_, 0)),
      buffer_(std::move(other.buffer_)),
      data_(std::exchange(other.data_, nullptr)) {
  other.shape_.clear();
}

GpuTensor& GpuTensor::operator=(GpuTensor&& other) noexcept {
  if (this != &other) {
    shape_ = std::move(other.shape_);
    other.shape_.clear();
    numel_ = std::exchange(other.numel_, 0);
    buffer_ = std::move(other.buffer_);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

absl::StatusOr<GpuTensor> GpuTensor::Empty(GpuContext* ctx, std::vector<int64_t> shape) {
  GpuTensor t;
  AIDN_RETURN_IF_ERROR(t.Resize(ctx, shape));
  return t;
}

absl::StatusOr<GpuTensor> GpuTensor::FromHost(GpuContext* ctx, const Tensor& host) {
  GpuTensor t;
  AIDN_RETURN_IF_ERROR(t.CopyFromHost(ctx, host));
  return t;
}

GpuTensor GpuTensor::View(float* data, std::vector<int64_t> shape) {
  GpuTensor t;
  t.numel_ = NumElements(shape);
  t.shape_ = std::move(shape);
  t.data_ = data;
  return t;
}

std::string GpuTensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "]");
}

absl::Status GpuTensor::Resize(GpuContext* ctx, const std::vector<int64_t>& shape) {
  if (shape == shape_ && (data_ != nullptr || numel_ == 0)) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(CheckShape(shape));
  const int64_t n = NumElements(shape);
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  const bool fits = is_view() ? n <= numel_ : bytes <= buffer_.bytes();
  if (!fits) {
    // Release first: the allocator may hand the same block back.
    buffer_.Release();
    data_ = nullptr;
    AIDN_ASSIGN_OR_RETURN(buffer_, ctx->allocator().Allocate(bytes));
    data_ = static_cast<float*>(buffer_.data());
  }
  shape_ = shape;
  numel_ = n;
  return absl::OkStatus();
}

absl::Status GpuTensor::Zero(GpuContext* ctx) {
  if (numel_ == 0) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(data_, 0, sizeof(float) * static_cast<size_t>(numel_), ctx->stream()));
  return absl::OkStatus();
}

absl::Status GpuTensor::CopyFromHost(GpuContext* ctx, const Tensor& host) {
  if (host.device() != Device::kCpu) {
    return absl::InvalidArgumentError("CopyFromHost needs a CPU tensor");
  }
  AIDN_RETURN_IF_ERROR(Resize(ctx, host.shape()));
  if (numel_ == 0) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(data_, host.data(),
                                            sizeof(float) * static_cast<size_t>(numel_),
                                            cudaMemcpyHostToDevice, ctx->stream()));
  return absl::OkStatus();
}

absl::Status GpuTensor::CopyToHost(GpuContext* ctx, Tensor* host) const {
  if (host->shape() != shape_) host->Resize(shape_);
  if (numel_ == 0) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host->data(), data_,
                                            sizeof(float) * static_cast<size_t>(numel_),
                                            cudaMemcpyDeviceToHost, ctx->stream()));
  // The host reads `host` as soon as we return.
  return ctx->Synchronize();
}

absl::StatusOr<Tensor> GpuTensor::ToHost(GpuContext* ctx) const {
  Tensor host(shape_);
  AIDN_RETURN_IF_ERROR(CopyToHost(ctx, &host));
  return host;
}

absl::Status GpuTensor::CopyFrom(GpuContext* ctx, const GpuTensor& src) {
  AIDN_RETURN_IF_ERROR(Resize(ctx, src.shape()));
  if (numel_ == 0 || data_ == src.data_) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(data_, src.data_,
                                            sizeof(float) * static_cast<size_t>(numel_),
                                            cudaMemcpyDeviceToDevice, ctx->stream()));
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
