#ifndef AIDN_WORKER_ENGINE_CUDA_DROPOUT_MASK_H_
#define AIDN_WORKER_ENGINE_CUDA_DROPOUT_MASK_H_

// The GPU dropout mask as a pure function of (seed, draw, element index), so
// that it needs no state on the device, Backward recomputes it instead of
// storing it, and a test can compute the very same mask on the host.
//
// It is NOT the CPU Dropout's mask: that one comes from a sequential
// std::mt19937_64 stream, which a GPU cannot reproduce in parallel without
// generating it on the host. Both keep each element independently with
// probability 1-p (to within 2^-32) and scale kept elements by 1/(1-p), so
// training with either has the same distribution; a GPU run with dropout
// does not reproduce a CPU run's numbers.
//
// Usable from host and device code.

#include <cstdint>

#if defined(__CUDACC__)
#define AIDN_HOST_DEVICE __host__ __device__
#else
#define AIDN_HOST_DEVICE
#endif

namespace aidn::engine::cuda {

// splitmix64's finaliser: a bijection on 64 bits with full avalanche.
AIDN_HOST_DEVICE inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The key of a layer's `draw`-th training forward (draws count from 0 after
// each SetSeed).
AIDN_HOST_DEVICE inline uint64_t DropoutKey(uint64_t seed, uint64_t draw) {
  return Mix64(seed + 0x9e3779b97f4a7c15ULL * (draw + 1));
}

// The keep threshold on 32 random bits: keep when bits < threshold, i.e.
// with probability (1-p) (as the CPU layer computes it).
inline uint64_t DropoutThreshold(double p) {
  return static_cast<uint64_t>((1.0 - p) * 4294967296.0);
}

// Whether element `index` is kept under `key`.
AIDN_HOST_DEVICE inline bool DropoutKeep(uint64_t key, uint64_t index, uint64_t threshold) {
  const uint64_t bits = Mix64(key ^ (0xd1b54a32d192ed03ULL * (index + 1))) >> 32;
  return bits < threshold;
}

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_DROPOUT_MASK_H_
