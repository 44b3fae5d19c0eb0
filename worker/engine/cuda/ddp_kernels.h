#ifndef AIDN_WORKER_ENGINE_CUDA_DDP_KERNELS_H_
#define AIDN_WORKER_ENGINE_CUDA_DDP_KERNELS_H_

// Kernels of data parallelism on GPUs (ddp_kernels.cu): PowerSGD's
// (cuda/gpu_powersgd.h) and SyncBatchNorm's (cuda/gpu_resnet.h). Habits as
// kernels.h: host functions that queue on `stream` and return the launch
// status, device pointers, element counts, nothing queued for a count of
// zero, float arithmetic in the CPU engine's order with no contraction,
// deterministic sums (in another order than the CPU's, in double).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace aidn::engine::cuda {

// y = a - b (y may equal a or b).
absl::Status LaunchSubtract(cudaStream_t stream, const float* a, const float* b, float* y,
                            int64_t n);

// powersgd.h's OrthogonalizeColumns: the columns of `a` [rows, cols]
// (row-major, cols <= rows) orthonormalised in place by Gram-Schmidt with a
// second pass; a zero column stays zero. One block, column after column.
absl::Status LaunchOrthogonalizeColumns(cudaStream_t stream, float* a, int64_t rows, int64_t cols);

// SyncBatchNorm (batchnorm.h) over x [n, channels, plane] (NCHW):
//
// moments[c] = this rank's mean of channel c, moments[channels + c] its
// sum of squared deviations from it (both summed in double, stored in
// float as the CPU exchanges them), moments[2 channels] = n * plane.
absl::Status LaunchChannelMoments(cudaStream_t stream, const float* x, int64_t n, int64_t channels,
                                  int64_t plane, float* moments);
// From `world` ranks' moments back to back (2 channels + 1 floats each),
// combined in rank order in double (Chan et al., as the CPU): mean[c] and
// invstd[c] = 1 / sqrt(var + eps) in float, *count the total; with
// `update`, running_mean and running_var moved by `momentum` towards the
// mean and the unbiased variance.
absl::Status LaunchCombineMoments(cudaStream_t stream, const float* gathered, int world,
                                  int64_t channels, double eps, double momentum, bool update,
                                  float* mean, float* invstd, double* count, float* running_mean,
                                  float* running_var);
// y = (x - mean[c]) * (weight[c] * invstd[c]) + bias[c].
absl::Status LaunchNormalizeChannels(cudaStream_t stream, const float* x, const float* mean,
                                     const float* invstd, const float* weight, const float* bias,
                                     int64_t n, int64_t channels, int64_t plane, float* y);
// Per channel, sum(dy) and sum(dy * xhat) with xhat = (x - mean) * invstd:
// into sums[c] and sums[channels + c] (float, for the allreduce), and added
// to dbias[c] and dweight[c] (this rank's own, for DDP to average).
absl::Status LaunchChannelGradientSums(cudaStream_t stream, const float* g, const float* x,
                                       const float* mean, const float* invstd, int64_t n,
                                       int64_t channels, int64_t plane, float* sums, float* dweight,
                                       float* dbias);
// dx = weight invstd (dy - sum(dy) / count - xhat sum(dy xhat) / count),
// with `sums` as above summed over every rank and *count their total.
absl::Status LaunchBatchNormInputGradient(cudaStream_t stream, const float* g, const float* x,
                                          const float* mean, const float* invstd,
                                          const float* weight, const float* sums,
                                          const double* count, int64_t n, int64_t channels,
                                          int64_t plane, float* dx);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_DDP_KERNELS_H_
