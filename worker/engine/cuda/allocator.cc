#include "worker/engine/cuda/allocator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Release() {
  if (data_ != nullptr && owner_ != nullptr) owner_->Return(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

size_t CachingAllocator::RoundSize(size_t bytes) {
  constexpr size_t kSmall = 512;
  constexpr size_t kLarge = size_t{2} << 20;
  if (bytes <= (size_t{1} << 20)) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

absl::StatusOr<DeviceBuffer> CachingAllocator::Allocate(size_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  const size_t size = RoundSize(bytes);
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= size;
    ++stats_.cache_hits;
  } else {
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation && stats_.bytes_cached > 0) {
      cudaGetLastError();  // an OOM is not sticky; clear it before retrying
      EmptyCache();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaError(
          absl::StrCat("cudaMalloc(", size, " bytes) with ", stats_.bytes_in_use, " bytes in use"),
          err);
    }
    blocks_.emplace(p, size);
    ++stats_.cuda_mallocs;
  }
  stats_.bytes_in_use += size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return DeviceBuffer(this, p, size);
}

void CachingAllocator::Return(void* data, size_t bytes) {
  AIDN_CHECK(blocks_.count(data) == 1) << "DeviceBuffer returned to the wrong allocator";
  free_[bytes].push_back(data);
  stats_.bytes_in_use -= bytes;
  stats_.bytes_cached += bytes;
}

void CachingAllocator::EmptyCache() {
  // cudaFree waits for the device to finish the work queued on it, so a
  // block still read by a queued kernel is not freed under it.
  for (auto& [size, list] : free_) {
    for (void* p : list) {
      cudaFree(p);
      blocks_.erase(p);
    }
  }
  free_.clear();
  stats_.bytes_cached = 0;
}

CachingAllocator::~CachingAllocator() {
  if (stats_.bytes_in_use > 0) {
    AIDN_LOG(WARNING) << "CachingAllocator destroyed with " << stats_.bytes_in_use
                      << " bytes still in use";
  }
  for (const auto& [p, size] : blocks_) cudaFree(p);
}

}  // namespace aidn::engine::cuda
