#include "worker/engine/layers.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/engine/gradcheck.h"

namespace aidn::engine {
namespace {

using gradcheck::AllIndices;
using gradcheck::Dot;
using gradcheck::FillRandom;
using gradcheck::Gather;
using gradcheck::NumericGradient;
using gradcheck::RelativeError;

constexpr double kTolerance = 1e-2;

void SetValues(Tensor* t, const std::vector<float>& values) {
  ASSERT_EQ(t->numel(), static_cast<int64_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) (*t)[static_cast<int64_t>(i)] = values[i];
}

// Checks the layer's input and parameter gradients for L = sum(output * R)
// (R random) against central differences. `seed` re-seeds the layer before
// every Forward, so a dropout mask is the same in each evaluation.
void ExpectGradientsMatchFiniteDifferences(Layer* layer, Tensor* input, bool training,
                                           uint64_t seed = 1) {
  std::mt19937_64 rng(1234);
  Tensor output;
  layer->SetSeed(seed);
  layer->Forward(*input, &output, training);
  Tensor projection(output.shape());
  FillRandom(&projection, &rng, 0.1f);
  for (Parameter* p : layer->Parameters()) p->grad.Zero();
  Tensor grad_input;
  layer->Backward(projection, &grad_input);
  ASSERT_EQ(grad_input.shape(), input->shape());

  auto loss = [&] {
    Tensor out;
    layer->SetSeed(seed);
    layer->Forward(*input, &out, training);
    return Dot(out, projection);
  };
  const std::vector<int64_t> in_idx = AllIndices(input->numel());
  std::vector<double> numeric = NumericGradient(input->data(), in_idx, loss);
  std::vector<double> analytic = Gather(grad_input.data(), in_idx);
  double norm = 0.0;
  for (double v : numeric) norm += v * v;
  ASSERT_GT(norm, 1e-6) << "a degenerate check: the input gradient is zero";
  EXPECT_LT(RelativeError(analytic, numeric), kTolerance) << layer->Describe() << " input";

  for (Parameter* p : layer->Parameters()) {
    const std::vector<int64_t> idx = AllIndices(p->value.numel());
    numeric = NumericGradient(p->value.data(), idx, loss);
    analytic = Gather(p->grad.data(), idx);
    EXPECT_LT(RelativeError(analytic, numeric), kTolerance) << layer->Describe() << " " << p->name;
  }
}

// ------------------------------------------------------------------ Linear

TEST(Linear, ForwardMatchesAHandComputedCase) {
  Linear linear(3, 2);
  SetValues(&linear.weight().value, {1, 2, 3, 4, 5, 6});
  SetValues(&linear.bias().value, {0.5f, -1.0f});
  Tensor x({2, 3});
  SetValues(&x, {1, 0, -1, 2, 1, 0});
  Tensor y;
  linear.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[2, 2]");
  EXPECT_FLOAT_EQ(y[0], -1.5f);
  EXPECT_FLOAT_EQ(y[1], -3.0f);
  EXPECT_FLOAT_EQ(y[2], 4.5f);
  EXPECT_FLOAT_EQ(y[3], 12.0f);
}

TEST(Linear, BackwardComputesHandCheckedGradients) {
  Linear linear(3, 2);
  SetValues(&linear.weight().value, {1, 2, 3, 4, 5, 6});
  Tensor x({2, 3});
  SetValues(&x, {1, 0, -1, 2, 1, 0});
  Tensor y;
  linear.Forward(x, &y, true);
  Tensor g({2, 2});
  SetValues(&g, {1, 0, 0, 2});
  Tensor gx;
  linear.Backward(g, &gx);
  // dx = g W
  const std::vector<float> want_gx = {1, 2, 3, 8, 10, 12};
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(gx[i], want_gx[static_cast<size_t>(i)]) << i;
  // dW = g^T x
  const std::vector<float> want_gw = {1, 0, -1, 4, 2, 0};
  for (int i = 0; i < 6; ++i) {
    EXPECT_FLOAT_EQ(linear.weight().grad[i], want_gw[static_cast<size_t>(i)]) << i;
  }
  EXPECT_FLOAT_EQ(linear.bias().grad[0], 1.0f);
  EXPECT_FLOAT_EQ(linear.bias().grad[1], 2.0f);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(1);
  Linear linear(7, 5);
  FillRandom(&linear.weight().value, &rng);
  FillRandom(&linear.bias().value, &rng);
  Tensor x({4, 7});
  FillRandom(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&linear, &x, true);
}

TEST(Linear, BackwardAccumulatesIntoParameterGradients) {
  std::mt19937_64 rng(2);
  Linear linear(5, 3);
  FillRandom(&linear.weight().value, &rng);
  Tensor x({4, 5});
  FillRandom(&x, &rng);
  Tensor y;
  linear.Forward(x, &y, true);
  Tensor g(y.shape());
  FillRandom(&g, &rng);
  linear.Backward(g, nullptr);
  Tensor once_w = linear.weight().grad.Clone();
  Tensor once_b = linear.bias().grad.Clone();
  linear.Backward(g, nullptr);
  for (int64_t i = 0; i < once_w.numel(); ++i) {
    EXPECT_FLOAT_EQ(linear.weight().grad[i], 2 * once_w[i]);
  }
  for (int64_t i = 0; i < once_b.numel(); ++i) {
    EXPECT_FLOAT_EQ(linear.bias().grad[i], 2 * once_b[i]);
  }
}

TEST(Linear, NamesItsParametersLikeTorch) {
  Linear linear(784, 256);
  std::vector<Parameter*> params = linear.Parameters();
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0]->name, "weight");
  EXPECT_EQ(params[0]->value.ShapeString(), "[256, 784]");
  EXPECT_EQ(params[1]->name, "bias");
  EXPECT_EQ(params[1]->value.ShapeString(), "[256]");
  EXPECT_EQ(linear.Describe(), "Linear(in_features=784, out_features=256, bias=True)");
}

// Fused layers must give exactly what the layers one by one give: the same
// float operations in the same order, only without the passes in between.
void ExpectSameTensor(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got[i], want[i]) << what << " at " << i;
}

void CopyParameters(Layer* from, Layer* to) {
  std::vector<Parameter*> a = from->Parameters();
  std::vector<Parameter*> b = to->Parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    std::copy(a[i]->value.data(), a[i]->value.data() + a[i]->value.numel(), b[i]->value.data());
  }
}

TEST(Linear, FusedReluMatchesLinearThenReluExactly) {
  std::mt19937_64 rng(21);
  Linear fused(9, 6);
  Linear plain(9, 6);
  FillRandom(&fused.weight().value, &rng);
  FillRandom(&fused.bias().value, &rng);
  CopyParameters(&fused, &plain);
  ReLU relu;
  ASSERT_TRUE(fused.Fuse(relu));
  EXPECT_FALSE(fused.Fuse(relu)) << "a second ReLU is not fused";
  EXPECT_FALSE(plain.Fuse(MaxPool2d(2)));

  Tensor x({5, 9});
  FillRandom(&x, &rng);
  Tensor y_fused, y_plain, y_relu;
  fused.Forward(x, &y_fused, true);
  plain.Forward(x, &y_plain, true);
  relu.Forward(y_plain, &y_relu, true);
  ExpectSameTensor(y_fused, y_relu, "output");
  int64_t zeros = 0;
  for (int64_t i = 0; i < y_fused.numel(); ++i) zeros += y_fused[i] == 0.0f;
  EXPECT_GT(zeros, 0) << "no unit was cut off: a weak check";

  Tensor g(y_fused.shape());
  FillRandom(&g, &rng);
  Tensor gx_fused, g_relu, gx_plain;
  fused.Backward(g, &gx_fused);
  relu.Backward(g, &g_relu);
  plain.Backward(g_relu, &gx_plain);
  ExpectSameTensor(gx_fused, gx_plain, "input gradient");
  ExpectSameTensor(fused.weight().grad, plain.weight().grad, "weight gradient");
  ExpectSameTensor(fused.bias().grad, plain.bias().grad, "bias gradient");
}

TEST(Linear, FusedReluMatchesFiniteDifferences) {
  std::mt19937_64 rng(22);
  Linear linear(7, 5);
  FillRandom(&linear.weight().value, &rng);
  FillRandom(&linear.bias().value, &rng);
  ASSERT_TRUE(linear.Fuse(ReLU()));
  Tensor x({4, 7});
  FillRandom(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&linear, &x, true);
}

// ------------------------------------------------------------------ ReLU

TEST(ReLU, ZeroesNegativesAndPassesGradientWherePositive) {
  ReLU relu;
  Tensor x({1, 4});
  SetValues(&x, {-2, 3, -0.5f, 1});
  Tensor y;
  relu.Forward(x, &y, true);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 3.0f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 1.0f);
  Tensor g({1, 4});
  SetValues(&g, {10, 20, 30, 40});
  Tensor gx;
  relu.Backward(g, &gx);
  EXPECT_EQ(gx[0], 0.0f);
  EXPECT_EQ(gx[1], 20.0f);
  EXPECT_EQ(gx[2], 0.0f);
  EXPECT_EQ(gx[3], 40.0f);
}

TEST(ReLU, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(3);
  ReLU relu;
  Tensor x({3, 2, 4, 4});
  FillRandom(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&relu, &x, true);
}

// ------------------------------------------------------------------ Conv2d

TEST(Conv2d, ForwardMatchesAHandComputedCase) {
  Conv2d conv(1, 1, 2);
  SetValues(&conv.weight().value, {1, 2, 3, 4});
  SetValues(&conv.bias().value, {0.5f});
  Tensor x({1, 1, 3, 3});
  SetValues(&x, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  Tensor y;
  conv.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[1, 1, 2, 2]");
  EXPECT_FLOAT_EQ(y[0], 37.5f);
  EXPECT_FLOAT_EQ(y[1], 47.5f);
  EXPECT_FLOAT_EQ(y[2], 67.5f);
  EXPECT_FLOAT_EQ(y[3], 77.5f);
}

TEST(Conv2d, ForwardWithStrideAndPaddingMatchesAHandComputedCase) {
  Conv2d conv(1, 1, 2, /*stride=*/2, /*padding=*/1);
  SetValues(&conv.weight().value, {1, 2, 3, 4});
  SetValues(&conv.bias().value, {0.5f});
  Tensor x({1, 1, 3, 3});
  SetValues(&x, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  Tensor y;
  conv.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[1, 1, 2, 2]");
  EXPECT_FLOAT_EQ(y[0], 4.5f);
  EXPECT_FLOAT_EQ(y[1], 18.5f);
  EXPECT_FLOAT_EQ(y[2], 36.5f);
  EXPECT_FLOAT_EQ(y[3], 77.5f);
}

TEST(Conv2d, SeparatesSamplesAndChannels) {
  // Two samples, two input channels, two filters picking one channel each.
  Conv2d conv(2, 2, 1);
  SetValues(&conv.weight().value, {1, 0, 0, 10});
  SetValues(&conv.bias().value, {0, 1});
  Tensor x({2, 2, 1, 2});
  SetValues(&x, {1, 2, 3, 4, 5, 6, 7, 8});
  Tensor y;
  conv.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[2, 2, 1, 2]");
  const std::vector<float> want = {1, 2, 31, 41, 5, 6, 71, 81};
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(y[i], want[static_cast<size_t>(i)]) << i;
}

TEST(Conv2d, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(4);
  Conv2d conv(2, 3, 3);
  FillRandom(&conv.weight().value, &rng);
  FillRandom(&conv.bias().value, &rng);
  Tensor x({2, 2, 6, 5});
  FillRandom(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&conv, &x, true);
}

TEST(Conv2d, BackwardWithStrideTwoAndPaddingOneMatchesFiniteDifferences) {
  std::mt19937_64 rng(5);
  Conv2d conv(2, 3, 3, /*stride=*/2, /*padding=*/1);
  FillRandom(&conv.weight().value, &rng);
  FillRandom(&conv.bias().value, &rng);
  Tensor x({2, 2, 7, 6});
  FillRandom(&x, &rng);
  Tensor y;
  conv.Forward(x, &y, true);
  EXPECT_EQ(y.ShapeString(), "[2, 3, 4, 3]");
  ExpectGradientsMatchFiniteDifferences(&conv, &x, true);
}

// Direct convolution by the definition, in double.
std::vector<double> NaiveConv(const Tensor& x, Conv2d& conv, int64_t kernel, int64_t stride,
                              int64_t padding) {
  const Tensor& w = conv.weight().value;
  const Tensor& b = conv.bias().value;
  const int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3), o = w.dim(0);
  const int64_t oh = (h + 2 * padding - kernel) / stride + 1;
  const int64_t ow = (wd + 2 * padding - kernel) / stride + 1;
  std::vector<double> y;
  for (int64_t in = 0; in < n; ++in) {
    for (int64_t io = 0; io < o; ++io) {
      for (int64_t i = 0; i < oh; ++i) {
        for (int64_t j = 0; j < ow; ++j) {
          double sum = b[io];
          for (int64_t ic = 0; ic < c; ++ic) {
            for (int64_t ki = 0; ki < kernel; ++ki) {
              for (int64_t kj = 0; kj < kernel; ++kj) {
                const int64_t r = i * stride - padding + ki;
                const int64_t q = j * stride - padding + kj;
                if (r < 0 || r >= h || q < 0 || q >= wd) continue;
                sum += static_cast<double>(x[((in * c + ic) * h + r) * wd + q]) *
                       w[((io * c + ic) * kernel + ki) * kernel + kj];
              }
            }
          }
          y.push_back(sum);
        }
      }
    }
  }
  return y;
}

TEST(Conv2d, MatchesTheDefinitionAndFiniteDifferencesForEveryStrideAndPadding) {
  struct Geometry {
    int64_t kernel, stride, padding;
  };
  for (Geometry g : {Geometry{3, 1, 1}, Geometry{3, 2, 0}, Geometry{2, 3, 2}, Geometry{1, 1, 0},
                     Geometry{3, 1, 2}}) {
    SCOPED_TRACE(testing::Message()
                 << "kernel " << g.kernel << " stride " << g.stride << " padding " << g.padding);
    std::mt19937_64 rng(static_cast<uint64_t>(g.kernel * 100 + g.stride * 10 + g.padding));
    Conv2d conv(2, 2, g.kernel, g.stride, g.padding);
    FillRandom(&conv.weight().value, &rng);
    FillRandom(&conv.bias().value, &rng);
    Tensor x({2, 2, 5, 6});
    FillRandom(&x, &rng);
    Tensor y;
    conv.Forward(x, &y, true);
    const std::vector<double> want = NaiveConv(x, conv, g.kernel, g.stride, g.padding);
    ASSERT_EQ(y.numel(), static_cast<int64_t>(want.size()));
    EXPECT_LT(RelativeError(std::vector<double>(y.data(), y.data() + y.numel()), want), 1e-6);
    ExpectGradientsMatchFiniteDifferences(&conv, &x, true);
  }
}

TEST(Conv2d, BackwardAccumulatesIntoParameterGradients) {
  std::mt19937_64 rng(6);
  Conv2d conv(1, 2, 3);
  FillRandom(&conv.weight().value, &rng);
  Tensor x({2, 1, 5, 5});
  FillRandom(&x, &rng);
  Tensor y;
  conv.Forward(x, &y, true);
  Tensor g(y.shape());
  FillRandom(&g, &rng);
  conv.Backward(g, nullptr);
  Tensor once_w = conv.weight().grad.Clone();
  Tensor once_b = conv.bias().grad.Clone();
  conv.Backward(g, nullptr);
  for (int64_t i = 0; i < once_w.numel(); ++i) {
    EXPECT_FLOAT_EQ(conv.weight().grad[i], 2 * once_w[i]);
  }
  for (int64_t i = 0; i < once_b.numel(); ++i) {
    EXPECT_FLOAT_EQ(conv.bias().grad[i], 2 * once_b[i]);
  }
}

// Output planes of at least 256 take the per-sample form (one GEMM per
// sample, straight into NCHW); the tests above use small planes, the
// batched form.
TEST(Conv2d, PerSampleFormMatchesTheDefinitionAndFiniteDifferences) {
  struct Geometry {
    int64_t size, kernel, stride, padding;
  };
  // Output planes 16x16, 17x17 (stride 1, padding 1), 16x16 (stride 2) and
  // 16x16 from a 1x1 kernel (the input is the columns).
  for (Geometry g : {Geometry{18, 3, 1, 0}, Geometry{17, 3, 1, 1}, Geometry{33, 3, 2, 1},
                     Geometry{16, 1, 1, 0}}) {
    SCOPED_TRACE(testing::Message()
                 << "size " << g.size << " stride " << g.stride << " padding " << g.padding);
    std::mt19937_64 rng(static_cast<uint64_t>(g.size));
    Conv2d conv(2, 3, g.kernel, g.stride, g.padding);
    FillRandom(&conv.weight().value, &rng);
    FillRandom(&conv.bias().value, &rng);
    Tensor x({2, 2, g.size, g.size});
    FillRandom(&x, &rng);
    Tensor y;
    conv.Forward(x, &y, true);
    ASSERT_GE(y.dim(2) * y.dim(3), 256);
    const std::vector<double> want = NaiveConv(x, conv, g.kernel, g.stride, g.padding);
    ASSERT_EQ(y.numel(), static_cast<int64_t>(want.size()));
    EXPECT_LT(RelativeError(std::vector<double>(y.data(), y.data() + y.numel()), want), 1e-6);
    ExpectGradientsMatchFiniteDifferences(&conv, &x, true);
  }
}

// Conv2d with a fused ReLU and/or MaxPool2d(2) against the same layers one
// by one, in both forms (small and large planes), with odd sizes (the pool
// drops a row and a column) and with ties in the pool windows (ReLU zeros).
TEST(Conv2d, FusedReluAndPoolMatchTheLayersOneByOneExactly) {
  struct Case {
    int64_t size;  // input height and width
    bool relu;
    bool pool;
  };
  for (Case c :
       {Case{9, true, true}, Case{20, true, true}, Case{21, true, true}, Case{10, true, false},
        Case{19, true, false}, Case{9, false, true}, Case{20, false, true}}) {
    SCOPED_TRACE(testing::Message()
                 << "size " << c.size << " relu " << c.relu << " pool " << c.pool);
    std::mt19937_64 rng(static_cast<uint64_t>(c.size * 4 + c.relu * 2 + c.pool));
    Conv2d fused(2, 3, 3);
    Conv2d plain(2, 3, 3);
    FillRandom(&fused.weight().value, &rng);
    FillRandom(&fused.bias().value, &rng);
    CopyParameters(&fused, &plain);
    ReLU relu;
    MaxPool2d pool(2);
    if (c.relu) {
      ASSERT_TRUE(fused.Fuse(relu));
    }
    if (c.pool) {
      ASSERT_TRUE(fused.Fuse(pool));
    }
    EXPECT_FALSE(fused.Fuse(MaxPool2d(3, 2)));

    Tensor x({3, 2, c.size, c.size});
    FillRandom(&x, &rng);
    Tensor y_fused, y_conv, y_relu, y_pool;
    fused.Forward(x, &y_fused, true);
    plain.Forward(x, &y_conv, true);
    const Tensor* y_plain = &y_conv;
    if (c.relu) {
      relu.Forward(*y_plain, &y_relu, true);
      y_plain = &y_relu;
    }
    if (c.pool) {
      pool.Forward(*y_plain, &y_pool, true);
      y_plain = &y_pool;
    }
    ExpectSameTensor(y_fused, *y_plain, "output");

    Tensor g(y_fused.shape());
    FillRandom(&g, &rng);
    Tensor gx_fused, g_pool, g_relu, gx_plain;
    fused.Backward(g, &gx_fused);
    const Tensor* g_plain = &g;
    if (c.pool) {
      pool.Backward(*g_plain, &g_pool);
      g_plain = &g_pool;
    }
    if (c.relu) {
      relu.Backward(*g_plain, &g_relu);
      g_plain = &g_relu;
    }
    plain.Backward(*g_plain, &gx_plain);
    ExpectSameTensor(gx_fused, gx_plain, "input gradient");
    ExpectSameTensor(fused.weight().grad, plain.weight().grad, "weight gradient");
    ExpectSameTensor(fused.bias().grad, plain.bias().grad, "bias gradient");
  }
}

// The batched form works through the batch in chunks of samples (as many
// as fit kChunkFloats), the last chunk possibly a single sample. The whole
// batch at once must match the samples one at a time.
TEST(Conv2d, ChunksOfSamplesMatchOneSampleAtATime) {
  for (bool fuse : {false, true}) {
    SCOPED_TRACE(testing::Message() << "fused " << fuse);
    std::mt19937_64 rng(25 + fuse);
    // 8 channels 9x9 -> 7x7: 30 samples per chunk, so 31 samples make a
    // chunk of 30 and one of 1.
    const int64_t n = 31;
    Conv2d batched(8, 16, 3);
    Conv2d single(8, 16, 3);
    FillRandom(&batched.weight().value, &rng);
    FillRandom(&batched.bias().value, &rng);
    CopyParameters(&batched, &single);
    if (fuse) {
      ASSERT_TRUE(batched.Fuse(ReLU()));
      ASSERT_TRUE(batched.Fuse(MaxPool2d(2)));
      ASSERT_TRUE(single.Fuse(ReLU()));
      ASSERT_TRUE(single.Fuse(MaxPool2d(2)));
    }
    Tensor x({n, 8, 9, 9});
    FillRandom(&x, &rng);
    Tensor y, gx;
    batched.Forward(x, &y, true);
    Tensor g(y.shape());
    FillRandom(&g, &rng);
    batched.Backward(g, &gx);

    const int64_t in_sample = 8 * 9 * 9;
    const int64_t out_sample = y.numel() / n;
    std::vector<double> want_gw(static_cast<size_t>(single.weight().grad.numel()), 0.0);
    std::vector<double> want_gb(16, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      Tensor xi({1, 8, 9, 9});
      std::copy(x.data() + i * in_sample, x.data() + (i + 1) * in_sample, xi.data());
      Tensor yi, gxi;
      single.Forward(xi, &yi, true);
      ASSERT_EQ(yi.numel(), out_sample);
      for (int64_t j = 0; j < out_sample; ++j) {
        ASSERT_NEAR(y[i * out_sample + j], yi[j], 1e-5f * (1.0f + std::fabs(yi[j])))
            << "sample " << i << " output " << j;
      }
      Tensor gi(yi.shape());
      std::copy(g.data() + i * out_sample, g.data() + (i + 1) * out_sample, gi.data());
      single.weight().grad.Zero();
      single.bias().grad.Zero();
      single.Backward(gi, &gxi);
      for (int64_t j = 0; j < in_sample; ++j) {
        ASSERT_NEAR(gx[i * in_sample + j], gxi[j], 1e-5f * (1.0f + std::fabs(gxi[j])))
            << "sample " << i << " input gradient " << j;
      }
      for (size_t j = 0; j < want_gw.size(); ++j) want_gw[j] += single.weight().grad[j];
      for (size_t j = 0; j < want_gb.size(); ++j) want_gb[j] += single.bias().grad[j];
    }
    EXPECT_LT(RelativeError(
                  Gather(batched.weight().grad.data(), AllIndices(batched.weight().grad.numel())),
                  want_gw),
              1e-5);
    EXPECT_LT(RelativeError(Gather(batched.bias().grad.data(), AllIndices(16)), want_gb), 1e-5);
  }
}

TEST(Conv2d, FusedReluAndPoolMatchFiniteDifferences) {
  std::mt19937_64 rng(23);
  Conv2d conv(2, 3, 3);
  FillRandom(&conv.weight().value, &rng);
  FillRandom(&conv.bias().value, &rng);
  ASSERT_TRUE(conv.Fuse(ReLU()));
  ASSERT_TRUE(conv.Fuse(MaxPool2d(2)));
  Tensor x({2, 2, 9, 8});
  FillRandom(&x, &rng);
  Tensor y;
  conv.Forward(x, &y, true);
  EXPECT_EQ(y.ShapeString(), "[2, 3, 3, 3]");
  ExpectGradientsMatchFiniteDifferences(&conv, &x, true);
}

TEST(Conv2d, DescribesItselfLikeTorch) {
  EXPECT_EQ(Conv2d(1, 32, 3).Describe(), "Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1))");
  EXPECT_EQ(Conv2d(2, 4, 3, 2, 1).Describe(),
            "Conv2d(2, 4, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))");
  Conv2d conv(32, 64, 3);
  EXPECT_EQ(conv.weight().value.ShapeString(), "[64, 32, 3, 3]");
  EXPECT_EQ(conv.bias().value.ShapeString(), "[64]");
  EXPECT_EQ(conv.fan_in(), 288);
}

// ------------------------------------------------------------------ MaxPool2d

// Distinct values 0.01 apart in random order: no two window entries are
// within the finite-difference step, so no argmax flips.
void FillDistinct(Tensor* t, std::mt19937_64* rng) {
  std::vector<float> values(static_cast<size_t>(t->numel()));
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = 0.01f * static_cast<float>(i) - 0.005f * static_cast<float>(values.size());
  }
  std::shuffle(values.begin(), values.end(), *rng);
  for (size_t i = 0; i < values.size(); ++i) (*t)[static_cast<int64_t>(i)] = values[i];
}

TEST(MaxPool2d, ForwardPicksEachWindowsMaximumAndBackwardRoutesToIt) {
  MaxPool2d pool(2);
  Tensor x({1, 1, 4, 4});
  SetValues(&x, {1, 5, 2, 0,  //
                 3, 4, 8, 1,  //
                 0, 0, 9, 7,  //
                 6, 2, 7, 8});
  Tensor y;
  pool.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[1, 1, 2, 2]");
  EXPECT_EQ(y[0], 5.0f);
  EXPECT_EQ(y[1], 8.0f);
  EXPECT_EQ(y[2], 6.0f);
  EXPECT_EQ(y[3], 9.0f);
  Tensor g({1, 1, 2, 2});
  SetValues(&g, {1, 2, 3, 4});
  Tensor gx;
  pool.Backward(g, &gx);
  const std::vector<float> want = {0, 1, 0, 0,  //
                                   0, 0, 2, 0,  //
                                   0, 0, 4, 0,  //
                                   3, 0, 0, 0};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(gx[i], want[static_cast<size_t>(i)]) << i;
}

TEST(MaxPool2d, FirstMaximumWinsATie) {
  MaxPool2d pool(2);
  Tensor x({1, 1, 2, 2});
  SetValues(&x, {1, 3, 3, 3});
  Tensor y;
  pool.Forward(x, &y, true);
  Tensor g({1, 1, 1, 1});
  g[0] = 1.0f;
  Tensor gx;
  pool.Backward(g, &gx);
  EXPECT_EQ(gx[0], 0.0f);
  EXPECT_EQ(gx[1], 1.0f);
  EXPECT_EQ(gx[2], 0.0f);
  EXPECT_EQ(gx[3], 0.0f);
}

TEST(MaxPool2d, DropsTheOddRowAndColumnLikeTorch) {
  MaxPool2d pool(2);
  Tensor x({2, 3, 11, 11});
  Tensor y;
  pool.Forward(x, &y, false);
  EXPECT_EQ(y.ShapeString(), "[2, 3, 5, 5]");
}

TEST(MaxPool2d, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(7);
  MaxPool2d pool(2);
  Tensor x({2, 3, 6, 5});
  FillDistinct(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&pool, &x, true);
}

TEST(MaxPool2d, OverlappingWindowsAccumulateAndMatchFiniteDifferences) {
  std::mt19937_64 rng(8);
  MaxPool2d pool(3, 2);
  Tensor x({2, 2, 7, 7});
  FillDistinct(&x, &rng);
  Tensor y;
  pool.Forward(x, &y, true);
  EXPECT_EQ(y.ShapeString(), "[2, 2, 3, 3]");
  ExpectGradientsMatchFiniteDifferences(&pool, &x, true);
}

// MaxPool2d(2) has its own vectorised path; check it against the definition
// on odd sizes, wide rows (several vector blocks and a tail) and many ties.
TEST(MaxPool2d, TwoByTwoMatchesTheDefinitionWithTiesAndOddSizes) {
  std::mt19937_64 rng(24);
  std::uniform_int_distribution<int> level(-2, 2);
  for (int64_t w : {2, 3, 9, 11, 14, 17, 26}) {
    SCOPED_TRACE(testing::Message() << "width " << w);
    const int64_t h = 7;
    MaxPool2d pool(2);
    Tensor x({2, 3, h, w});
    for (int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(level(rng));
    Tensor y;
    pool.Forward(x, &y, true);
    const int64_t oh = h / 2, ow = w / 2;
    ASSERT_EQ(y.ShapeString(), "[2, 3, " + std::to_string(oh) + ", " + std::to_string(ow) + "]");
    Tensor g(y.shape());
    FillRandom(&g, &rng);
    Tensor gx;
    pool.Backward(g, &gx);
    std::vector<float> want_gx(static_cast<size_t>(x.numel()), 0.0f);
    for (int64_t p = 0; p < 6; ++p) {
      for (int64_t i = 0; i < oh; ++i) {
        for (int64_t j = 0; j < ow; ++j) {
          int64_t best = p * h * w + 2 * i * w + 2 * j;
          for (int64_t di = 0; di < 2; ++di) {
            for (int64_t dj = 0; dj < 2; ++dj) {
              const int64_t at = p * h * w + (2 * i + di) * w + 2 * j + dj;
              if (x[at] > x[best]) best = at;
            }
          }
          const int64_t out = (p * oh + i) * ow + j;
          ASSERT_EQ(y[out], x[best]) << "output " << out;
          want_gx[static_cast<size_t>(best)] += g[out];
        }
      }
    }
    for (int64_t i = 0; i < gx.numel(); ++i) {
      ASSERT_EQ(gx[i], want_gx[static_cast<size_t>(i)]) << "input gradient " << i;
    }
  }
}

// ------------------------------------------------------------------ Flatten

TEST(Flatten, KeepsTheBatchAndRestoresTheShapeInBackward) {
  Flatten flatten;
  Tensor x({2, 1, 3, 4});
  for (int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(i);
  Tensor y;
  flatten.Forward(x, &y, false);
  ASSERT_EQ(y.ShapeString(), "[2, 12]");
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y[i], static_cast<float>(i));
  Tensor gx;
  flatten.Backward(y, &gx);
  EXPECT_EQ(gx.ShapeString(), "[2, 1, 3, 4]");
  for (int64_t i = 0; i < gx.numel(); ++i) EXPECT_EQ(gx[i], static_cast<float>(i));
}

// ------------------------------------------------------------------ Dropout

TEST(Dropout, IsTheIdentityInEvaluation) {
  std::mt19937_64 rng(9);
  Dropout dropout(0.5);
  Tensor x({4, 8});
  FillRandom(&x, &rng);
  Tensor y;
  dropout.Forward(x, &y, false);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(y[i], x[i]);
  Tensor gx;
  dropout.Backward(x, &gx);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(gx[i], x[i]);
}

TEST(Dropout, KeepsAboutOneMinusPAndScalesTheKeptByItsInverse) {
  Dropout dropout(0.25);
  dropout.SetSeed(11);
  Tensor x({64, 1000});
  x.Fill(2.0f);
  Tensor y;
  dropout.Forward(x, &y, true);
  int64_t kept = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    if (y[i] != 0.0f) {
      ASSERT_FLOAT_EQ(y[i], 2.0f / 0.75f) << i;
      ++kept;
    }
  }
  const double fraction = static_cast<double>(kept) / static_cast<double>(y.numel());
  // 64000 Bernoulli(0.75) draws: the standard deviation of the fraction is 0.0017.
  EXPECT_NEAR(fraction, 0.75, 0.01);
}

TEST(Dropout, TheSameSeedGivesTheSameMaskAndAnotherSeedAnother) {
  Tensor x({8, 64});
  x.Fill(1.0f);
  Dropout a(0.5);
  Dropout b(0.5);
  a.SetSeed(5);
  b.SetSeed(5);
  Tensor ya;
  Tensor yb;
  a.Forward(x, &ya, true);
  b.Forward(x, &yb, true);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(ya[i], yb[i]) << i;
  // The next Forward draws a fresh mask.
  Tensor ya2;
  a.Forward(x, &ya2, true);
  int differ = 0;
  for (int64_t i = 0; i < x.numel(); ++i) differ += ya[i] != ya2[i];
  EXPECT_GT(differ, 0);
  b.SetSeed(6);
  b.Forward(x, &yb, true);
  differ = 0;
  for (int64_t i = 0; i < x.numel(); ++i) differ += ya[i] != yb[i];
  EXPECT_GT(differ, 0);
}

TEST(Dropout, BackwardMatchesFiniteDifferencesWithAFixedMask) {
  std::mt19937_64 rng(10);
  Dropout dropout(0.4);
  Tensor x({3, 17});
  FillRandom(&x, &rng);
  ExpectGradientsMatchFiniteDifferences(&dropout, &x, /*training=*/true, /*seed=*/77);
  // And the mask did drop something, so the check was not of the identity.
  int64_t zeros = 0;
  for (int64_t i = 0; i < dropout.mask().numel(); ++i) zeros += dropout.mask()[i] == 0.0f;
  EXPECT_GT(zeros, 0);
}

TEST(Dropout, WithPOneDropsEverything) {
  Dropout dropout(1.0);
  Tensor x({2, 3});
  x.Fill(1.0f);
  Tensor y;
  dropout.Forward(x, &y, true);
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y[i], 0.0f);
}

// ------------------------------------------------------------------ buffers

TEST(Layers, ReuseTheirOutputBuffersAtAFixedBatchSize) {
  std::mt19937_64 rng(12);
  Conv2d conv(1, 4, 3);
  Tensor x({2, 1, 8, 8});
  FillRandom(&x, &rng);
  Tensor y;
  Tensor gx;
  conv.Forward(x, &y, true);
  conv.Backward(y, &gx);
  const float* y_data = y.data();
  const float* gx_data = gx.data();
  conv.Forward(x, &y, true);
  conv.Backward(y, &gx);
  EXPECT_EQ(y.data(), y_data);
  EXPECT_EQ(gx.data(), gx_data);
}

}  // namespace
}  // namespace aidn::engine
