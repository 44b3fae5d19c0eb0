#ifndef AIDN_WORKER_ENGINE_GPT_KERNELS_H_
#define AIDN_WORKER_ENGINE_GPT_KERNELS_H_

// The GPT decoder's CPU kernels (gpt.h), on [rows, cols] row-major arrays:
// LayerNorm, Hugging Face's Conv1D linear layer ([in, out] weights), the
// tanh GELU, and the N(0, std) fill of its initialisation. Pure;
// thread-compatible.

#include <cstdint>

namespace aidn::engine::gpt_kernels {

inline constexpr float kLayerNormEps = 1e-5f;

// out = (x - mean) * rstd * w + b per row (b may be null); keeps mean and
// rstd per row. Sums in double: the statistics of a 768-wide row in float
// would drift from torch's by more than the test tolerance allows.
void LayerNormForward(const float* x, const float* w, const float* b, int64_t rows, int64_t cols,
                      float* out, float* mean, float* rstd);
// dx += the input gradient; dw, db (db may be null) += the parameters'.
void LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                       const float* rstd, int64_t rows, int64_t cols, float* dx, float* dw,
                       float* db);
// y = x W + b with x [rows, in], W [in, out] (Hugging Face's Conv1D), b
// [out] or null.
void LinearForward(const float* x, const float* w, const float* b, int64_t rows, int64_t in,
                   int64_t out, float* y);
// dx = dy W^T (overwrites; dx may be null), dW += x^T dy, db += the column
// sums of dy (db may be null).
void LinearBackward(const float* dy, const float* x, const float* w, int64_t rows, int64_t in,
                    int64_t out, float* dx, float* dw, float* db);
// GELU, tanh approximation (F.gelu(x, approximate="tanh")).
void GeluForward(const float* x, float* y, int64_t n);
// g = g * gelu'(x), in place.
void GeluBackward(const float* x, float* g, int64_t n);
// N(0, std) from a 64-bit stream by Box-Muller in double: the same numbers
// on every platform and standard library.
void FillNormal(uint64_t seed, double std, float* x, int64_t n);

}  // namespace aidn::engine::gpt_kernels

#endif  // AIDN_WORKER_ENGINE_GPT_KERNELS_H_
