#include "worker/engine/loss.h"

#include <algorithm>
#include <cmath>

#include "common/log.h"
#include "worker/engine/layers.h"

namespace aidn::engine {

double SoftmaxCrossEntropy(const Tensor& logits, const std::vector<int32_t>& labels,
                           Tensor* grad_logits, double grad_scale) {
  AIDN_CHECK(logits.rank() == 2) << "logits must be [N, classes], got " << logits.ShapeString();
  const int64_t n = logits.dim(0);
  const int64_t classes = logits.dim(1);
  AIDN_CHECK(static_cast<int64_t>(labels.size()) == n)
      << labels.size() << " labels for logits " << logits.ShapeString();
  if (grad_logits != nullptr) EnsureShape(grad_logits, {n, classes});
  if (n == 0) return 0.0;
  const float* x = logits.data();
  const double scale = grad_scale / static_cast<double>(n);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t label = labels[static_cast<size_t>(i)];
    AIDN_CHECK(label >= 0 && label < classes)
        << "label " << label << " not in [0, " << classes << ")";
    const float* row = x + i * classes;
    const float max = *std::max_element(row, row + classes);
    // Log-sum-exp around the row maximum: no overflow, and the largest term is 1.
    double sum = 0.0;
    for (int64_t j = 0; j < classes; ++j) sum += std::exp(static_cast<double>(row[j] - max));
    const double log_sum = std::log(sum);
    total += log_sum - static_cast<double>(row[label] - max);
    if (grad_logits != nullptr) {
      float* g = grad_logits->data() + i * classes;
      const double inv = 1.0 / sum;
      for (int64_t j = 0; j < classes; ++j) {
        const double softmax = std::exp(static_cast<double>(row[j] - max)) * inv;
        g[j] = static_cast<float>((softmax - (j == label ? 1.0 : 0.0)) * scale);
      }
    }
  }
  return total / static_cast<double>(n);
}

int64_t CountCorrect(const Tensor& logits, const std::vector<int32_t>& labels) {
  AIDN_CHECK(logits.rank() == 2) << "logits must be [N, classes], got " << logits.ShapeString();
  const int64_t n = logits.dim(0);
  const int64_t classes = logits.dim(1);
  AIDN_CHECK(static_cast<int64_t>(labels.size()) == n)
      << labels.size() << " labels for logits " << logits.ShapeString();
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data() + i * classes;
    // max_element returns the first of equal maxima.
    const int64_t best = std::max_element(row, row + classes) - row;
    if (best == labels[static_cast<size_t>(i)]) ++correct;
  }
  return correct;
}

}  // namespace aidn::engine
