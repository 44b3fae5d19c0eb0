// The GPT decoder's own kernels. Layout and habits as kernels.cu:
// elementwise kernels over grid-stride loops of 256-thread blocks; row
// kernels with one warp per row (butterfly shuffles leave every lane with
// the row's sum, so each lane can go on with it); no atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/engine/cuda/gpt_kernels.h"
#include "worker/engine/cuda/kernel_util.cuh"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

using kernel::BlocksFor;
using kernel::GlobalIndex;
using kernel::GridStride;
using kernel::kFullMask;
using kernel::kThreads;

constexpr int kRowsPerBlock = kThreads / 32;
// gpt_kernels.cc's.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;
constexpr float kLayerNormEps = 1e-5f;

unsigned RowBlocksFor(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// The warp's row, or -1 past the end (the whole warp retires together).
__device__ __forceinline__ int64_t WarpRow(int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  return row < rows ? row : -1;
}

template <typename T>
__device__ __forceinline__ T AllSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float AllMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__global__ void EmbeddingKernel(const int32_t* tokens, const float* wte, const float* wpe, float* x,
                                int64_t n, int64_t seq_len, int64_t c) {
  for (int64_t i = GlobalIndex(); i < n * c; i += GridStride()) {
    const int64_t row = i / c;
    const int64_t j = i - row * c;
    const int64_t tok = tokens[row];
    x[i] = __fadd_rn(wte[tok * c + j], wpe[(row % seq_len) * c + j]);
  }
}

__global__ void PositionGradKernel(const float* g, float* dwpe, int64_t batch, int64_t seq_len,
                                   int64_t c) {
  for (int64_t i = GlobalIndex(); i < seq_len * c; i += GridStride()) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < batch; ++b) acc = __fadd_rn(acc, g[b * seq_len * c + i]);
    dwpe[i] = acc;
  }
}

// One block per distinct token.
__global__ void TokenGradKernel(const float* g, float* dwte, const int32_t* tokens,
                                const int32_t* offsets, const int32_t* positions, int64_t c) {
  const int64_t u = blockIdx.x;
  float* row = dwte + static_cast<int64_t>(tokens[u]) * c;
  const int32_t begin = offsets[u];
  const int32_t end = offsets[u + 1];
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    float acc = row[j];
    for (int32_t k = begin; k < end; ++k) {
      acc = __fadd_rn(acc, g[static_cast<int64_t>(positions[k]) * c + j]);
    }
    row[j] = acc;
  }
}

__global__ void LayerNormKernel(const float* x, const float* w, const float* b, int64_t rows,
                                int64_t cols, float* out, float* mean, float* rstd) {
  const int64_t row = WarpRow(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const float* xr = x + row * cols;
  double sum = 0.0;
  for (int64_t j = lane; j < cols; j += 32) sum += xr[j];
  sum = AllSum(sum);
  const float m = static_cast<float>(sum / static_cast<double>(cols));
  double var = 0.0;
  for (int64_t j = lane; j < cols; j += 32) {
    const double d = static_cast<double>(xr[j]) - m;
    var = __dadd_rn(var, __dmul_rn(d, d));
  }
  var = AllSum(var);
  const float s = static_cast<float>(
      1.0 / sqrt(var / static_cast<double>(cols) + static_cast<double>(kLayerNormEps)));
  float* o = out + row * cols;
  for (int64_t j = lane; j < cols; j += 32) {
    const float n = __fmul_rn(__fsub_rn(xr[j], m), s);
    const float nw = __fmul_rn(n, w[j]);
    o[j] = b != nullptr ? __fadd_rn(nw, b[j]) : nw;
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

__global__ void LayerNormBackwardKernel(const float* dout, const float* x, const float* w,
                                        const float* mean, const float* rstd, int64_t rows,
                                        int64_t cols, float* dx, float* gn) {
  const int64_t row = WarpRow(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const float* g = dout + row * cols;
  const float* xr = x + row * cols;
  const float m = mean[row];
  const float s = rstd[row];
  double dn_sum = 0.0;
  double dnn_sum = 0.0;
  for (int64_t j = lane; j < cols; j += 32) {
    const float n = __fmul_rn(__fsub_rn(xr[j], m), s);
    const float dn = __fmul_rn(g[j], w[j]);
    dn_sum += dn;
    dnn_sum = __dadd_rn(dnn_sum, __dmul_rn(static_cast<double>(dn), n));
  }
  dn_sum = AllSum(dn_sum);
  dnn_sum = AllSum(dnn_sum);
  const float a = static_cast<float>(dn_sum / static_cast<double>(cols));
  const float bb = static_cast<float>(dnn_sum / static_cast<double>(cols));
  float* d = dx + row * cols;
  float* gr = gn + row * cols;
  for (int64_t j = lane; j < cols; j += 32) {
    const float n = __fmul_rn(__fsub_rn(xr[j], m), s);
    const float dn = __fmul_rn(g[j], w[j]);
    d[j] = __fadd_rn(d[j], __fmul_rn(__fsub_rn(__fsub_rn(dn, a), __fmul_rn(n, bb)), s));
    gr[j] = __fmul_rn(g[j], n);
  }
}

__device__ __forceinline__ float GeluTanh(float v) {
  const float cube = __fmul_rn(__fmul_rn(__fmul_rn(kGeluCube, v), v), v);
  return tanhf(__fmul_rn(kGeluScale, __fadd_rn(v, cube)));
}

__global__ void GeluKernel(const float* x, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = x[i];
    const float t = GeluTanh(v);
    y[i] = __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.0f, t));
  }
}

__global__ void GeluBackwardKernel(const float* x, float* g, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = x[i];
    const float t = GeluTanh(v);
    const float inner = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(__fmul_rn(3.0f, kGeluCube), v), v));
    const float dt = __fmul_rn(__fmul_rn(__fsub_rn(1.0f, __fmul_rn(t, t)), kGeluScale), inner);
    const float grad =
        __fadd_rn(__fmul_rn(0.5f, __fadd_rn(1.0f, t)), __fmul_rn(__fmul_rn(0.5f, v), dt));
    g[i] = __fmul_rn(g[i], grad);
  }
}

__global__ void CausalSoftmaxKernel(float* s, int64_t rows, int64_t t_len, float* row_max,
                                    float* row_inv) {
  const int64_t row = WarpRow(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = row % t_len;
  float* r = s + row * t_len;
  float max = -INFINITY;
  for (int64_t j = lane; j <= t; j += 32) max = fmaxf(max, r[j]);
  max = AllMax(max);
  float sum = 0.0f;
  for (int64_t j = lane; j <= t; j += 32) {
    const float e = expf(__fsub_rn(r[j], max));
    r[j] = e;
    sum = __fadd_rn(sum, e);
  }
  sum = AllSum(sum);
  const float inv = __fdiv_rn(1.0f, sum);
  for (int64_t j = lane; j < t_len; j += 32) r[j] = j <= t ? __fmul_rn(r[j], inv) : 0.0f;
  if (lane == 0) {
    row_max[row] = max;
    row_inv[row] = inv;
  }
}

__global__ void CausalSoftmaxRecomputeKernel(float* s, int64_t rows, int64_t t_len,
                                             const float* row_max, const float* row_inv) {
  const int64_t row = WarpRow(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = row % t_len;
  const float max = row_max[row];
  const float inv = row_inv[row];
  float* r = s + row * t_len;
  for (int64_t j = lane; j < t_len; j += 32) {
    r[j] = j <= t ? __fmul_rn(expf(__fsub_rn(r[j], max)), inv) : 0.0f;
  }
}

__global__ void CausalSoftmaxBackwardKernel(const float* p, float* d, int64_t rows, int64_t t_len) {
  const int64_t row = WarpRow(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = row % t_len;
  const float* pr = p + row * t_len;
  float* dr = d + row * t_len;
  float dot = 0.0f;
  for (int64_t j = lane; j <= t; j += 32) dot = __fadd_rn(dot, __fmul_rn(pr[j], dr[j]));
  dot = AllSum(dot);
  for (int64_t j = lane; j < t_len; j += 32) {
    dr[j] = j <= t ? __fmul_rn(pr[j], __fsub_rn(dr[j], dot)) : 0.0f;
  }
}

}  // namespace

absl::Status LaunchEmbedding(cudaStream_t stream, const int32_t* tokens, const float* wte,
                             const float* wpe, float* x, int64_t n, int64_t seq_len, int64_t c) {
  if (n * c == 0) return absl::OkStatus();
  EmbeddingKernel<<<BlocksFor(n * c), kThreads, 0, stream>>>(tokens, wte, wpe, x, n, seq_len, c);
  AIDN_RETURN_IF_LAUNCH_FAILED("EmbeddingKernel");
  return absl::OkStatus();
}

absl::Status LaunchPositionGrad(cudaStream_t stream, const float* g, float* dwpe, int64_t batch,
                                int64_t seq_len, int64_t c) {
  if (seq_len * c == 0) return absl::OkStatus();
  PositionGradKernel<<<BlocksFor(seq_len * c), kThreads, 0, stream>>>(g, dwpe, batch, seq_len, c);
  AIDN_RETURN_IF_LAUNCH_FAILED("PositionGradKernel");
  return absl::OkStatus();
}

absl::Status LaunchTokenGrad(cudaStream_t stream, const float* g, float* dwte,
                             const int32_t* tokens, const int32_t* offsets,
                             const int32_t* positions, int64_t unique, int64_t c) {
  if (unique == 0 || c == 0) return absl::OkStatus();
  const unsigned threads = static_cast<unsigned>(std::min<int64_t>(kThreads, (c + 31) / 32 * 32));
  TokenGradKernel<<<static_cast<unsigned>(unique), threads, 0, stream>>>(g, dwte, tokens, offsets,
                                                                         positions, c);
  AIDN_RETURN_IF_LAUNCH_FAILED("TokenGradKernel");
  return absl::OkStatus();
}

absl::Status LaunchLayerNorm(cudaStream_t stream, const float* x, const float* w, const float* b,
                             int64_t rows, int64_t cols, float* out, float* mean, float* rstd) {
  if (rows == 0) return absl::OkStatus();
  LayerNormKernel<<<RowBlocksFor(rows), kThreads, 0, stream>>>(x, w, b, rows, cols, out, mean,
                                                               rstd);
  AIDN_RETURN_IF_LAUNCH_FAILED("LayerNormKernel");
  return absl::OkStatus();
}

absl::Status LaunchLayerNormBackward(cudaStream_t stream, const float* dout, const float* x,
                                     const float* w, const float* mean, const float* rstd,
                                     int64_t rows, int64_t cols, float* dx, float* gn) {
  if (rows == 0) return absl::OkStatus();
  LayerNormBackwardKernel<<<RowBlocksFor(rows), kThreads, 0, stream>>>(dout, x, w, mean, rstd, rows,
                                                                       cols, dx, gn);
  AIDN_RETURN_IF_LAUNCH_FAILED("LayerNormBackwardKernel");
  return absl::OkStatus();
}

absl::Status LaunchGelu(cudaStream_t stream, const float* x, float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  GeluKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, y, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("GeluKernel");
  return absl::OkStatus();
}

absl::Status LaunchGeluBackward(cudaStream_t stream, const float* x, float* g, int64_t n) {
  if (n == 0) return absl::OkStatus();
  GeluBackwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, g, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("GeluBackwardKernel");
  return absl::OkStatus();
}

absl::Status LaunchCausalSoftmax(cudaStream_t stream, float* s, int64_t rows, int64_t t_len,
                                 float* row_max, float* row_inv) {
  if (rows == 0) return absl::OkStatus();
  CausalSoftmaxKernel<<<RowBlocksFor(rows), kThreads, 0, stream>>>(s, rows, t_len, row_max,
                                                                   row_inv);
  AIDN_RETURN_IF_LAUNCH_FAILED("CausalSoftmaxKernel");
  return absl::OkStatus();
}

absl::Status LaunchCausalSoftmaxRecompute(cudaStream_t stream, float* s, int64_t rows,
                                          int64_t t_len, const float* row_max,
                                          const float* row_inv) {
  if (rows == 0) return absl::OkStatus();
  CausalSoftmaxRecomputeKernel<<<RowBlocksFor(rows), kThreads, 0, stream>>>(s, rows, t_len, row_max,
                                                                            row_inv);
  AIDN_RETURN_IF_LAUNCH_FAILED("CausalSoftmaxRecomputeKernel");
  return absl::OkStatus();
}

absl::Status LaunchCausalSoftmaxBackward(cudaStream_t stream, const float* p, float* d,
                                         int64_t rows, int64_t t_len) {
  if (rows == 0) return absl::OkStatus();
  CausalSoftmaxBackwardKernel<<<RowBlocksFor(rows), kThreads, 0, stream>>>(p, d, rows, t_len);
  AIDN_RETURN_IF_LAUNCH_FAILED("CausalSoftmaxBackwardKernel");
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
