#include "worker/engine/batchnorm.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log.h"
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

void BatchNorm2d::Forward(const Tensor& input, Tensor* output, bool training) {
  AIDN_CHECK(input.rank() == 4 && input.dim(1) == channels_)
      << Describe() << " got input " << input.ShapeString();
  const int64_t n = input.dim(0);
  const int64_t plane = input.dim(2) * input.dim(3);
  const int64_t count = n * plane;
  AIDN_CHECK(!training || count > 1)
      << Describe() << ": training needs more than one value per channel, got input "
      << input.ShapeString();
  EnsureShape(output, input.shape());
  input_ = &input;
  training_ = training;
  const float* x = input.data();
  float* y = output->data();
  for (int64_t c = 0; c < channels_; ++c) {
    double mean = running_mean_.value[c];
    double var = running_var_.value[c];
    if (training) {
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float* xc = x + (i * channels_ + c) * plane;
        for (int64_t j = 0; j < plane; ++j) sum += xc[j];
      }
      mean = sum / static_cast<double>(count);
      double squares = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float* xc = x + (i * channels_ + c) * plane;
        for (int64_t j = 0; j < plane; ++j) {
          const double d = xc[j] - mean;
          squares += d * d;
        }
      }
      var = squares / static_cast<double>(count);
      const double unbiased = squares / static_cast<double>(count - 1);
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
  for (int64_t c = 0; c < channels_; ++c) {
    const float mean = mean_[static_cast<size_t>(c)];
    const float invstd = invstd_[static_cast<size_t>(c)];
    // sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd.
    double sum_dy = 0;
    double sum_dy_xhat = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* xc = x + (i * channels_ + c) * plane;
      const float* gc = g + (i * channels_ + c) * plane;
      for (int64_t j = 0; j < plane; ++j) {
        sum_dy += gc[j];
        sum_dy_xhat += static_cast<double>(gc[j]) * ((xc[j] - mean) * invstd);
      }
    }
    weight_.grad.data()[c] += static_cast<float>(sum_dy_xhat);
    bias_.grad.data()[c] += static_cast<float>(sum_dy);
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
    const float mean_dy = static_cast<float>(sum_dy / count);
    const float mean_dy_xhat = static_cast<float>(sum_dy_xhat / count);
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
