// The CPU kernels called directly: the 2x2 max-pool fast path against the
// general one, im2col against its adjoint, the blocked sum against a
// plain one, and the dropout mask's values. (The layers' tests cover them
// through Linear, Conv2d, MaxPool2d and Dropout.)

#include "worker/engine/cpu_kernels.h"

#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace aidn::engine::cpu {
namespace {

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  // Few distinct values: pooling windows with ties.
  std::uniform_int_distribution<int> pick(-4, 4);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(pick(rng)) * 0.5f;
  return v;
}

TEST(CpuKernels, MaxPool2x2PlaneMatchesTheGeneralPoolTiesAndOddSizesIncluded) {
  for (const auto& [h, w] : std::vector<std::pair<int64_t, int64_t>>{
           {2, 2}, {4, 8}, {5, 7}, {9, 18}, {28, 28}, {3, 11}}) {
    SCOPED_TRACE(testing::Message() << h << "x" << w);
    const std::vector<float> x = Random(static_cast<size_t>(h * w), h * 100 + w);
    const int64_t oh = h / 2;
    const int64_t ow = w / 2;
    std::vector<float> fast(oh * ow), general(oh * ow);
    std::vector<int32_t> fast_arg(oh * ow), general_arg(oh * ow);
    MaxPool2x2Plane(x.data(), h, w, fast.data(), fast_arg.data());
    MaxPoolPlane(x.data(), w, 2, 2, oh, ow, general.data(), general_arg.data());
    EXPECT_EQ(fast, general);
    EXPECT_EQ(fast_arg, general_arg);

    const std::vector<float> g = Random(static_cast<size_t>(oh * ow), 7);
    std::vector<float> fast_gx(h * w, -1.0f), general_gx(h * w, 0.0f);
    MaxPool2x2PlaneBackward(g.data(), nullptr, fast_arg.data(), h, w, fast_gx.data());
    MaxPoolPlaneBackward(g.data(), general_arg.data(), oh * ow, general_gx.data());
    EXPECT_EQ(fast_gx, general_gx);
  }
}

TEST(CpuKernels, Col2ImIsTheAdjointOfIm2Col) {
  for (const ConvShape& s : {ConvShape{2, 5, 6, 3, 1, 0, 3, 4}, ConvShape{3, 7, 7, 3, 2, 1, 4, 4},
                             ConvShape{1, 4, 9, 2, 1, 1, 5, 10}}) {
    const int64_t rows = s.channels * s.kernel * s.kernel;
    const int64_t cols = s.out_height * s.out_width;
    const std::vector<float> x = Random(static_cast<size_t>(s.channels * s.height * s.width), 1);
    const std::vector<float> c = Random(static_cast<size_t>(rows * cols), 2);
    std::vector<float> columns(rows * cols, -1.0f);
    Im2Col(x.data(), s, columns.data(), cols);
    std::vector<float> back(x.size(), 0.0f);
    Col2Im(c.data(), cols, s, back.data());
    // <Im2Col x, c> == <x, Col2Im c>, exact in double for these values.
    double lhs = 0.0, rhs = 0.0;
    for (size_t i = 0; i < columns.size(); ++i) lhs += double{columns[i]} * c[i];
    for (size_t i = 0; i < x.size(); ++i) rhs += double{x[i]} * back[i];
    EXPECT_EQ(lhs, rhs);
  }
}

// Im2Col and Col2Im against their definitions, element by element: the
// general path (stride 2, no padding, a kernel wider than the padding) and
// stride 1 with "same" padding (its contiguous-run path: 3x3, 5x5, 1x1,
// planes of one row or column), several samples' columns side by side
// (ld > the plane) and a tail of the buffer left alone.
TEST(CpuKernels, Im2ColAndCol2ImFollowTheirDefinitions) {
  for (const ConvShape& s : {ConvShape{2, 5, 6, 3, 1, 0, 3, 4}, ConvShape{3, 7, 7, 3, 2, 1, 4, 4},
                             ConvShape{1, 4, 9, 2, 1, 1, 5, 10}, ConvShape{3, 6, 5, 3, 1, 1, 6, 5},
                             ConvShape{2, 7, 9, 5, 1, 2, 7, 9}, ConvShape{4, 3, 3, 1, 1, 0, 3, 3},
                             ConvShape{2, 1, 4, 3, 1, 1, 1, 4}, ConvShape{2, 4, 1, 3, 1, 1, 4, 1},
                             ConvShape{1, 2, 2, 3, 1, 1, 2, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << "C " << s.channels << " " << s.height << "x" << s.width << " k " << s.kernel
                 << " stride " << s.stride << " pad " << s.padding);
    const int64_t k = s.kernel;
    const int64_t plane = s.out_height * s.out_width;
    const int64_t ld = plane + 3;  // a second sample's columns would start there
    const int64_t rows = s.channels * k * k;
    const std::vector<float> x = Random(static_cast<size_t>(s.channels * s.height * s.width), 3);
    std::vector<float> columns(static_cast<size_t>(rows * ld), -7.0f);
    Im2Col(x.data(), s, columns.data(), ld);
    const std::vector<float> g = Random(static_cast<size_t>(rows * ld), 4);
    std::vector<float> gx(x.size(), 0.5f);
    Col2Im(g.data(), ld, s, gx.data());
    std::vector<double> want_gx(x.size(), 0.5);
    for (int64_t c = 0; c < s.channels; ++c) {
      for (int64_t ki = 0; ki < k; ++ki) {
        for (int64_t kj = 0; kj < k; ++kj) {
          const int64_t row = (c * k + ki) * k + kj;
          for (int64_t oh = 0; oh < s.out_height; ++oh) {
            for (int64_t ow = 0; ow < s.out_width; ++ow) {
              const int64_t ih = oh * s.stride - s.padding + ki;
              const int64_t iw = ow * s.stride - s.padding + kj;
              const bool inside = ih >= 0 && ih < s.height && iw >= 0 && iw < s.width;
              const int64_t at = (c * s.height + ih) * s.width + iw;
              const size_t col = static_cast<size_t>(row * ld + oh * s.out_width + ow);
              ASSERT_EQ(columns[col], inside ? x[static_cast<size_t>(at)] : 0.0f)
                  << "row " << row << " (" << oh << ", " << ow << ")";
              if (inside) want_gx[static_cast<size_t>(at)] += g[col];
            }
          }
          for (int64_t t = plane; t < ld; ++t) {
            ASSERT_EQ(columns[static_cast<size_t>(row * ld + t)], -7.0f) << "past row " << row;
          }
        }
      }
    }
    for (size_t i = 0; i < gx.size(); ++i) EXPECT_NEAR(gx[i], want_gx[i], 1e-5) << i;
  }
}

TEST(CpuKernels, SumKernelAddsEveryElementOnce) {
  for (int64_t n : {0, 1, 15, 16, 17, 100, 1023}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7);
    float want = 0.0f;
    for (float v : x) want += v;  // exact: small integers
    EXPECT_EQ(SumKernel(x.data(), n), want) << n;
  }
}

TEST(CpuKernels, DropoutMaskIsZeroOrTheInverseKeepProbability) {
  std::mt19937_64 rng(3);
  std::vector<float> m(10001);
  DropoutMask(rng, 0.25, m.data(), static_cast<int64_t>(m.size()));
  int64_t kept = 0;
  for (float v : m) {
    ASSERT_TRUE(v == 0.0f || v == static_cast<float>(1.0 / 0.75)) << v;
    kept += v != 0.0f;
  }
  // 7501 expected, sd ~43.
  EXPECT_GT(kept, 7000);
  EXPECT_LT(kept, 8000);
}

}  // namespace
}  // namespace aidn::engine::cpu
