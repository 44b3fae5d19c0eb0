#include "worker/engine/batchnorm.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/layers.h"
#include "worker/engine/simd.h"

namespace aidn::engine {
namespace {

// The per-channel passes over a plane. The sums go into 16 double lanes,
// each its own chain (so the loop vectorises), then the lanes in order: an
// order fixed by the plane's length, the same on every run.
constexpr int kLanes = 16;

double AddLanes(const double* lane, double tail) {
  double sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += lane[j];
  return sum + tail;
}

// Adds sum(x) of x[0, n) to *sum.
AIDN_VECTOR_CLONES void SumPlane(const float* __restrict x, int64_t n, double* sum) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] += static_cast<double>(x[i + j]);
  }
  double tail = 0;
  for (; i < n; ++i) tail += static_cast<double>(x[i]);
  *sum += AddLanes(lane, tail);
}

// Adds sum((x - m)^2) to *squares.
AIDN_VECTOR_CLONES void SquaredDeviations(const float* __restrict x, int64_t n, double m,
                                          double* squares) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double d = static_cast<double>(x[i + j]) - m;
      lane[j] += d * d;
    }
  }
  double tail = 0;
  for (; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - m;
    tail += d * d;
  }
  *squares += AddLanes(lane, tail);
}

// sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd in float.
AIDN_VECTOR_CLONES void GradientSums(const float* __restrict g, const float* __restrict x,
                                     int64_t n, float mean, float invstd, double* sum_dy,
                                     double* sum_dy_xhat) {
  double a[kLanes] = {};
  double b[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      a[j] += static_cast<double>(g[i + j]);
      b[j] += static_cast<double>(g[i + j]) * static_cast<double>((x[i + j] - mean) * invstd);
    }
  }
  double ta = 0, tb = 0;
  for (; i < n; ++i) {
    ta += static_cast<double>(g[i]);
    tb += static_cast<double>(g[i]) * static_cast<double>((x[i] - mean) * invstd);
  }
  *sum_dy += AddLanes(a, ta);
  *sum_dy_xhat += AddLanes(b, tb);
}

// y = (x - m) * scale + shift ((x - mean) first, as torch: a value at the
// mean gives the bias exactly).
AIDN_VECTOR_CLONES void Normalize(const float* __restrict x, int64_t n, float m, float scale,
                                  float shift, float* __restrict y) {
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * scale + shift;
}

// dx = k * (dy - mean_dy - xhat * mean_dy_xhat).
AIDN_VECTOR_CLONES void InputGradient(const float* __restrict g, const float* __restrict x,
                                      int64_t n, float mean, float invstd, float k, float mean_dy,
                                      float mean_dy_xhat, float* __restrict dx) {
  for (int64_t i = 0; i < n; ++i) {
    const float xhat = (x[i] - mean) * invstd;
    dx[i] = k * (g[i] - mean_dy - xhat * mean_dy_xhat);
  }
}

}  // namespace

BatchNorm2d::BatchNorm2d(int64_t channels, double eps, double momentum)
    : channels_(channels),
      eps_(eps),
      momentum_(momentum),
      weight_{"weight", Tensor({channels}), Tensor({channels})},
      bias_{"bias", Tensor({channels}), Tensor({channels})},
      running_mean_{"running_mean", Tensor({channels}), Tensor()},
      running_var_{"running_var", Tensor({channels}), Tensor()},
      mean_(static_cast<size_t>(channels)),
      invstd_(static_cast<size_t>(channels)) {
  AIDN_CHECK(channels > 0 && eps > 0 && momentum >= 0 && momentum <= 1) << "bad BatchNorm2d";
  weight_.value.Fill(1.0f);
  running_var_.value.Fill(1.0f);
}

std::string BatchNorm2d::Describe() const {
  return absl::StrCat("BatchNorm2d(", channels_,
                      ", eps=", eps_ == 1e-5 ? "1e-05" : absl::StrCat(eps_),
                      ", momentum=", momentum_, ", affine=True, track_running_stats=True)");
}

void BatchNorm2d::Statistics(const Tensor& input, std::vector<double>* mean,
                             std::vector<double>* m2, double* count) {
  const int64_t n = input.dim(0);
  const int64_t plane = input.dim(2) * input.dim(3);
  const float* x = input.data();
  *count = static_cast<double>(n * plane);
  mean->assign(static_cast<size_t>(channels_), 0.0);
  m2->assign(static_cast<size_t>(channels_), 0.0);
  for (int64_t c = 0; c < channels_; ++c) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) SumPlane(x + (i * channels_ + c) * plane, plane, &sum);
    const double m = *count > 0 ? sum / *count : 0.0;
    double squares = 0;
    for (int64_t i = 0; i < n; ++i) {
      SquaredDeviations(x + (i * channels_ + c) * plane, plane, m, &squares);
    }
    (*mean)[static_cast<size_t>(c)] = m;
    (*m2)[static_cast<size_t>(c)] = squares;
  }
  if (sync_ == nullptr || sync_->world_size() == 1) return;
  // [mean (C), m2 (C), count] of every rank, combined in rank order.
  const size_t block = 2 * static_cast<size_t>(channels_) + 1;
  const size_t world = static_cast<size_t>(sync_->world_size());
  exchange_.resize(block * world);
  float* mine = exchange_.data() + block * static_cast<size_t>(sync_->rank());
  for (int64_t c = 0; c < channels_; ++c) {
    mine[c] = static_cast<float>((*mean)[static_cast<size_t>(c)]);
    mine[channels_ + c] = static_cast<float>((*m2)[static_cast<size_t>(c)]);
  }
  mine[2 * channels_] = static_cast<float>(*count);
  if (absl::Status s = sync_->AllGather(mine, block, exchange_.data()); !s.ok()) {
    // The rank's own statistics; the step fails on the kept error.
    if (sync_status_.ok()) sync_status_ = Annotate(s, "sync batchnorm statistics");
    return;
  }
  for (int64_t c = 0; c < channels_; ++c) {
    double n_a = 0, mean_a = 0, m2_a = 0;
    for (size_t r = 0; r < world; ++r) {
      const float* b = exchange_.data() + block * r;
      const double n_b = b[2 * channels_];
      if (n_b <= 0) continue;
      const double total = n_a + n_b;
      const double delta = b[c] - mean_a;
      mean_a += delta * n_b / total;
      m2_a += b[channels_ + c] + delta * delta * n_a * n_b / total;
      n_a = total;
    }
    (*mean)[static_cast<size_t>(c)] = mean_a;
    (*m2)[static_cast<size_t>(c)] = m2_a;
    *count = n_a;
  }
}

void BatchNorm2d::Forward(const Tensor& input, Tensor* output, bool training) {
  AIDN_CHECK(input.rank() == 4 && input.dim(1) == channels_)
      << Describe() << " got input " << input.ShapeString();
  const int64_t n = input.dim(0);
  const int64_t plane = input.dim(2) * input.dim(3);
  EnsureShape(output, input.shape());
  input_ = &input;
  training_ = training;
  std::vector<double> batch_mean, batch_m2;
  double count = 0;
  if (training) {
    Statistics(input, &batch_mean, &batch_m2, &count);
    AIDN_CHECK(count > 1) << Describe()
                          << ": training needs more than one value per channel, got input "
                          << input.ShapeString();
    global_count_ = count;
  }
  const float* x = input.data();
  float* y = output->data();
  for (int64_t c = 0; c < channels_; ++c) {
    double mean = running_mean_.value[c];
    double var = running_var_.value[c];
    if (training) {
      mean = batch_mean[static_cast<size_t>(c)];
      var = batch_m2[static_cast<size_t>(c)] / count;
      const double unbiased = batch_m2[static_cast<size_t>(c)] / (count - 1);
      float& rm = running_mean_.value.data()[c];
      float& rv = running_var_.value.data()[c];
      if (!frozen_) {
        rm = static_cast<float>((1.0 - momentum_) * rm + momentum_ * mean);
        rv = static_cast<float>((1.0 - momentum_) * rv + momentum_ * unbiased);
      }
    }
    const float invstd = static_cast<float>(1.0 / std::sqrt(var + eps_));
    mean_[static_cast<size_t>(c)] = static_cast<float>(mean);
    invstd_[static_cast<size_t>(c)] = invstd;
    const float scale = weight_.value[c] * invstd;
    const float shift = bias_.value[c];
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (i * channels_ + c) * plane;
      Normalize(x + at, plane, m, scale, shift, y + at);
    }
  }
}

void BatchNorm2d::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_ != nullptr && grad_output.shape() == input_->shape())
      << Describe() << " backward got " << grad_output.ShapeString();
  const int64_t n = input_->dim(0);
  const int64_t plane = input_->dim(2) * input_->dim(3);
  const double count = static_cast<double>(n * plane);
  if (grad_input != nullptr) EnsureShape(grad_input, input_->shape());
  const float* x = input_->data();
  const float* g = grad_output.data();
  // Per channel: sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd.
  std::vector<double> sum_dy(static_cast<size_t>(channels_), 0.0);
  std::vector<double> sum_dy_xhat(static_cast<size_t>(channels_), 0.0);
  for (int64_t c = 0; c < channels_; ++c) {
    const float mean = mean_[static_cast<size_t>(c)];
    const float invstd = invstd_[static_cast<size_t>(c)];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (i * channels_ + c) * plane;
      GradientSums(g + at, x + at, plane, mean, invstd, &sum_dy[static_cast<size_t>(c)],
                   &sum_dy_xhat[static_cast<size_t>(c)]);
    }
    // The rank's own, for DDP to average.
    weight_.grad.data()[c] += static_cast<float>(sum_dy_xhat[static_cast<size_t>(c)]);
    bias_.grad.data()[c] += static_cast<float>(sum_dy[static_cast<size_t>(c)]);
  }
  double total = count;
  if (training_ && sync_ != nullptr && sync_->world_size() > 1 && grad_input != nullptr) {
    // The input gradient needs the sums over every rank's batch.
    exchange_.resize(2 * static_cast<size_t>(channels_));
    for (int64_t c = 0; c < channels_; ++c) {
      exchange_[static_cast<size_t>(c)] = static_cast<float>(sum_dy[static_cast<size_t>(c)]);
      exchange_[static_cast<size_t>(channels_ + c)] =
          static_cast<float>(sum_dy_xhat[static_cast<size_t>(c)]);
    }
    if (absl::Status s = sync_->AllReduce(exchange_.data(), exchange_.size(), ReduceOp::kSum);
        !s.ok()) {
      if (sync_status_.ok()) sync_status_ = Annotate(s, "sync batchnorm gradients");
    } else {
      for (int64_t c = 0; c < channels_; ++c) {
        sum_dy[static_cast<size_t>(c)] = exchange_[static_cast<size_t>(c)];
        sum_dy_xhat[static_cast<size_t>(c)] = exchange_[static_cast<size_t>(channels_ + c)];
      }
      total = global_count_;
    }
  }
  for (int64_t c = 0; c < channels_; ++c) {
    const float mean = mean_[static_cast<size_t>(c)];
    const float invstd = invstd_[static_cast<size_t>(c)];
    if (grad_input == nullptr) continue;
    float* dx = grad_input->data();
    const float w = weight_.value[c];
    if (!training_) {
      // The statistics are constants: dx = dy * weight * invstd.
      const float k = w * invstd;
      for (int64_t i = 0; i < n; ++i) {
        const float* gc = g + (i * channels_ + c) * plane;
        float* dc = dx + (i * channels_ + c) * plane;
        for (int64_t j = 0; j < plane; ++j) dc[j] = gc[j] * k;
      }
      continue;
    }
    // dx = weight * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)).
    const float k = w * invstd;
    const float mean_dy = static_cast<float>(sum_dy[static_cast<size_t>(c)] / total);
    const float mean_dy_xhat = static_cast<float>(sum_dy_xhat[static_cast<size_t>(c)] / total);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (i * channels_ + c) * plane;
      InputGradient(g + at, x + at, plane, mean, invstd, k, mean_dy, mean_dy_xhat, dx + at);
    }
  }
}

}  // namespace aidn::engine
