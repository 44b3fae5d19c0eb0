#include "worker/engine/gpt_kernels.h"

#include <cmath>
#include <numbers>
#include <random>

#include "worker/engine/cpu_kernels.h"
#include "worker/engine/gemm.h"

namespace aidn::engine::gpt_kernels {

void LayerNormForward(const float* x, const float* w, const float* b, int64_t rows, int64_t cols,
                      float* out, float* mean, float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c];
    const float m = static_cast<float>(sum / static_cast<double>(cols));
    double var = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double d = static_cast<double>(xr[c]) - m;
      var += d * d;
    }
    const float s =
        static_cast<float>(1.0 / std::sqrt(var / static_cast<double>(cols) + kLayerNormEps));
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float n = (xr[c] - m) * s;
      o[c] = b != nullptr ? n * w[c] + b[c] : n * w[c];
    }
    mean[r] = m;
    rstd[r] = s;
  }
}

void LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                       const float* rstd, int64_t rows, int64_t cols, float* dx, float* dw,
                       float* db) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = dout + r * cols;
    const float* xr = x + r * cols;
    const float m = mean[r];
    const float s = rstd[r];
    double dnorm_mean = 0.0;
    double dnorm_norm_mean = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const float n = (xr[c] - m) * s;
      const float dn = g[c] * w[c];
      dnorm_mean += dn;
      dnorm_norm_mean += static_cast<double>(dn) * n;
    }
    const float a = static_cast<float>(dnorm_mean / static_cast<double>(cols));
    const float bb = static_cast<float>(dnorm_norm_mean / static_cast<double>(cols));
    float* d = dx + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float n = (xr[c] - m) * s;
      const float dn = g[c] * w[c];
      d[c] += (dn - a - n * bb) * s;
      dw[c] += g[c] * n;
      if (db != nullptr) db[c] += g[c];
    }
  }
}

void LinearForward(const float* x, const float* w, const float* b, int64_t rows, int64_t in,
                   int64_t out, float* y) {
  Sgemm(false, false, rows, out, in, 1.0f, x, in, w, out, 0.0f, y, out);
  if (b == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) cpu::AccumulateKernel(b, y + r * out, out);
}

void LinearBackward(const float* dy, const float* x, const float* w, int64_t rows, int64_t in,
                    int64_t out, float* dx, float* dw, float* db) {
  if (dx != nullptr) Sgemm(false, true, rows, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  Sgemm(true, false, in, out, rows, 1.0f, x, in, dy, out, 1.0f, dw, out);
  if (db == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) cpu::AccumulateKernel(dy + r * out, db, out);
}

// tanh(sqrt(2 / pi) (x + 0.044715 x^3)).
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

void GeluForward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = std::tanh(kGeluScale * (v + kGeluCube * v * v * v));
    y[i] = 0.5f * v * (1.0f + t);
  }
}

void GeluBackward(const float* x, float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = std::tanh(kGeluScale * (v + kGeluCube * v * v * v));
    const float dt = (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCube * v * v);
    g[i] *= 0.5f * (1.0f + t) + 0.5f * v * dt;
  }
}

void FillNormal(uint64_t seed, double std, float* x, int64_t n) {
  std::mt19937_64 rng(seed);
  const double two_pi = 2.0 * std::numbers::pi;
  auto uniform = [&rng]() { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (int64_t i = 0; i < n; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    const double angle = two_pi * uniform();
    x[i] = static_cast<float>(std * radius * std::cos(angle));
    if (i + 1 < n) x[i + 1] = static_cast<float>(std * radius * std::sin(angle));
  }
}

}  // namespace aidn::engine::gpt_kernels
