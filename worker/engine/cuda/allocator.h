#ifndef AIDN_WORKER_ENGINE_CUDA_ALLOCATOR_H_
#define AIDN_WORKER_ENGINE_CUDA_ALLOCATOR_H_

// Device memory for one trainer: a caching allocator over plain cudaMalloc
// (no managed memory), and DeviceBuffer, the owning handle it hands out.
//
// Blocks are rounded up (to 512 bytes, then to 2 MiB above 1 MiB) and kept
// in per-size free lists when released, so a training loop at a fixed batch
// size calls cudaMalloc only during its first step. A cudaMalloc that runs
// out of memory releases every cached block (cudaFree) and tries once more.
// Everything, cached or not, is freed when the allocator is destroyed, so
// every DeviceBuffer must be gone by then.
//
// Stream contract: a block released here may be handed out again at once,
// before kernels still queued on the GPU have finished with it. That is safe
// because every user of one allocator works on one stream (the GpuContext's
// compute stream), whose order puts the next user's kernels after the
// previous user's. Work on another stream must not share this allocator.
//
// Not thread-safe (one per trainer, used from its thread).

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"

namespace aidn::engine::cuda {

class CachingAllocator;

// An owning handle to a device block; releases it to its allocator when
// destroyed. Move-only. An empty buffer has data() == nullptr.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Release(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  // The usable size: at least what was asked for.
  size_t bytes() const { return bytes_; }
  void Release();

 private:
  friend class CachingAllocator;
  DeviceBuffer(CachingAllocator* owner, void* data, size_t bytes)
      : owner_(owner), data_(data), bytes_(bytes) {}
  CachingAllocator* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class CachingAllocator {
 public:
  struct Stats {
    int64_t cuda_mallocs = 0;  // calls to cudaMalloc that succeeded
    int64_t cache_hits = 0;    // allocations served from the free lists
    size_t bytes_in_use = 0;   // handed out and not yet released
    size_t bytes_cached = 0;   // in the free lists
    size_t peak_bytes_in_use = 0;
  };

  // Allocates on the current CUDA device (the GpuContext sets it).
  CachingAllocator() = default;
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // `bytes` == 0 gives an empty buffer. RESOURCE_EXHAUSTED when the device
  // has no room even after the cache was emptied.
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  // cudaFree of every cached (free) block.
  void EmptyCache();
  const Stats& stats() const { return stats_; }

  // The size a request is rounded up to.
  static size_t RoundSize(size_t bytes);

 private:
  friend class DeviceBuffer;
  void Return(void* data, size_t bytes);

  // Rounded size -> free blocks of exactly that size.
  std::map<size_t, std::vector<void*>> free_;
  // Every block cudaMalloc gave us, with its size (for the destructor).
  std::map<void*, size_t> blocks_;
  Stats stats_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_ALLOCATOR_H_
