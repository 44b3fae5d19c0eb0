// The GPU engine's own kernels: elementwise epilogues (bias, ReLU, dropout),
// the bias-gradient and loss reductions, and the fused optimizer updates.
//
// Design notes:
// - Elementwise kernels use 256-thread blocks over a grid-stride loop with
//   64-bit indices, the grid capped so huge tensors loop instead of
//   overflowing gridDim; every launcher returns before launching on n == 0
//   (a zero-sized grid is a launch error).
// - Reductions are deterministic: fixed partitions, fixed shuffle trees, no
//   atomics, so two runs of a step give the same bits.
// - Float arithmetic is spelled with __fadd_rn/__fmul_rn/__fdiv_rn/
//   __fsqrt_rn, which nvcc never contracts into FMAs, in the CPU engine's
//   operation order (optimizer.cc, loss.cc), so optimizer updates are
//   bit-identical to the CPU's given the same inputs. The target is also
//   built with --fmad=false as a second guard.
// - All kernels run on the caller's stream (the trainer's one compute
//   stream), so they need no synchronisation with each other.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/engine/cuda/dropout_mask.h"
#include "worker/engine/cuda/kernel_util.cuh"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

using kernel::BlocksFor;
using kernel::BlockSum;
using kernel::GlobalIndex;
using kernel::GridStride;
using kernel::kFullMask;
using kernel::kThreads;
using kernel::WarpSum;

// One warp per row: each lane's first largest over its columns, then the
// warp's, the lower column winning a tie, so the first largest of the row.
__global__ void CorrectRowsKernel(const float* logits, const int32_t* labels, int64_t rows,
                                  int64_t classes, int32_t* correct) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const float* x = logits + row * classes;
  float best = -INFINITY;
  int64_t at = classes;  // none yet
  for (int64_t j = lane; j < classes; j += 32) {
    if (at == classes || x[j] > best) {
      best = x[j];
      at = j;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_down_sync(kFullMask, best, offset);
    const int64_t other_at = __shfl_down_sync(kFullMask, at, offset);
    if (other_at < classes && (at == classes || other > best || (other == best && other_at < at))) {
      best = other;
      at = other_at;
    }
  }
  if (lane == 0) correct[row] = at == labels[row] ? 1 : 0;
}

// ------------------------------------------------------------ elementwise

// Index: uint32_t where n < 2^31 (the channel's division is then 32-bit,
// several times cheaper than 64-bit's), else int64_t.
template <typename Index>
__global__ void BiasActivationKernel(const float* x, const float* bias, float* y, Index n,
                                     Index channels, Index inner, bool relu) {
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = __fadd_rn(x[i], bias[(i / inner) % channels]);
    if (relu) v = v > 0.0f ? v : 0.0f;
    y[i] = v;
  }
}

__global__ void ToBf16Kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void ToFp16Kernel(const float* x, __half* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) y[i] = __float2half_rn(x[i]);
}

// Four values a thread: a 16-byte load and two 4-byte pairs stored, the same
// rounding as above (x 16-byte and y 4-byte aligned: LaunchToHalf checks).
__global__ void ToBf16x4Kernel(const float4* x, __nv_bfloat162* y, int64_t n4) {
  for (int64_t i = GlobalIndex(); i < n4; i += GridStride()) {
    const float4 v = x[i];
    y[2 * i] = __floats2bfloat162_rn(v.x, v.y);
    y[2 * i + 1] = __floats2bfloat162_rn(v.z, v.w);
  }
}

__global__ void ToFp16x4Kernel(const float4* x, __half2* y, int64_t n4) {
  for (int64_t i = GlobalIndex(); i < n4; i += GridStride()) {
    const float4 v = x[i];
    y[2 * i] = __floats2half2_rn(v.x, v.y);
    y[2 * i + 1] = __floats2half2_rn(v.z, v.w);
  }
}

template <bool kAccumulate>
__global__ void FromBf16Kernel(const __nv_bfloat16* x, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = __bfloat162float(x[i]);
    y[i] = kAccumulate ? __fadd_rn(y[i], v) : v;
  }
}

template <bool kAccumulate>
__global__ void FromFp16Kernel(const __half* x, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = __half2float(x[i]);
    y[i] = kAccumulate ? __fadd_rn(y[i], v) : v;
  }
}

__global__ void UnscaleAndCheckKernel(float* g, int64_t n, float inv_scale, int32_t* found) {
  bool bad = false;
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = __fmul_rn(g[i], inv_scale);
    bad |= !isfinite(v);
    g[i] = v;
  }
  // One write per warp that saw one; every writer writes the same 1.
  if (__any_sync(kFullMask, bad) && (threadIdx.x & 31) == 0) *found = 1;
}

__global__ void AddKernel(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) y[i] = __fadd_rn(a[i], b[i]);
}

__global__ void ScaledAddReluKernel(const float* a, float s, const float* b, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = __fadd_rn(__fmul_rn(a[i], s), b[i]);
    y[i] = v < 0.0f ? 0.0f : v;
  }
}

__global__ void ScaleKernel(float* x, int64_t n, float s) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) x[i] = __fmul_rn(x[i], s);
}

__global__ void ReluKernel(const float* x, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = x[i];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}

__global__ void ReluBackwardKernel(const float* mask, const float* g, float* dx, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    dx[i] = mask[i] > 0.0f ? g[i] : 0.0f;
  }
}

__global__ void DropoutKernel(const float* x, float* y, int64_t n, uint64_t key, uint64_t threshold,
                              float scale) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    y[i] = DropoutKeep(key, static_cast<uint64_t>(i), threshold) ? __fmul_rn(x[i], scale) : 0.0f;
  }
}

// ------------------------------------------------------------ reductions

// The bias gradient in two passes, each with a fixed summation order (the
// same bits every run), spread over enough blocks to fill the GPU:
//   1. partial sums over slices of the batch into partial[c][q][slice]
//      (q < inner for narrow rows, else 1),
//   2. one thread per channel adds its partials in order into dbias[c].
// Wide rows (inner >= 32: convolutions): block (c, slice) walks its
// channel's rows of the slice with consecutive threads on consecutive
// elements.
__global__ void BiasGradRowsKernel(const float* g, float* partial, int64_t batch, int64_t channels,
                                   int64_t inner, int64_t rows_per_slice) {
  const int64_t c = blockIdx.x;
  const int64_t slice = blockIdx.y;
  const int64_t b_end = min(batch, (slice + 1) * rows_per_slice);
  float s = 0.0f;
  for (int64_t b = slice * rows_per_slice; b < b_end; ++b) {
    const float* row = g + (b * channels + c) * inner;
    for (int64_t p = threadIdx.x; p < inner; p += blockDim.x) s = __fadd_rn(s, row[p]);
  }
  s = BlockSum(s);
  if (threadIdx.x == 0) partial[c * gridDim.y + slice] = s;
}

// Narrow rows (inner < 32: Linear's [batch, channels]): the gradient as a
// [batch, channels * inner] matrix; block (column tile, slice) of 32 x 8
// threads sums 32 columns over the slice's rows, a warp reading a row's 32
// consecutive columns at a time.
constexpr int kColumnTile = 32;
constexpr int kRowThreads = 8;
__global__ void BiasGradColumnsKernel(const float* g, float* partial, int64_t batch,
                                      int64_t columns, int64_t rows_per_slice) {
  __shared__ float sums[kRowThreads][kColumnTile + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t slice = blockIdx.y;
  const int64_t b_end = min(batch, (slice + 1) * rows_per_slice);
  float s = 0.0f;
  if (col < columns) {
    for (int64_t b = slice * rows_per_slice + threadIdx.y; b < b_end; b += kRowThreads) {
      s = __fadd_rn(s, g[b * columns + col]);
    }
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < columns) {
    for (int r = 1; r < kRowThreads; ++r) s = __fadd_rn(s, sums[r][threadIdx.x]);
    partial[col * gridDim.y + slice] = s;
  }
}

// dbias[c] += the `per_channel` partials of channel c, in order.
__global__ void BiasGradFinishKernel(const float* partial, float* dbias, int64_t channels,
                                     int64_t per_channel) {
  for (int64_t c = GlobalIndex(); c < channels; c += GridStride()) {
    float s = 0.0f;
    for (int64_t k = 0; k < per_channel; ++k) s = __fadd_rn(s, partial[c * per_channel + k]);
    dbias[c] = __fadd_rn(dbias[c], s);
  }
}

// One warp per row; blockDim.x / 32 rows per block. A warp's lanes all take
// the same row, so a row past the end retires the whole warp before any
// shuffle.
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const int32_t* labels, int64_t n,
                                          int64_t classes, float* grad, double scale,
                                          double* row_loss) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  const float* x = logits + row * classes;
  float max = -INFINITY;
  for (int64_t j = lane; j < classes; j += 32) max = fmaxf(max, x[j]);
  // Butterfly reductions leave every lane with the same value (addition is
  // commutative, so lanes i and i^o compute the same sums).
  for (int o = 16; o > 0; o >>= 1) max = fmaxf(max, __shfl_xor_sync(kFullMask, max, o));
  double sum = 0.0;
  for (int64_t j = lane; j < classes; j += 32)
    sum += exp(static_cast<double>(__fsub_rn(x[j], max)));
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  const int32_t label = labels[row];
  if (lane == 0) {
    row_loss[row] = log(sum) - static_cast<double>(__fsub_rn(x[label], max));
  }
  if (grad != nullptr) {
    const double inv = 1.0 / sum;
    float* g = grad + row * classes;
    for (int64_t j = lane; j < classes; j += 32) {
      const double softmax = exp(static_cast<double>(__fsub_rn(x[j], max))) * inv;
      g[j] = static_cast<float>((softmax - (j == label ? 1.0 : 0.0)) * scale);
    }
  }
}

// One warp per plane.
__global__ void PlaneMeanKernel(const float* x, int64_t planes, int64_t plane, float* y) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (p >= planes) return;
  double sum = 0.0;
  for (int64_t j = lane; j < plane; j += 32) sum += x[p * plane + j];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  if (lane == 0) y[p] = static_cast<float>(sum / static_cast<double>(plane));
}

__global__ void PlaneMeanBackwardKernel(const float* g, int64_t planes, int64_t plane, float scale,
                                        float* dx) {
  for (int64_t i = GlobalIndex(); i < planes * plane; i += GridStride()) {
    dx[i] = __fmul_rn(g[i / plane], scale);
  }
}

// One block.
__global__ void MeanKernel(const double* values, int64_t n, double* mean) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += values[i];
  s = BlockSum(s);
  if (threadIdx.x == 0) *mean = s / static_cast<double>(n);
}

// Block b sums elements b * blockDim.x + t, strided by the grid, into
// partial[b].
__global__ void SumOfSquaresKernel(const float* g, int64_t n, double* partial) {
  double s = 0.0;
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const double v = g[i];
    s += v * v;
  }
  s = BlockSum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: *out = the sum of partial[0..count).
__global__ void SumPartialsKernel(const double* partial, int count, double* out) {
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = BlockSum(s);
  if (threadIdx.x == 0) *out = s;
}

// One thread.
__global__ void SumDoublesKernel(const double* in, int count, double* total) {
  double s = 0.0;
  for (int k = 0; k < count; ++k) s += in[k];
  *total = s;
}

// One thread.
__global__ void ClipCoefficientKernel(const double* sum_sq, int count, double max_norm,
                                      double* norm, float* coef) {
  double total = 0.0;
  for (int k = 0; k < count; ++k) total += sum_sq[k];
  const double n = sqrt(total);
  *norm = n;
  float c = 1.0f;
  if (isfinite(n)) {
    const double q = max_norm / (n + 1e-6);
    if (q < 1.0) c = static_cast<float>(q);
  }
  *coef = c;
}

// ------------------------------------------------------------ optimizers

template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst>
__global__ void SgdKernel(float* p, const float* grad, float* buf, int64_t n, SgdArgs by_value,
                          const float* scale, const SgdArgs* in_memory) {
  const SgdArgs a = in_memory != nullptr ? *in_memory : by_value;
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    float g = grad[i];
    if (scale != nullptr) g = __fmul_rn(g, *scale);
    if constexpr (kDecay) g = __fadd_rn(g, __fmul_rn(a.weight_decay, p[i]));
    if constexpr (kMomentum) {
      float b;
      if constexpr (kFirst) {
        b = g;
      } else {
        b = __fadd_rn(__fmul_rn(buf[i], a.momentum), g);
      }
      buf[i] = b;
      if constexpr (kNesterov) {
        g = __fadd_rn(g, __fmul_rn(a.momentum, b));
      } else {
        g = b;
      }
    }
    p[i] = __fadd_rn(p[i], __fmul_rn(-a.lr, g));
  }
}

template <bool kDecay>
__global__ void AdamWKernel(float* p, const float* grad, float* m, float* v, int64_t n,
                            AdamWArgs by_value, const float* scale, const AdamWArgs* in_memory) {
  const AdamWArgs a = in_memory != nullptr ? *in_memory : by_value;
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) {
    float g = grad[i];
    if (scale != nullptr) g = __fmul_rn(g, *scale);
    float w = p[i];
    if constexpr (kDecay) w = __fmul_rn(w, a.decay);
    const float mi = __fadd_rn(__fmul_rn(m[i], a.beta1), __fmul_rn(a.one_m_b1, g));
    const float vi = __fadd_rn(__fmul_rn(v[i], a.beta2), __fmul_rn(__fmul_rn(a.one_m_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bc2_sqrt), a.eps);
    p[i] = __fadd_rn(w, __fdiv_rn(__fmul_rn(a.neg_step, mi), denom));
  }
}

template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst>
void QueueSgd(cudaStream_t stream, float* p, const float* grad, float* buf, int64_t n,
              const SgdArgs& a, const float* scale, const SgdArgs* in_memory) {
  SgdKernel<kDecay, kMomentum, kNesterov, kFirst>
      <<<BlocksFor(n), kThreads, 0, stream>>>(p, grad, buf, n, a, scale, in_memory);
}

template <bool kDecay>
void QueueSgdMomentum(cudaStream_t stream, float* p, const float* grad, float* buf, int64_t n,
                      const SgdArgs& a, const float* scale, const SgdArgs* in_memory) {
  if (a.nesterov) {
    if (a.first_step) {
      QueueSgd<kDecay, true, true, true>(stream, p, grad, buf, n, a, scale, in_memory);
    } else {
      QueueSgd<kDecay, true, true, false>(stream, p, grad, buf, n, a, scale, in_memory);
    }
  } else {
    if (a.first_step) {
      QueueSgd<kDecay, true, false, true>(stream, p, grad, buf, n, a, scale, in_memory);
    } else {
      QueueSgd<kDecay, true, false, false>(stream, p, grad, buf, n, a, scale, in_memory);
    }
  }
}

}  // namespace

absl::Status LaunchBiasActivation(cudaStream_t stream, const float* x, const float* bias, float* y,
                                  int64_t n, int64_t channels, int64_t inner, bool relu) {
  if (n == 0) return absl::OkStatus();
  if (channels <= 0 || inner <= 0) {
    return absl::InvalidArgumentError("bias activation needs positive channels and inner size");
  }
  if (n < (int64_t{1} << 31) && channels < (int64_t{1} << 31) && inner < (int64_t{1} << 31)) {
    // i + stride stays below 2^31 + 2^24: no wrap in 32 bits.
    BiasActivationKernel<uint32_t><<<BlocksFor(n), kThreads, 0, stream>>>(
        x, bias, y, static_cast<uint32_t>(n), static_cast<uint32_t>(channels),
        static_cast<uint32_t>(inner), relu);
  } else {
    BiasActivationKernel<int64_t>
        <<<BlocksFor(n), kThreads, 0, stream>>>(x, bias, y, n, channels, inner, relu);
  }
  AIDN_RETURN_IF_LAUNCH_FAILED("BiasActivationKernel");
  return absl::OkStatus();
}

absl::Status LaunchToHalf(cudaStream_t stream, const float* x, void* y, int64_t n, HalfType type) {
  if (n == 0) return absl::OkStatus();
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(y) % 4 == 0) {
    const auto* in = reinterpret_cast<const float4*>(x);
    if (type == HalfType::kBf16) {
      ToBf16x4Kernel<<<BlocksFor(n / 4), kThreads, 0, stream>>>(in, static_cast<__nv_bfloat162*>(y),
                                                                n / 4);
    } else {
      ToFp16x4Kernel<<<BlocksFor(n / 4), kThreads, 0, stream>>>(in, static_cast<__half2*>(y),
                                                                n / 4);
    }
  } else if (type == HalfType::kBf16) {
    ToBf16Kernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, static_cast<__nv_bfloat16*>(y), n);
  } else {
    ToFp16Kernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, static_cast<__half*>(y), n);
  }
  AIDN_RETURN_IF_LAUNCH_FAILED("ToHalfKernel");
  return absl::OkStatus();
}

absl::Status LaunchFromHalf(cudaStream_t stream, const void* x, float* y, int64_t n, HalfType type,
                            bool accumulate) {
  if (n == 0) return absl::OkStatus();
  const unsigned blocks = BlocksFor(n);
  if (type == HalfType::kBf16) {
    const auto* in = static_cast<const __nv_bfloat16*>(x);
    if (accumulate) {
      FromBf16Kernel<true><<<blocks, kThreads, 0, stream>>>(in, y, n);
    } else {
      FromBf16Kernel<false><<<blocks, kThreads, 0, stream>>>(in, y, n);
    }
  } else {
    const auto* in = static_cast<const __half*>(x);
    if (accumulate) {
      FromFp16Kernel<true><<<blocks, kThreads, 0, stream>>>(in, y, n);
    } else {
      FromFp16Kernel<false><<<blocks, kThreads, 0, stream>>>(in, y, n);
    }
  }
  AIDN_RETURN_IF_LAUNCH_FAILED("FromHalfKernel");
  return absl::OkStatus();
}

absl::Status LaunchUnscaleAndCheck(cudaStream_t stream, float* g, int64_t n, float inv_scale,
                                   int32_t* found) {
  if (n == 0) return absl::OkStatus();
  UnscaleAndCheckKernel<<<BlocksFor(n), kThreads, 0, stream>>>(g, n, inv_scale, found);
  AIDN_RETURN_IF_LAUNCH_FAILED("UnscaleAndCheckKernel");
  return absl::OkStatus();
}

absl::Status LaunchAdd(cudaStream_t stream, const float* a, const float* b, float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, b, y, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("AddKernel");
  return absl::OkStatus();
}

absl::Status LaunchCorrectRows(cudaStream_t stream, const float* logits, const int32_t* labels,
                               int64_t rows, int64_t classes, int32_t* correct) {
  if (rows == 0) return absl::OkStatus();
  constexpr int64_t kRowsPerBlock = kThreads / 32;
  CorrectRowsKernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads,
                      0, stream>>>(logits, labels, rows, classes, correct);
  AIDN_RETURN_IF_LAUNCH_FAILED("CorrectRowsKernel");
  return absl::OkStatus();
}

absl::Status LaunchScaledAddRelu(cudaStream_t stream, const float* a, float s, const float* b,
                                 float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  ScaledAddReluKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, s, b, y, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("ScaledAddReluKernel");
  return absl::OkStatus();
}

absl::Status LaunchScale(cudaStream_t stream, float* x, int64_t n, float s) {
  if (n == 0) return absl::OkStatus();
  ScaleKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, n, s);
  AIDN_RETURN_IF_LAUNCH_FAILED("ScaleKernel");
  return absl::OkStatus();
}

absl::Status LaunchRelu(cudaStream_t stream, const float* x, float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  ReluKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, y, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("ReluKernel");
  return absl::OkStatus();
}

absl::Status LaunchReluBackward(cudaStream_t stream, const float* mask, const float* g, float* dx,
                                int64_t n) {
  if (n == 0) return absl::OkStatus();
  ReluBackwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(mask, g, dx, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("ReluBackwardKernel");
  return absl::OkStatus();
}

namespace {

// About four blocks per SM of a large GPU: enough to fill it, few enough
// that the partials stay small.
constexpr int64_t kBiasGradBlocks = 528;

struct BiasGradPlan {
  bool columns;      // BiasGradColumnsKernel (else BiasGradRowsKernel)
  int64_t blocks_x;  // channels, or column tiles
  int64_t slices;    // of the batch
  int64_t rows_per_slice;
  int64_t per_channel;  // partials per channel
};

BiasGradPlan PlanBiasGrad(int64_t batch, int64_t channels, int64_t inner) {
  BiasGradPlan plan;
  plan.columns = inner < kColumnTile;
  plan.blocks_x = plan.columns ? (channels * inner + kColumnTile - 1) / kColumnTile : channels;
  const int64_t max_slices =
      plan.columns ? (batch + kRowThreads - 1) / kRowThreads : std::max<int64_t>(batch, 1);
  plan.slices = std::clamp<int64_t>((kBiasGradBlocks + plan.blocks_x - 1) / plan.blocks_x, 1,
                                    std::max<int64_t>(max_slices, 1));
  plan.rows_per_slice = std::max<int64_t>((batch + plan.slices - 1) / plan.slices, 1);
  plan.per_channel = plan.slices * (plan.columns ? inner : 1);
  return plan;
}

}  // namespace

int64_t BiasGradScratchFloats(int64_t batch, int64_t channels, int64_t inner) {
  if (channels <= 0 || inner <= 0 || batch < 0) return 0;
  return channels * PlanBiasGrad(batch, channels, inner).per_channel;
}

absl::Status LaunchBiasGrad(cudaStream_t stream, const float* g, float* dbias, int64_t batch,
                            int64_t channels, int64_t inner, float* scratch,
                            int64_t scratch_floats) {
  if (channels == 0) return absl::OkStatus();
  if (channels < 0 || channels > INT32_MAX || inner <= 0 || batch < 0) {
    return absl::InvalidArgumentError("bias gradient: bad sizes");
  }
  const BiasGradPlan plan = PlanBiasGrad(batch, channels, inner);
  if (scratch_floats < channels * plan.per_channel) {
    return absl::InvalidArgumentError("bias gradient: scratch smaller than BiasGradScratchFloats");
  }
  if (plan.blocks_x > INT32_MAX)
    return absl::InvalidArgumentError("bias gradient: too many columns");
  // batch == 0 still launches: every partial is 0, leaving dbias unchanged.
  const dim3 grid(static_cast<unsigned>(plan.blocks_x), static_cast<unsigned>(plan.slices));
  if (plan.columns) {
    BiasGradColumnsKernel<<<grid, dim3(kColumnTile, kRowThreads), 0, stream>>>(
        g, scratch, batch, channels * inner, plan.rows_per_slice);
    AIDN_RETURN_IF_LAUNCH_FAILED("BiasGradColumnsKernel");
  } else {
    BiasGradRowsKernel<<<grid, kThreads, 0, stream>>>(g, scratch, batch, channels, inner,
                                                      plan.rows_per_slice);
    AIDN_RETURN_IF_LAUNCH_FAILED("BiasGradRowsKernel");
  }
  // Columns' partials are [channel][q][slice]: channel c's are contiguous.
  BiasGradFinishKernel<<<BlocksFor(channels), kThreads, 0, stream>>>(scratch, dbias, channels,
                                                                     plan.per_channel);
  AIDN_RETURN_IF_LAUNCH_FAILED("BiasGradFinishKernel");
  return absl::OkStatus();
}

absl::Status LaunchDropout(cudaStream_t stream, const float* x, float* y, int64_t n, uint64_t key,
                           uint64_t threshold, float scale) {
  if (n == 0) return absl::OkStatus();
  DropoutKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, y, n, key, threshold, scale);
  AIDN_RETURN_IF_LAUNCH_FAILED("DropoutKernel");
  return absl::OkStatus();
}

absl::Status LaunchPlaneMean(cudaStream_t stream, const float* x, int64_t planes, int64_t plane,
                             float* y) {
  if (planes == 0) return absl::OkStatus();
  const int64_t per_block = kThreads / 32;
  PlaneMeanKernel<<<static_cast<unsigned>((planes + per_block - 1) / per_block), kThreads, 0,
                    stream>>>(x, planes, plane, y);
  AIDN_RETURN_IF_LAUNCH_FAILED("PlaneMeanKernel");
  return absl::OkStatus();
}

absl::Status LaunchPlaneMeanBackward(cudaStream_t stream, const float* g, int64_t planes,
                                     int64_t plane, float* dx) {
  if (planes * plane == 0) return absl::OkStatus();
  // As the CPU: the gradient times 1/plane, the factor in float.
  const float scale = 1.0f / static_cast<float>(plane);
  PlaneMeanBackwardKernel<<<BlocksFor(planes * plane), kThreads, 0, stream>>>(g, planes, plane,
                                                                              scale, dx);
  AIDN_RETURN_IF_LAUNCH_FAILED("PlaneMeanBackwardKernel");
  return absl::OkStatus();
}

absl::Status LaunchSoftmaxCrossEntropy(cudaStream_t stream, const float* logits,
                                       const int32_t* labels, int64_t n, int64_t classes,
                                       float* grad_logits, double grad_scale, double* row_loss,
                                       double* loss) {
  if (n == 0) {
    // As the CPU: the loss of an empty batch is 0.
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(loss, 0, sizeof(double), stream));
    return absl::OkStatus();
  }
  if (classes <= 0) return absl::InvalidArgumentError("softmax cross-entropy needs classes > 0");
  constexpr int64_t kRowsPerBlock = kThreads / 32;
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > INT32_MAX)
    return absl::InvalidArgumentError("softmax cross-entropy: batch too large");
  SoftmaxCrossEntropyKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      logits, labels, n, classes, grad_logits, grad_scale / static_cast<double>(n), row_loss);
  AIDN_RETURN_IF_LAUNCH_FAILED("SoftmaxCrossEntropyKernel");
  MeanKernel<<<1, kThreads, 0, stream>>>(row_loss, n, loss);
  AIDN_RETURN_IF_LAUNCH_FAILED("MeanKernel");
  return absl::OkStatus();
}

absl::Status LaunchSumOfSquares(cudaStream_t stream, const float* g, int64_t n, double* sum_sq,
                                double* scratch) {
  // A block per 16 elements a thread, at most kSumOfSquaresBlocks. n == 0
  // still launches, to write 0.
  const int64_t per_block = int64_t{1024} * 16;
  const int blocks = static_cast<int>(
      std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kSumOfSquaresBlocks));
  if (blocks == 1) {
    SumOfSquaresKernel<<<1, 1024, 0, stream>>>(g, n, sum_sq);
    AIDN_RETURN_IF_LAUNCH_FAILED("SumOfSquaresKernel");
    return absl::OkStatus();
  }
  SumOfSquaresKernel<<<static_cast<unsigned>(blocks), 1024, 0, stream>>>(g, n, scratch);
  AIDN_RETURN_IF_LAUNCH_FAILED("SumOfSquaresKernel");
  SumPartialsKernel<<<1, 256, 0, stream>>>(scratch, blocks, sum_sq);
  AIDN_RETURN_IF_LAUNCH_FAILED("SumPartialsKernel");
  return absl::OkStatus();
}

absl::Status LaunchSumDoubles(cudaStream_t stream, const double* in, int count, double* total) {
  SumDoublesKernel<<<1, 1, 0, stream>>>(in, count, total);
  AIDN_RETURN_IF_LAUNCH_FAILED("SumDoublesKernel");
  return absl::OkStatus();
}

absl::Status LaunchClipCoefficient(cudaStream_t stream, const double* sum_sq, int count,
                                   double max_norm, double* norm, float* coef) {
  ClipCoefficientKernel<<<1, 1, 0, stream>>>(sum_sq, count, max_norm, norm, coef);
  AIDN_RETURN_IF_LAUNCH_FAILED("ClipCoefficientKernel");
  return absl::OkStatus();
}

absl::Status LaunchSgd(cudaStream_t stream, float* p, const float* grad, float* buf, int64_t n,
                       const SgdArgs& a, const float* scale, const SgdArgs* in_memory) {
  if (n == 0) return absl::OkStatus();
  if (a.use_momentum && buf == nullptr) {
    return absl::InvalidArgumentError("sgd momentum without buffer");
  }
  if (!a.use_momentum) {
    if (a.apply_decay) {
      QueueSgd<true, false, false, false>(stream, p, grad, buf, n, a, scale, in_memory);
    } else {
      QueueSgd<false, false, false, false>(stream, p, grad, buf, n, a, scale, in_memory);
    }
  } else if (a.apply_decay) {
    QueueSgdMomentum<true>(stream, p, grad, buf, n, a, scale, in_memory);
  } else {
    QueueSgdMomentum<false>(stream, p, grad, buf, n, a, scale, in_memory);
  }
  AIDN_RETURN_IF_LAUNCH_FAILED("SgdKernel");
  return absl::OkStatus();
}

absl::Status LaunchAdamW(cudaStream_t stream, float* p, const float* grad, float* m, float* v,
                         int64_t n, const AdamWArgs& a, const float* scale,
                         const AdamWArgs* in_memory) {
  if (n == 0) return absl::OkStatus();
  if (a.apply_decay) {
    AdamWKernel<true><<<BlocksFor(n), kThreads, 0, stream>>>(p, grad, m, v, n, a, scale, in_memory);
  } else {
    AdamWKernel<false>
        <<<BlocksFor(n), kThreads, 0, stream>>>(p, grad, m, v, n, a, scale, in_memory);
  }
  AIDN_RETURN_IF_LAUNCH_FAILED("AdamWKernel");
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
