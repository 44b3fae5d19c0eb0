#ifndef AIDN_WORKER_ENGINE_CUDA_KERNEL_UTIL_CUH_
#define AIDN_WORKER_ENGINE_CUDA_KERNEL_UTIL_CUH_

// What the engine's kernel files share (kernels.cu, gpt_kernels.cu,
// ddp_kernels.cu): the launch shape of elementwise kernels (256-thread
// blocks over a grid-stride loop with 64-bit indices, the grid capped so
// that a huge tensor loops instead of overflowing gridDim) and the
// deterministic warp and block sums (fixed shuffle trees, no atomics).
// Included by .cu files only.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace aidn::engine::cuda::kernel {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;
constexpr unsigned kFullMask = 0xffffffffu;

inline unsigned BlocksFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

__device__ __forceinline__ int64_t GlobalIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The warp's sum, valid in lane 0.
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
  return v;
}

// The sum over the block (blockDim.x a multiple of 32, at most 1024), valid
// in thread 0. Call at most once per kernel (it reuses its shared memory).
template <typename T>
__device__ T BlockSum(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  v = threadIdx.x < warps ? partial[threadIdx.x] : T(0);
  if (warp == 0) v = WarpSum(v);
  return v;
}

// The sum over the block in every thread; every thread of the block must
// call it, and may call it again and again (it synchronises before
// returning, so its shared memory is free for the next call).
template <typename T>
__device__ T BlockSumToAll(T v) {
  __shared__ T partial[32];
  __shared__ T total;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : T(0);
    v = WarpSum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  const T result = total;
  __syncthreads();
  return result;
}

}  // namespace aidn::engine::cuda::kernel

#endif  // AIDN_WORKER_ENGINE_CUDA_KERNEL_UTIL_CUH_
