#ifndef AIDN_WORKER_ENGINE_CUDA_FLASH_ATTENTION_H_
#define AIDN_WORKER_ENGINE_CUDA_FLASH_ATTENTION_H_

// Exact causal attention without the [T, T] matrices in memory (FlashAttention-2's
// scheme), for the GPT decoder in bf16 (gpu_gpt.h): Q, K and V are
// rounded to bf16 as they are loaded, products run on the tensor cores
// (WMMA 16x16x16, fp32 accumulation), the softmax is computed online in fp32
// per 64 x 64 tile, and forward keeps one log-sum-exp per row.
//
// Layouts are the decoder's: qkv [B * T, 3C] fp32 with head h's q, k and v
// at columns h * hd, C + h * hd and 2C + h * hd; y and dy [B * T, C] with
// head h at column h * hd; lse and the backward's `delta` scratch [B, H, T].
//
// Backward is deterministic (no atomics): one kernel per key tile sums dK
// and dV over the query tiles at and after it, another per query tile sums
// dQ over the key tiles up to it; each computes the scores again from Q and
// K and the probabilities from the kept log-sum-exp.
//
// No dropout. Head sizes 32, 64, 96 and 128 (FlashAttentionSupports).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace aidn::engine::cuda {

bool FlashAttentionSupports(int64_t head_dim);
// Whether the kernels' shared memory for `head_dim` (99 KB at 64, up to
// 191 KB at 128) fits `device`'s opt-in limit per block (227 KB on Hopper,
// 163 KB on an A100, 99 KB on sm_86/89). False for an unsupported head
// size or when the limit cannot be read.
bool FlashAttentionFits(int64_t head_dim, int device);

// y and lse from qkv. `scale` multiplies the scores (1 / sqrt(hd)).
absl::Status LaunchFlashAttentionForward(cudaStream_t stream, const float* qkv, int64_t batch,
                                         int64_t t_len, int64_t heads, int64_t head_dim,
                                         float scale, float* y, float* lse);

// dqkv (written, all three parts) from dy, with the forward's qkv, y and
// lse; `delta` is scratch of batch * heads * t_len floats.
absl::Status LaunchFlashAttentionBackward(cudaStream_t stream, const float* qkv, const float* y,
                                          const float* dy, const float* lse, int64_t batch,
                                          int64_t t_len, int64_t heads, int64_t head_dim,
                                          float scale, float* dqkv, float* delta);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_FLASH_ATTENTION_H_
