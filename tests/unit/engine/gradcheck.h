#ifndef AIDN_TESTS_UNIT_ENGINE_GRADCHECK_H_
#define AIDN_TESTS_UNIT_ENGINE_GRADCHECK_H_

// Helpers for the engine's gradient tests: random inputs that stay away from
// kinks, central finite differences in float32 with the loss summed in
// double, and a per-tensor relative error.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "worker/engine/tensor.h"

namespace aidn::engine::gradcheck {

// Uniform in ±[min_abs, max_abs] with random signs: never zero, never near
// ReLU's kink.
inline void FillRandom(Tensor* t, std::mt19937_64* rng, float min_abs = 0.05f,
                       float max_abs = 1.0f) {
  std::uniform_real_distribution<float> mag(min_abs, max_abs);
  std::bernoulli_distribution sign(0.5);
  for (int64_t i = 0; i < t->numel(); ++i) {
    const float m = mag(*rng);
    (*t)[i] = sign(*rng) ? m : -m;
  }
}

// sum(a * b) in double.
inline double Dot(const Tensor& a, const Tensor& b) {
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Central differences of `loss` with respect to values[i], i in `indices`.
// The step actually taken (after rounding to float) is the divisor.
inline std::vector<double> NumericGradient(float* values, const std::vector<int64_t>& indices,
                                           const std::function<double()>& loss, float eps = 1e-3f) {
  std::vector<double> grads;
  for (int64_t i : indices) {
    const float original = values[i];
    values[i] = original + eps;
    const double plus_at = values[i];
    const double plus = loss();
    values[i] = original - eps;
    const double minus_at = values[i];
    const double minus = loss();
    values[i] = original;
    grads.push_back((plus - minus) / (plus_at - minus_at));
  }
  return grads;
}

inline std::vector<double> Gather(const float* values, const std::vector<int64_t>& indices) {
  std::vector<double> out;
  for (int64_t i : indices) out.push_back(values[i]);
  return out;
}

// ||a - b|| / ||b|| (b the reference); infinity when b is all zero and a is not.
inline double RelativeError(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

inline std::vector<int64_t> AllIndices(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// The `k` entries of largest magnitude (where the gradient is well above the
// finite differences' rounding noise).
inline std::vector<int64_t> TopK(const float* g, int64_t n, int64_t k) {
  std::vector<int64_t> v = AllIndices(n);
  k = std::min(k, n);
  std::partial_sort(v.begin(), v.begin() + k, v.end(),
                    [g](int64_t a, int64_t b) { return std::fabs(g[a]) > std::fabs(g[b]); });
  v.resize(static_cast<size_t>(k));
  return v;
}

}  // namespace aidn::engine::gradcheck

#endif  // AIDN_TESTS_UNIT_ENGINE_GRADCHECK_H_
