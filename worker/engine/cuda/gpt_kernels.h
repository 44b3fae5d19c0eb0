#ifndef AIDN_WORKER_ENGINE_CUDA_GPT_KERNELS_H_
#define AIDN_WORKER_ENGINE_CUDA_GPT_KERNELS_H_

// The GPT decoder's own GPU kernels (gpu_gpt.h), the CPU decoder's
// (worker/engine/gpt.cc, gpt_kernels.cc) operation for operation: token and
// position embeddings and their gradients, LayerNorm and its backward, the
// tanh GELU, the causal softmax of attention scores (and its recomputation
// and backward). Host functions queue them on
// `stream` and return the launch status; all pointers are device pointers;
// a count of zero queues nothing.
//
// As kernels.h: float arithmetic spelled with round-to-nearest intrinsics
// in the CPU's order (the target builds with --fmad=false), sums in double
// where the CPU sums in double, and every reduction in a fixed order (no
// atomics), so two runs give the same bits.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace aidn::engine::cuda {

// x[i, :] = wte[tokens[i], :] + wpe[i % seq_len, :] for i < n; x is [n, c].
absl::Status LaunchEmbedding(cudaStream_t stream, const int32_t* tokens, const float* wte,
                             const float* wpe, float* x, int64_t n, int64_t seq_len, int64_t c);

// dwpe[t, :] += g[b * seq_len + t, :] for b = 0, 1, ... in that order.
absl::Status LaunchPositionGrad(cudaStream_t stream, const float* g, float* dwpe, int64_t batch,
                                int64_t seq_len, int64_t c);

// The token embedding's gradient from the positions grouped by token (built
// on the host, where the tokens come from): for u < unique,
// dwte[tokens[u], :] += g[positions[k], :] for k in [offsets[u],
// offsets[u + 1]) in that (ascending) order: as the CPU's loop over
// positions adds them, without atomics.
absl::Status LaunchTokenGrad(cudaStream_t stream, const float* g, float* dwte,
                             const int32_t* tokens, const int32_t* offsets,
                             const int32_t* positions, int64_t unique, int64_t c);

// LayerNorm over rows of `cols` (gpt_kernels::LayerNormForward): statistics
// summed in double, out = (x - mean) * rstd * w + b (b may be null); keeps
// mean and rstd per row.
absl::Status LaunchLayerNorm(cudaStream_t stream, const float* x, const float* w, const float* b,
                             int64_t rows, int64_t cols, float* out, float* mean, float* rstd);

// LayerNorm's backward (gpt_kernels::LayerNormBackward) for the input: dx
// += its gradient. The weight's gradient is the column sums of
// `dout * normalised x`, which this writes into `gn` ([rows, cols]) for a
// deterministic column reduction (LaunchBiasGrad) by the caller, as the
// bias's is the column sums of dout.
absl::Status LaunchLayerNormBackward(cudaStream_t stream, const float* dout, const float* x,
                                     const float* w, const float* mean, const float* rstd,
                                     int64_t rows, int64_t cols, float* dx, float* gn);

// GELU, tanh approximation: y = gelu(x) (x may equal y).
absl::Status LaunchGelu(cudaStream_t stream, const float* x, float* y, int64_t n);
// g *= gelu'(x), in place.
absl::Status LaunchGeluBackward(cudaStream_t stream, const float* x, float* g, int64_t n);

// The causal softmax of `rows` score rows of one (sequence, head) block of
// [t_len, t_len] each: row r is position r % t_len and keeps columns
// 0..t, the rest set to 0. In place; keeps each row's maximum and 1/sum
// (row_max, row_inv: `rows` floats each) so that backward can recompute the
// probabilities from the scores bit for bit.
absl::Status LaunchCausalSoftmax(cudaStream_t stream, float* s, int64_t rows, int64_t t_len,
                                 float* row_max, float* row_inv);
// The same probabilities again from the same scores and the kept
// statistics.
absl::Status LaunchCausalSoftmaxRecompute(cudaStream_t stream, float* s, int64_t rows,
                                          int64_t t_len, const float* row_max,
                                          const float* row_inv);
// Through the softmax: d = p * (d - sum_j p_j d_j) on columns 0..t of each
// row, 0 above; in place on d.
absl::Status LaunchCausalSoftmaxBackward(cudaStream_t stream, const float* p, float* d,
                                         int64_t rows, int64_t t_len);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPT_KERNELS_H_
