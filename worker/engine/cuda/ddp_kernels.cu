// PowerSGD's and SyncBatchNorm's kernels (ddp_kernels.h). Per-channel and
// per-column sums take one block each and sum in double through fixed
// trees (kernel_util.cuh), so two runs give the same bits.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/ddp_kernels.h"
#include "worker/engine/cuda/kernel_util.cuh"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

using kernel::BlocksFor;
using kernel::BlockSumToAll;
using kernel::GlobalIndex;
using kernel::GridStride;
using kernel::kThreads;

// The orthogonalisation's block: its columns are as long as a bucket's
// longest gradient dimension (a GPT's vocabulary), and it runs alone.
constexpr int kColumnThreads = 1024;

__global__ void SubtractKernel(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = GlobalIndex(); i < n; i += GridStride()) y[i] = __fsub_rn(a[i], b[i]);
}

// The dot product of columns x and y over the block, in every thread.
__device__ double ColumnDot(const float* a, int64_t rows, int64_t cols, int64_t x, int64_t y) {
  double d = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    d += static_cast<double>(a[r * cols + x]) * static_cast<double>(a[r * cols + y]);
  }
  return BlockSumToAll(d);
}

__global__ void OrthogonalizeColumnsKernel(float* a, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < cols; ++i) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j = 0; j < i; ++j) {
        const float d = static_cast<float>(ColumnDot(a, rows, cols, j, i));
        for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
          a[r * cols + i] = __fsub_rn(a[r * cols + i], __fmul_rn(d, a[r * cols + j]));
        }
        __syncthreads();
      }
    }
    const double norm = sqrt(ColumnDot(a, rows, cols, i, i));
    if (norm > 0) {
      const float inv = static_cast<float>(1.0 / norm);
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        a[r * cols + i] = __fmul_rn(a[r * cols + i], inv);
      }
    }
    __syncthreads();
  }
}

// Element k of channel c over [n, channels, plane].
__device__ __forceinline__ int64_t ChannelElement(int64_t k, int64_t c, int64_t channels,
                                                  int64_t plane) {
  const int64_t i = k / plane;
  return (i * channels + c) * plane + (k - i * plane);
}

__global__ void ChannelMomentsKernel(const float* x, int64_t n, int64_t channels, int64_t plane,
                                     float* moments) {
  const int64_t c = blockIdx.x;
  const int64_t count = n * plane;
  double sum = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    sum += static_cast<double>(x[ChannelElement(k, c, channels, plane)]);
  }
  sum = BlockSumToAll(sum);
  const double mean = count > 0 ? sum / static_cast<double>(count) : 0.0;
  double squares = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    const double d = static_cast<double>(x[ChannelElement(k, c, channels, plane)]) - mean;
    squares += d * d;
  }
  squares = BlockSumToAll(squares);
  if (threadIdx.x == 0) {
    moments[c] = static_cast<float>(mean);
    moments[channels + c] = static_cast<float>(squares);
    if (c == 0) moments[2 * channels] = static_cast<float>(count);
  }
}

__global__ void CombineMomentsKernel(const float* gathered, int world, int64_t channels, double eps,
                                     double momentum, bool update, float* mean, float* invstd,
                                     double* count, float* running_mean, float* running_var) {
  const int64_t block = 2 * channels + 1;
  for (int64_t c = GlobalIndex(); c < channels; c += GridStride()) {
    double n_a = 0, mean_a = 0, m2_a = 0;
    for (int r = 0; r < world; ++r) {
      const float* b = gathered + block * r;
      const double n_b = b[2 * channels];
      if (n_b <= 0) continue;
      const double total = n_a + n_b;
      const double delta = b[c] - mean_a;
      mean_a += delta * n_b / total;
      m2_a += b[channels + c] + delta * delta * n_a * n_b / total;
      n_a = total;
    }
    if (c == 0) *count = n_a;
    const double var = m2_a / n_a;
    if (update) {
      const double unbiased = m2_a / (n_a - 1);
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean_a);
      running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
    }
    mean[c] = static_cast<float>(mean_a);
    invstd[c] = static_cast<float>(1.0 / sqrt(var + eps));
  }
}

__global__ void NormalizeChannelsKernel(const float* x, const float* mean, const float* invstd,
                                        const float* weight, const float* bias, int64_t total,
                                        int64_t channels, int64_t plane, float* y) {
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    const int64_t c = (i / plane) % channels;
    const float scale = __fmul_rn(weight[c], invstd[c]);
    y[i] = __fadd_rn(__fmul_rn(__fsub_rn(x[i], mean[c]), scale), bias[c]);
  }
}

__global__ void ChannelGradientSumsKernel(const float* g, const float* x, const float* mean,
                                          const float* invstd, int64_t n, int64_t channels,
                                          int64_t plane, float* sums, float* dweight,
                                          float* dbias) {
  const int64_t c = blockIdx.x;
  const float m = mean[c];
  const float s = invstd[c];
  double dy = 0, dy_xhat = 0;
  for (int64_t k = threadIdx.x; k < n * plane; k += blockDim.x) {
    const int64_t at = ChannelElement(k, c, channels, plane);
    const double gv = static_cast<double>(g[at]);
    dy += gv;
    dy_xhat += gv * static_cast<double>(__fmul_rn(__fsub_rn(x[at], m), s));
  }
  dy = BlockSumToAll(dy);
  dy_xhat = BlockSumToAll(dy_xhat);
  if (threadIdx.x == 0) {
    sums[c] = static_cast<float>(dy);
    sums[channels + c] = static_cast<float>(dy_xhat);
    dweight[c] = __fadd_rn(dweight[c], static_cast<float>(dy_xhat));
    dbias[c] = __fadd_rn(dbias[c], static_cast<float>(dy));
  }
}

__global__ void BatchNormInputGradientKernel(const float* g, const float* x, const float* mean,
                                             const float* invstd, const float* weight,
                                             const float* sums, const double* count, int64_t total,
                                             int64_t channels, int64_t plane, float* dx) {
  const double n = *count;
  for (int64_t i = GlobalIndex(); i < total; i += GridStride()) {
    const int64_t c = (i / plane) % channels;
    const float s = invstd[c];
    const float k = __fmul_rn(weight[c], s);
    const float mean_dy = static_cast<float>(static_cast<double>(sums[c]) / n);
    const float mean_dy_xhat = static_cast<float>(static_cast<double>(sums[channels + c]) / n);
    const float xhat = __fmul_rn(__fsub_rn(x[i], mean[c]), s);
    dx[i] = __fmul_rn(k, __fsub_rn(__fsub_rn(g[i], mean_dy), __fmul_rn(xhat, mean_dy_xhat)));
  }
}

absl::Status ChannelGrid(int64_t channels, const char* what) {
  if (channels > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", channels, " channels"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchSubtract(cudaStream_t stream, const float* a, const float* b, float* y,
                            int64_t n) {
  if (n == 0) return absl::OkStatus();
  SubtractKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, b, y, n);
  AIDN_RETURN_IF_LAUNCH_FAILED("SubtractKernel");
  return absl::OkStatus();
}

absl::Status LaunchOrthogonalizeColumns(cudaStream_t stream, float* a, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  OrthogonalizeColumnsKernel<<<1, kColumnThreads, 0, stream>>>(a, rows, cols);
  AIDN_RETURN_IF_LAUNCH_FAILED("OrthogonalizeColumnsKernel");
  return absl::OkStatus();
}

absl::Status LaunchChannelMoments(cudaStream_t stream, const float* x, int64_t n, int64_t channels,
                                  int64_t plane, float* moments) {
  if (channels == 0) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(ChannelGrid(channels, "ChannelMomentsKernel"));
  ChannelMomentsKernel<<<static_cast<unsigned>(channels), kThreads, 0, stream>>>(x, n, channels,
                                                                                 plane, moments);
  AIDN_RETURN_IF_LAUNCH_FAILED("ChannelMomentsKernel");
  return absl::OkStatus();
}

absl::Status LaunchCombineMoments(cudaStream_t stream, const float* gathered, int world,
                                  int64_t channels, double eps, double momentum, bool update,
                                  float* mean, float* invstd, double* count, float* running_mean,
                                  float* running_var) {
  if (channels == 0) return absl::OkStatus();
  CombineMomentsKernel<<<BlocksFor(channels), kThreads, 0, stream>>>(
      gathered, world, channels, eps, momentum, update, mean, invstd, count, running_mean,
      running_var);
  AIDN_RETURN_IF_LAUNCH_FAILED("CombineMomentsKernel");
  return absl::OkStatus();
}

absl::Status LaunchNormalizeChannels(cudaStream_t stream, const float* x, const float* mean,
                                     const float* invstd, const float* weight, const float* bias,
                                     int64_t n, int64_t channels, int64_t plane, float* y) {
  const int64_t total = n * channels * plane;
  if (total == 0) return absl::OkStatus();
  NormalizeChannelsKernel<<<BlocksFor(total), kThreads, 0, stream>>>(x, mean, invstd, weight, bias,
                                                                     total, channels, plane, y);
  AIDN_RETURN_IF_LAUNCH_FAILED("NormalizeChannelsKernel");
  return absl::OkStatus();
}

absl::Status LaunchChannelGradientSums(cudaStream_t stream, const float* g, const float* x,
                                       const float* mean, const float* invstd, int64_t n,
                                       int64_t channels, int64_t plane, float* sums, float* dweight,
                                       float* dbias) {
  if (channels == 0) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(ChannelGrid(channels, "ChannelGradientSumsKernel"));
  ChannelGradientSumsKernel<<<static_cast<unsigned>(channels), kThreads, 0, stream>>>(
      g, x, mean, invstd, n, channels, plane, sums, dweight, dbias);
  AIDN_RETURN_IF_LAUNCH_FAILED("ChannelGradientSumsKernel");
  return absl::OkStatus();
}

absl::Status LaunchBatchNormInputGradient(cudaStream_t stream, const float* g, const float* x,
                                          const float* mean, const float* invstd,
                                          const float* weight, const float* sums,
                                          const double* count, int64_t n, int64_t channels,
                                          int64_t plane, float* dx) {
  const int64_t total = n * channels * plane;
  if (total == 0) return absl::OkStatus();
  BatchNormInputGradientKernel<<<BlocksFor(total), kThreads, 0, stream>>>(
      g, x, mean, invstd, weight, sums, count, total, channels, plane, dx);
  AIDN_RETURN_IF_LAUNCH_FAILED("BatchNormInputGradientKernel");
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
