#include "worker/engine/layers.h"

#include <cmath>
#include <memory>
#include <random>
#include <set>
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
