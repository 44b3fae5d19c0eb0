#include "worker/engine/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <utility>

#include "common/log.h"

namespace aidn::engine {
namespace {

constexpr std::align_val_t kAlignment{64};

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    AIDN_CHECK(d >= 0) << "negative tensor dimension " << d;
    n *= d;
  }
  return n;
}

}  // namespace

void Tensor::Free::operator()(float* p) const { ::operator delete(p, kAlignment); }

Tensor::Tensor(std::vector<int64_t> shape, Device device)
    : shape_(std::move(shape)), numel_(NumElements(shape_)), device_(device) {
  AIDN_CHECK(device_ == Device::kCpu) << "only CPU tensors are implemented";
  if (numel_ > 0) {
    // Rounded up to whole cache lines so vector loops may touch the tail.
    const size_t bytes = (static_cast<size_t>(numel_) * sizeof(float) + 63) & ~size_t{63};
    storage_.reset(static_cast<float*>(::operator new(bytes, kAlignment)));
    std::memset(storage_.get(), 0, bytes);
    capacity_ = numel_;
    data_ = storage_.get();
  }
}

// Not defaulted: the source must drop its view of the storage it handed
// over, or a later Resize on it would write into the new owner's buffer.
Tensor::Tensor(Tensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      numel_(std::exchange(other.numel_, 0)),
      capacity_(std::exchange(other.capacity_, 0)),
      device_(other.device_),
      storage_(std::move(other.storage_)),
      data_(std::exchange(other.data_, nullptr)) {
  other.shape_.clear();
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    shape_ = std::move(other.shape_);
    other.shape_.clear();
    numel_ = std::exchange(other.numel_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    device_ = other.device_;
    storage_ = std::move(other.storage_);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

Tensor Tensor::Clone() const {
  Tensor copy(shape_, device_);
  if (numel_ > 0) std::memcpy(copy.data_, data_, static_cast<size_t>(numel_) * sizeof(float));
  return copy;
}

Tensor Tensor::View(float* data, std::vector<int64_t> shape) {
  Tensor view;
  view.numel_ = NumElements(shape);
  view.shape_ = std::move(shape);
  view.capacity_ = view.numel_;
  view.data_ = view.numel_ > 0 ? data : nullptr;
  return view;
}

void Tensor::Resize(std::vector<int64_t> shape) {
  const int64_t n = NumElements(shape);
  if (n <= capacity_) {
    shape_.assign(shape.begin(), shape.end());  // keeps shape_'s own buffer
    numel_ = n;
    return;
  }
  *this = Tensor(std::move(shape), device_);
}

void Tensor::Fill(float value) {
  if (numel_ == 0) return;
  AIDN_CHECK(data_ != nullptr) << "Fill of a tensor " << ShapeString()
                               << " without storage (a sharded parameter outside its unit?)";
  if (value == 0.0f && !std::signbit(value)) {
    // ZeroGrad's path: memset is several times faster than a scalar loop.
    std::memset(data_, 0, static_cast<size_t>(numel_) * sizeof(float));
    return;
  }
  std::fill(data_, data_ + numel_, value);
}

std::string Tensor::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape_[i]);
  }
  s += "]";
  return s;
}

}  // namespace aidn::engine
