#ifndef AIDN_WORKER_ENGINE_CUDA_KERNELS_H_
#define AIDN_WORKER_ENGINE_CUDA_KERNELS_H_

// The GPU engine's own kernels (kernels.cu), as host functions that queue
// them on `stream` and return the launch status. All pointers are device
// pointers; sizes are element counts; a count of zero queues nothing.
// Float arithmetic is written out with round-to-nearest intrinsics (and the
// target is built with --fmad=false) so that no multiply-add is contracted:
// each element is computed exactly as the CPU engine computes it, except
// where a comment says otherwise (reductions sum in a different order).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace aidn::engine::cuda {

// y[i] = x[i] + bias[(i / inner) % channels], then max(., 0) if `relu`.
// Linear: channels = out features, inner = 1. Conv2d (NCHW): channels = C,
// inner = H * W. x may equal y.
absl::Status LaunchBiasActivation(cudaStream_t stream, const float* x, const float* bias, float* y,
                                  int64_t n, int64_t channels, int64_t inner, bool relu);

// y = a + b (y may equal a or b).
absl::Status LaunchAdd(cudaStream_t stream, const float* a, const float* b, float* y, int64_t n);
// y = max(a * s + b, 0) (a residual block's join, the CPU's
// ScaledAddReluKernel; y may equal a or b).
absl::Status LaunchScaledAddRelu(cudaStream_t stream, const float* a, float s, const float* b,
                                 float* y, int64_t n);
// x *= s.
absl::Status LaunchScale(cudaStream_t stream, float* x, int64_t n, float s);

// y = max(x, 0). x may equal y.
absl::Status LaunchRelu(cudaStream_t stream, const float* x, float* y, int64_t n);

// dx = mask > 0 ? g : 0, with `mask` the ReLU's input or output (they are
// positive at the same places). g may equal dx.
absl::Status LaunchReluBackward(cudaStream_t stream, const float* mask, const float* g, float* dx,
                                int64_t n);

// dbias[c] += sum over b < batch, p < inner of g[(b * channels + c) * inner + p],
// summed in an order fixed by the sizes (the same bits every run), through
// `scratch`, device memory of at least BiasGradScratchFloats(batch,
// channels, inner) floats (INVALID_ARGUMENT if smaller).
int64_t BiasGradScratchFloats(int64_t batch, int64_t channels, int64_t inner);
absl::Status LaunchBiasGrad(cudaStream_t stream, const float* g, float* dbias, int64_t batch,
                            int64_t channels, int64_t inner, float* scratch,
                            int64_t scratch_floats);

// Inverted dropout with the mask of dropout_mask.h: y = keep ? x * scale : 0.
// Backward is the same operation on the gradient, with the same key.
absl::Status LaunchDropout(cudaStream_t stream, const float* x, float* y, int64_t n, uint64_t key,
                           uint64_t threshold, float scale);

// Global average pooling (ResNet's AdaptiveAvgPool2d((1, 1))): y[p] =
// the mean of plane p of x ([planes, plane]), summed in double as the CPU
// sums; its backward dx[p, j] = g[p] * (1 / plane).
absl::Status LaunchPlaneMean(cudaStream_t stream, const float* x, int64_t planes, int64_t plane,
                             float* y);
absl::Status LaunchPlaneMeanBackward(cudaStream_t stream, const float* g, int64_t planes,
                                     int64_t plane, float* dx);

// Softmax cross-entropy as engine::SoftmaxCrossEntropy, in double where that
// computes in double. logits [n, classes], labels [n] in [0, classes).
// Writes grad_logits (may be null) = (softmax - onehot) * grad_scale / n and
// *loss (one double on the device) = mean over rows of the loss; row_loss is
// scratch for n doubles.
absl::Status LaunchSoftmaxCrossEntropy(cudaStream_t stream, const float* logits,
                                       const int32_t* labels, int64_t n, int64_t classes,
                                       float* grad_logits, double grad_scale, double* row_loss,
                                       double* loss);

// correct[r] = 1 if the first largest of row r of logits [rows, classes]
// is at labels[r], else 0 (engine::CountCorrect's rule, one row each).
absl::Status LaunchCorrectRows(cudaStream_t stream, const float* logits, const int32_t* labels,
                               int64_t rows, int64_t classes, int32_t* correct);

// The 16-bit formats of mixed precision (spec precision bf16 / fp16).
enum class HalfType { kBf16, kFp16 };

// y[i] = x[i] rounded to nearest-even in `type` (y: n 16-bit values). fp16
// overflows to +-inf past 65504 (loss scaling detects that).
absl::Status LaunchToHalf(cudaStream_t stream, const float* x, void* y, int64_t n, HalfType type);
// y[i] = float(x[i]), or y[i] += float(x[i]) with `accumulate`.
absl::Status LaunchFromHalf(cudaStream_t stream, const void* x, float* y, int64_t n, HalfType type,
                            bool accumulate);

// Loss scaling's unscale and check: g[i] *= inv_scale, and *found = 1 if any
// g[i] is an inf or a NaN (before or after; *found is only ever set, never
// cleared: zero it once per step).
absl::Status LaunchUnscaleAndCheck(cudaStream_t stream, float* g, int64_t n, float inv_scale,
                                   int32_t* found);

// *sum_sq = sum of g[i]^2 over n elements, in double, in an order fixed by
// n: up to kSumOfSquaresBlocks blocks each sum a strided share into
// `scratch` (device memory of kSumOfSquaresBlocks doubles, reused by the
// next call on the stream), and one block sums those. A large tensor (a
// GPT's embedding) is read by many SMs, not one.
inline constexpr int kSumOfSquaresBlocks = 256;
absl::Status LaunchSumOfSquares(cudaStream_t stream, const float* g, int64_t n, double* sum_sq,
                                double* scratch);

// *total = sum of in[0..count) in index order, one thread (the order
// LaunchClipCoefficient sums in, so one total gives its norm bit for bit).
absl::Status LaunchSumDoubles(cudaStream_t stream, const double* in, int count, double* total);

// From the per-tensor sums of squares `sum_sq[0..count)`: *norm = sqrt of
// their sum, *coef = the torch clip coefficient max_norm / (norm + 1e-6) as
// float when below 1, else 1 (also 1 for a non-finite norm).
absl::Status LaunchClipCoefficient(cudaStream_t stream, const double* sum_sq, int count,
                                   double max_norm, double* norm, float* coef);

struct SgdArgs {
  float lr = 0;
  bool apply_decay = false;  // the weight-decay term (config weight_decay != 0)
  float weight_decay = 0;
  bool use_momentum = false;  // the momentum buffer (config momentum != 0)
  float momentum = 0;
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer starts as the gradient
};
// One fused SGD step (optimizer.h's formula). `buf` may be null without
// momentum; `scale` (one device float, the clip coefficient) may be null.
// With `in_memory` (device memory) the kernel reads its arguments there
// when it runs, not from `args` (whose flags still choose the kernel): a
// CUDA graph replays the launch with each step's learning rate.
absl::Status LaunchSgd(cudaStream_t stream, float* p, const float* grad, float* buf, int64_t n,
                       const SgdArgs& args, const float* scale, const SgdArgs* in_memory = nullptr);

struct AdamWArgs {
  float decay = 1;  // 1 - lr * wd
  bool apply_decay = false;
  float beta1 = 0;     // b1
  float one_m_b1 = 0;  // 1 - b1
  float beta2 = 0;     // b2
  float one_m_b2 = 0;  // 1 - b2
  float bc2_sqrt = 1;  // sqrt(1 - b2^t)
  float eps = 0;
  float neg_step = 0;  // -lr / (1 - b1^t)
};
// One fused AdamW step (optimizer.h's formula), `scale` and `in_memory` as
// for LaunchSgd (AdamW's bias corrections change every step).
absl::Status LaunchAdamW(cudaStream_t stream, float* p, const float* grad, float* m, float* v,
                         int64_t n, const AdamWArgs& args, const float* scale,
                         const AdamWArgs* in_memory = nullptr);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_KERNELS_H_
