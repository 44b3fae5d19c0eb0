#ifndef AIDN_TESTS_GPU_GPU_TEST_UTIL_H_
#define AIDN_TESTS_GPU_GPU_TEST_UTIL_H_

// Helpers for the GPU engine's tests: a context or a skip, random tensors
// (never zeros), and the error measure every comparison reports.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/device.h"
#include "worker/engine/tensor.h"

namespace aidn::engine::cuda::testing {

// Null when this machine has no GPU (the caller skips with *why).
inline std::unique_ptr<GpuContext> MakeContext(const GpuContextOptions& options, std::string* why) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) {
    *why = "no CUDA device: " + inventory.gpu_note;
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<GpuContext>> ctx = GpuContext::Create(options);
  // A GPU is there: failing to use it is a failure, not a skip.
  EXPECT_TRUE(ctx.ok()) << ctx.status();
  if (!ctx.ok()) {
    *why = ctx.status().ToString();
    return nullptr;
  }
  return std::move(ctx).value();
}

// In a TEST body: `ctx` is a std::unique_ptr<GpuContext>, or the test skips.
#define AIDN_GPU_CONTEXT_OR_SKIP(ctx, options)                           \
  std::string ctx##_why;                                                 \
  std::unique_ptr<::aidn::engine::cuda::GpuContext> ctx =                \
      ::aidn::engine::cuda::testing::MakeContext((options), &ctx##_why); \
  if (ctx == nullptr) GTEST_SKIP() << ctx##_why

// Uniform in [-scale, scale] with no element exactly zero.
inline Tensor RandomTensor(std::vector<int64_t> shape, uint64_t seed, float scale = 1.0f) {
  Tensor t(std::move(shape));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v = u(rng);
    while (v == 0.0f) v = u(rng);
    t[i] = v;
  }
  return t;
}

// max_i |got_i - want_i| / max_i |want_i|: the largest error relative to
// the reference's scale (elementwise relative errors are meaningless for
// sums that cancel to near zero). 0 when both are all zero.
inline double MaxRelError(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return INFINITY;
  double max_diff = 0;
  double max_ref = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(d)) return INFINITY;
    max_diff = std::max(max_diff, d);
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  if (max_ref == 0) return max_diff;
  return max_diff / max_ref;
}

// ||got - want|| / ||want|| (L2 over the whole tensor): for gradients of
// deep networks, where an activation at the ReLU's edge that rounding
// moves across it changes single elements a lot and the whole little.
inline double RelL2Error(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return INFINITY;
  double diff = 0;
  double ref = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  if (std::isnan(diff)) return INFINITY;
  return ref == 0 ? std::sqrt(diff) : std::sqrt(diff / ref);
}

inline Tensor ToHost(GpuContext* ctx, const GpuTensor& t) {
  absl::StatusOr<Tensor> host = t.ToHost(ctx);
  EXPECT_TRUE(host.ok()) << host.status();
  if (!host.ok()) return Tensor();
  return std::move(host).value();
}

inline GpuTensor ToDevice(GpuContext* ctx, const Tensor& t) {
  absl::StatusOr<GpuTensor> dev = GpuTensor::FromHost(ctx, t);
  EXPECT_TRUE(dev.ok()) << dev.status();
  if (!dev.ok()) return GpuTensor();
  return std::move(dev).value();
}

// Prints and checks one comparison.
inline void ExpectClose(const std::string& what, const Tensor& got, const Tensor& want,
                        double tolerance) {
  const double err = MaxRelError(got, want);
  std::printf("  %-40s max rel error %.3g (tolerance %.0e)\n", what.c_str(), err, tolerance);
  EXPECT_LE(err, tolerance) << what;
}

}  // namespace aidn::engine::cuda::testing

#endif  // AIDN_TESTS_GPU_GPU_TEST_UTIL_H_
