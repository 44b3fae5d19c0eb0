#include "worker/engine/batchnorm.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/layers.h"

namespace aidn::engine {

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
    for (int64_t i = 0; i < n; ++i) {
      const float* xc = x + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) sum += xc[j];
    }
    const double m = *count > 0 ? sum / *count : 0.0;
    double squares = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* xc = x + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) {
        const double d = xc[j] - m;
        squares += d * d;
      }
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
      rm = static_cast<float>((1.0 - momentum_) * rm + momentum_ * mean);
      rv = static_cast<float>((1.0 - momentum_) * rv + momentum_ * unbiased);
    }
    const float invstd = static_cast<float>(1.0 / std::sqrt(var + eps_));
    mean_[static_cast<size_t>(c)] = static_cast<float>(mean);
    invstd_[static_cast<size_t>(c)] = invstd;
    // (x - mean) first, as torch: a value at the mean gives the bias
    // exactly, whatever the compiler contracts.
    const float scale = weight_.value[c] * invstd;
    const float shift = bias_.value[c];
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
      const float* xc = x + (i * channels_ + c) * plane;
      float* yc = y + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) yc[j] = (xc[j] - m) * scale + shift;
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
      const float* xc = x + (i * channels_ + c) * plane;
      const float* gc = g + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) {
        sum_dy[static_cast<size_t>(c)] += gc[j];
        sum_dy_xhat[static_cast<size_t>(c)] +=
            static_cast<double>(gc[j]) * ((xc[j] - mean) * invstd);
      }
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
      const float* xc = x + (i * channels_ + c) * plane;
      const float* gc = g + (i * channels_ + c) * plane;
      float* dc = dx + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) {
        const float xhat = (xc[j] - mean) * invstd;
        dc[j] = k * (gc[j] - mean_dy - xhat * mean_dy_xhat);
      }
    }
  }
}

}  // namespace aidn::engine
