#include "worker/engine/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/engine/gradcheck.h"
#include "worker/engine/cpu.h"
#include "worker/engine/layers.h"
#include "worker/engine/loss.h"

// Counting global allocator: lets a test assert that a steady-state training
// step allocates nothing (Tensor storage comes from the aligned operator new).
namespace {
std::atomic<bool> g_count_allocations{false};
std::atomic<int64_t> g_allocations{0};

void* CountedAlloc(std::size_t size, std::size_t alignment) {
  if (g_count_allocations.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  void* p = nullptr;
  if (posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment,
                     size == 0 ? 1 : size) != 0) {
    throw std::bad_alloc();
  }
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return CountedAlloc(size, alignof(std::max_align_t)); }
void* operator new(std::size_t size, std::align_val_t a) {
  return CountedAlloc(size, static_cast<std::size_t>(a));
}
// The nothrow forms too (std::stable_sort's temporary buffer uses them):
// under ASan they would otherwise come from its allocator and reach the
// free() below.
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return CountedAlloc(size, alignof(std::max_align_t));
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return CountedAlloc(size, static_cast<std::size_t>(a));
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace aidn::engine {
namespace {

using gradcheck::FillRandom;
using gradcheck::Gather;
using gradcheck::NumericGradient;
using gradcheck::RelativeError;
using gradcheck::TopK;

std::unique_ptr<Sequential> Build(const ModelConfig& config, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<Sequential>> model = BuildModel(config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(model).value() : nullptr;
}

ModelConfig Mlp(std::vector<int> hidden, double dropout = 0.0) {
  ModelConfig config;
  config.name = "mlp";
  config.hidden_sizes = std::move(hidden);
  config.dropout = dropout;
  return config;
}

ModelConfig Cnn() {
  ModelConfig config;
  config.name = "cnn";
  return config;
}

std::vector<std::pair<std::string, std::string>> NamesAndShapes(const Sequential& model) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Parameter* p : model.Parameters()) {
    out.emplace_back(p->name, p->value.ShapeString());
    EXPECT_EQ(p->grad.shape(), p->value.shape()) << p->name;
  }
  return out;
}

Tensor RandomImages(int64_t n, std::mt19937_64* rng) {
  Tensor x({n, 1, 28, 28});
  FillRandom(&x, rng, 0.0f, 1.0f);
  return x;
}

std::vector<int32_t> RandomLabels(int64_t n, std::mt19937_64* rng) {
  std::vector<int32_t> labels;
  for (int64_t i = 0; i < n; ++i) labels.push_back(static_cast<int32_t>((*rng)() % 10));
  return labels;
}

// ------------------------------------------------------------------ BuildModel

TEST(BuildModel, MlpHasTorchsParameterNamesShapesAndCount) {
  std::unique_ptr<Sequential> model = Build(Mlp({256, 256}), 1);
  ASSERT_NE(model, nullptr);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"1.weight", "[256, 784]"}, {"1.bias", "[256]"},       {"3.weight", "[256, 256]"},
      {"3.bias", "[256]"},        {"5.weight", "[10, 256]"}, {"5.bias", "[10]"}};
  EXPECT_EQ(NamesAndShapes(*model), want);
  EXPECT_EQ(model->ParameterCount(), 269322);
}

TEST(BuildModel, MlpCountsDropoutModulesInTheIndices) {
  std::unique_ptr<Sequential> model = Build(Mlp({128, 64}, 0.2), 1);
  ASSERT_NE(model, nullptr);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"1.weight", "[128, 784]"}, {"1.bias", "[128]"},      {"4.weight", "[64, 128]"},
      {"4.bias", "[64]"},         {"7.weight", "[10, 64]"}, {"7.bias", "[10]"}};
  EXPECT_EQ(NamesAndShapes(*model), want);
  EXPECT_NE(model->Describe().find("(6): Dropout(p=0.2, inplace=False)"), std::string::npos)
      << model->Describe();
}

TEST(BuildModel, MlpWithoutHiddenLayersIsOneLinear) {
  std::unique_ptr<Sequential> model = Build(Mlp({}), 1);
  ASSERT_NE(model, nullptr);
  const std::vector<std::pair<std::string, std::string>> want = {{"1.weight", "[10, 784]"},
                                                                 {"1.bias", "[10]"}};
  EXPECT_EQ(NamesAndShapes(*model), want);
}

TEST(BuildModel, CnnHasTorchsParameterNamesShapesAndCount) {
  std::unique_ptr<Sequential> model = Build(Cnn(), 1);
  ASSERT_NE(model, nullptr);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"0.weight", "[32, 1, 3, 3]"},  {"0.bias", "[32]"},
      {"3.weight", "[64, 32, 3, 3]"}, {"3.bias", "[64]"},
      {"7.weight", "[128, 1600]"},    {"7.bias", "[128]"},
      {"9.weight", "[10, 128]"},      {"9.bias", "[10]"}};
  EXPECT_EQ(NamesAndShapes(*model), want);
  EXPECT_EQ(model->ParameterCount(), 225034);
  std::mt19937_64 rng(1);
  Tensor x = RandomImages(3, &rng);
  Tensor logits;
  model->Forward(x, &logits, false);
  EXPECT_EQ(logits.ShapeString(), "[3, 10]");
}

TEST(BuildModel, DescribesTheMlpLikeTorchsRepr) {
  std::unique_ptr<Sequential> model = Build(Mlp({256, 256}), 1);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->Describe(),
            "Sequential(\n"
            "  (0): Flatten(start_dim=1, end_dim=-1)\n"
            "  (1): Linear(in_features=784, out_features=256, bias=True)\n"
            "  (2): ReLU()\n"
            "  (3): Linear(in_features=256, out_features=256, bias=True)\n"
            "  (4): ReLU()\n"
            "  (5): Linear(in_features=256, out_features=10, bias=True)\n"
            ")");
}

TEST(BuildModel, DescribesTheCnnLikeTorchsReprThoughItsLayersAreFused) {
  std::unique_ptr<Sequential> model = Build(Cnn(), 1);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->Describe(),
            "Sequential(\n"
            "  (0): Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1))\n"
            "  (1): ReLU()\n"
            "  (2): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
            "  (3): Conv2d(32, 64, kernel_size=(3, 3), stride=(1, 1))\n"
            "  (4): ReLU()\n"
            "  (5): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
            "  (6): Flatten(start_dim=1, end_dim=-1)\n"
            "  (7): Linear(in_features=1600, out_features=128, bias=True)\n"
            "  (8): ReLU()\n"
            "  (9): Linear(in_features=128, out_features=10, bias=True)\n"
            ")");
}

TEST(BuildModel, RefusesUnknownNamesAndBadSizes) {
  ModelConfig config = Mlp({256});
  config.name = "resnet";
  EXPECT_EQ(BuildModel(config, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildModel(Mlp({256, 0}), 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildModel(Mlp({-3}), 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildModel(Mlp({256}, 1.0), 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildModel(Mlp({256}, -0.1), 1).status().code(), absl::StatusCode::kInvalidArgument);
  config = Mlp({256});
  config.classes = 0;
  EXPECT_EQ(BuildModel(config, 1).status().code(), absl::StatusCode::kInvalidArgument);
  config = Cnn();
  config.height = 6;
  EXPECT_EQ(BuildModel(config, 1).status().code(), absl::StatusCode::kInvalidArgument);
  config = Cnn();
  config.in_channels = 0;
  EXPECT_EQ(BuildModel(config, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// fan_in of each parameter of the two models, by name.
int64_t FanIn(const Parameter& p) {
  if (p.value.rank() == 1) return -1;  // looked up from its weight
  int64_t fan_in = 1;
  for (int i = 1; i < p.value.rank(); ++i) fan_in *= p.value.dim(i);
  return fan_in;
}

void ExpectTorchDefaultInit(const Sequential& model) {
  int64_t fan_in = 0;
  for (const Parameter* p : model.Parameters()) {
    if (p->value.rank() > 1) fan_in = FanIn(*p);
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    double max_abs = 0.0;
    double sum = 0.0;
    for (int64_t i = 0; i < p->value.numel(); ++i) {
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(p->value[i])));
      sum += p->value[i];
      EXPECT_EQ(p->grad[i], 0.0f) << p->name;
    }
    EXPECT_LE(max_abs, bound) << p->name;
    if (p->value.numel() >= 100) {
      // Uniform over the whole interval, centred.
      EXPECT_GT(max_abs, 0.9 * bound) << p->name;
      EXPECT_LT(std::fabs(sum / static_cast<double>(p->value.numel())), 0.1 * bound) << p->name;
    } else {
      EXPECT_GT(max_abs, 0.0) << p->name;
    }
  }
}

TEST(BuildModel, InitialisesUniformlyWithinOneOverSqrtFanIn) {
  std::unique_ptr<Sequential> mlp = Build(Mlp({256, 256}), 3);
  std::unique_ptr<Sequential> cnn = Build(Cnn(), 3);
  ASSERT_NE(mlp, nullptr);
  ASSERT_NE(cnn, nullptr);
  ExpectTorchDefaultInit(*mlp);
  ExpectTorchDefaultInit(*cnn);
}

bool SameWeights(const Sequential& a, const Sequential& b) {
  for (size_t i = 0; i < a.Parameters().size(); ++i) {
    const Tensor& x = a.Parameters()[i]->value;
    const Tensor& y = b.Parameters()[i]->value;
    for (int64_t j = 0; j < x.numel(); ++j) {
      if (x[j] != y[j]) return false;
    }
  }
  return true;
}

TEST(BuildModel, IsDeterministicPerSeedAndDiffersAcrossSeeds) {
  for (const ModelConfig& config : {Mlp({64, 32}), Cnn()}) {
    std::unique_ptr<Sequential> a = Build(config, 42);
    std::unique_ptr<Sequential> b = Build(config, 42);
    std::unique_ptr<Sequential> c = Build(config, 43);
    ASSERT_NE(a, nullptr);
    EXPECT_TRUE(SameWeights(*a, *b)) << config.name;
    EXPECT_FALSE(SameWeights(*a, *c)) << config.name;
    // Every tensor differs across seeds, not just the first.
    for (size_t i = 0; i < a->Parameters().size(); ++i) {
      EXPECT_NE(a->Parameters()[i]->value[0], c->Parameters()[i]->value[0])
          << a->Parameters()[i]->name;
    }
  }
}

// ------------------------------------------------------------------ loss

TEST(SoftmaxCrossEntropy, MatchesAHandComputedCase) {
  Tensor logits({2, 3});
  const float v[] = {1, 2, 3, 0, 0, 0};
  for (int i = 0; i < 6; ++i) logits[i] = v[i];
  Tensor grad;
  const double loss = SoftmaxCrossEntropy(logits, {2, 0}, &grad);
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const double want = ((std::log(z) - 3.0) + std::log(3.0)) / 2.0;
  EXPECT_NEAR(loss, want, 1e-6);
  ASSERT_EQ(grad.ShapeString(), "[2, 3]");
  EXPECT_NEAR(grad[0], std::exp(1.0) / z / 2, 1e-6);
  EXPECT_NEAR(grad[2], (std::exp(3.0) / z - 1) / 2, 1e-6);
  EXPECT_NEAR(grad[3], (1.0 / 3 - 1) / 2, 1e-6);
  EXPECT_NEAR(grad[4], (1.0 / 3) / 2, 1e-6);
}

TEST(SoftmaxCrossEntropy, IsStableForHugeLogits) {
  Tensor logits({1, 3});
  logits[0] = 1000.0f;
  logits[1] = 1001.0f;
  logits[2] = -1000.0f;
  Tensor grad;
  const double loss = SoftmaxCrossEntropy(logits, {0}, &grad);
  EXPECT_NEAR(loss, std::log(1.0 + std::exp(1.0)), 1e-6);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(grad[i]));
  EXPECT_NEAR(grad[0] + grad[1] + grad[2], 0.0, 1e-6);
}

TEST(SoftmaxCrossEntropy, GradientMatchesFiniteDifferencesAndScales) {
  std::mt19937_64 rng(5);
  Tensor logits({4, 10});
  FillRandom(&logits, &rng, 0.0f, 3.0f);
  const std::vector<int32_t> labels = {3, 0, 9, 3};
  Tensor grad;
  SoftmaxCrossEntropy(logits, labels, &grad);
  auto loss = [&] { return SoftmaxCrossEntropy(logits, labels, nullptr); };
  const std::vector<int64_t> idx = gradcheck::AllIndices(logits.numel());
  EXPECT_LT(RelativeError(Gather(grad.data(), idx), NumericGradient(logits.data(), idx, loss)),
            1e-3);
  Tensor scaled;
  SoftmaxCrossEntropy(logits, labels, &scaled, 0.25);
  for (int64_t i = 0; i < grad.numel(); ++i) EXPECT_FLOAT_EQ(scaled[i], 0.25f * grad[i]);
}

TEST(CountCorrect, CountsRowsWhoseFirstMaximumIsTheLabel) {
  Tensor logits({3, 3});
  const float v[] = {0, 5, 1,  //
                     2, 2, 0,  // tie: the first maximum (0) wins
                     1, 0, 3};
  for (int i = 0; i < 9; ++i) logits[i] = v[i];
  EXPECT_EQ(CountCorrect(logits, {1, 0, 2}), 3);
  EXPECT_EQ(CountCorrect(logits, {1, 1, 0}), 1);
}

// ------------------------------------------------------------------ Sequential

TEST(Sequential, FiresGradReadyInReverseLayerOrderOncePerParameterPerBackward) {
  for (const ModelConfig& config : {Mlp({32, 16}, 0.1), Cnn()}) {
    std::unique_ptr<Sequential> model = Build(config, 1);
    ASSERT_NE(model, nullptr);
    std::vector<std::string> order;
    model->SetGradReadyCallback([&](Parameter* p) { order.push_back(p->name); });
    std::mt19937_64 rng(2);
    Tensor x = RandomImages(2, &rng);
    Tensor logits;
    Tensor grad;
    model->Forward(x, &logits, true);
    SoftmaxCrossEntropy(logits, {1, 2}, &grad);
    model->Backward(grad);
    std::vector<std::string> want;
    for (auto it = model->Parameters().rbegin(); it != model->Parameters().rend(); ++it) {
      want.push_back((*it)->name);
    }
    EXPECT_EQ(order, want) << config.name;
    order.clear();
    model->Backward(grad);
    EXPECT_EQ(order, want) << config.name;
  }
}

TEST(Sequential, GradReadyFiresOnlyOnceTheParametersGradientIsFinal) {
  std::unique_ptr<Sequential> model = Build(Mlp({16}), 1);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(3);
  Tensor x = RandomImages(2, &rng);
  Tensor logits;
  Tensor grad;
  model->Forward(x, &logits, true);
  SoftmaxCrossEntropy(logits, {4, 7}, &grad);
  std::map<std::string, std::vector<float>> at_callback;
  model->SetGradReadyCallback([&](Parameter* p) {
    at_callback[p->name].assign(p->grad.data(), p->grad.data() + p->grad.numel());
  });
  model->Backward(grad);
  for (const Parameter* p : model->Parameters()) {
    ASSERT_TRUE(at_callback.count(p->name)) << p->name;
    const std::vector<float>& seen = at_callback[p->name];
    for (int64_t i = 0; i < p->grad.numel(); ++i)
      ASSERT_EQ(seen[static_cast<size_t>(i)], p->grad[i]);
  }
}

TEST(Sequential, BackwardAccumulatesAndZeroGradClears) {
  std::unique_ptr<Sequential> model = Build(Cnn(), 4);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(4);
  Tensor x = RandomImages(2, &rng);
  Tensor logits;
  Tensor grad;
  model->Forward(x, &logits, true);
  SoftmaxCrossEntropy(logits, {3, 8}, &grad);
  model->Backward(grad);
  std::vector<Tensor> once;
  for (const Parameter* p : model->Parameters()) once.push_back(p->grad.Clone());
  model->Forward(x, &logits, true);
  model->Backward(grad);
  for (size_t i = 0; i < once.size(); ++i) {
    const Parameter* p = model->Parameters()[i];
    double norm = 0.0;
    for (int64_t j = 0; j < p->grad.numel(); ++j) {
      ASSERT_NEAR(p->grad[j], 2.0f * once[i][j], 1e-6f + 1e-5f * std::fabs(once[i][j])) << p->name;
      norm += std::fabs(once[i][j]);
    }
    EXPECT_GT(norm, 0.0) << p->name << " got no gradient at all";
  }
  model->ZeroGrad();
  for (const Parameter* p : model->Parameters()) {
    for (int64_t j = 0; j < p->grad.numel(); ++j) ASSERT_EQ(p->grad[j], 0.0f) << p->name;
  }
}

// Mean cross-entropy of the model on (x, labels); dropout masks are re-seeded
// so every evaluation uses the same ones.
double Loss(Sequential* model, const Tensor& x, const std::vector<int32_t>& labels, bool training,
            uint64_t seed) {
  Tensor logits;
  model->SetSeed(seed);
  model->Forward(x, &logits, training);
  return SoftmaxCrossEntropy(logits, labels, nullptr);
}

// Of the `candidates` entries with the largest analytic gradient (and at
// least 5% of the largest), the `keep` where the loss is smoothest over [-eps, eps] (smallest
// second difference). A whole CNN has thousands of ReLU and max-pool kinks, and a step across one
// skews a central difference by O(eps); a wrong gradient still shows up at
// every entry, kink or not, so choosing smooth ones weakens nothing.
std::vector<int64_t> SmoothLargeEntries(float* values, const float* grads, int64_t n,
                                        const std::function<double()>& loss, float eps,
                                        int64_t candidates = 24, size_t keep = 6) {
  const double at = loss();
  std::vector<std::pair<double, int64_t>> curvature;
  const std::vector<int64_t> top = TopK(grads, n, candidates);
  for (int64_t i : top) {
    // Entries with a tiny gradient (a dropped unit) are flat, not informative.
    if (std::fabs(grads[i]) < 0.05f * std::fabs(grads[top[0]])) continue;
    const float original = values[i];
    values[i] = original + eps;
    const double plus = loss();
    values[i] = original - eps;
    const double minus = loss();
    values[i] = original;
    curvature.emplace_back(std::fabs(plus - 2 * at + minus), i);
  }
  std::sort(curvature.begin(), curvature.end());
  std::vector<int64_t> chosen;
  for (size_t i = 0; i < keep && i < curvature.size(); ++i) chosen.push_back(curvature[i].second);
  return chosen;
}

void ExpectParameterGradientsMatchFiniteDifferences(Sequential* model, Tensor* x,
                                                    const std::vector<int32_t>& labels,
                                                    bool training, uint64_t seed, float eps) {
  Tensor logits;
  Tensor grad;
  model->ZeroGrad();
  model->SetSeed(seed);
  model->Forward(*x, &logits, training);
  SoftmaxCrossEntropy(logits, labels, &grad);
  model->Backward(grad);
  auto loss = [&] { return Loss(model, *x, labels, training, seed); };
  for (Parameter* p : model->Parameters()) {
    const std::vector<int64_t> idx =
        SmoothLargeEntries(p->value.data(), p->grad.data(), p->grad.numel(), loss, eps);
    const std::vector<double> analytic = Gather(p->grad.data(), idx);
    const std::vector<double> numeric = NumericGradient(p->value.data(), idx, loss, eps);
    ASSERT_GE(idx.size(), 3u) << p->name;
    ASSERT_GT(std::fabs(analytic[0]), 1e-4) << p->name << ": a degenerate check";
    EXPECT_LT(RelativeError(analytic, numeric), 1e-2) << p->name;
  }
}

TEST(Sequential, MlpParameterGradientsMatchFiniteDifferences) {
  std::unique_ptr<Sequential> model = Build(Mlp({24, 16}, 0.3), 5);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(5);
  Tensor x = RandomImages(3, &rng);
  ExpectParameterGradientsMatchFiniteDifferences(model.get(), &x, {2, 5, 9}, true, 123, 1e-3f);
}

TEST(Sequential, CnnParameterGradientsMatchFiniteDifferences) {
  std::unique_ptr<Sequential> model = Build(Cnn(), 6);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(6);
  Tensor x = RandomImages(2, &rng);
  // A smaller step than the MLP's: conv1's biases shift 1352 activations each, so
  // kinks are dense.
  ExpectParameterGradientsMatchFiniteDifferences(model.get(), &x, {0, 7}, false, 0, 5e-4f);
}

// y = x + b with b a parameter of the input's shape (zero): dL/db is dL/dx,
// so a model prefixed with it reports its input gradient through Sequential.
class InputProbe final : public Layer {
 public:
  explicit InputProbe(std::vector<int64_t> shape) : b_{"probe", Tensor(shape), Tensor(shape)} {}
  std::string Describe() const override { return "InputProbe()"; }
  void Forward(const Tensor& input, Tensor* output, bool /*training*/) override {
    EnsureShape(output, input.shape());
    for (int64_t i = 0; i < input.numel(); ++i) (*output)[i] = input[i] + b_.value[i];
  }
  void Backward(const Tensor& grad_output, Tensor* grad_input) override {
    for (int64_t i = 0; i < grad_output.numel(); ++i) b_.grad[i] += grad_output[i];
    if (grad_input != nullptr) {
      EnsureShape(grad_input, grad_output.shape());
      for (int64_t i = 0; i < grad_output.numel(); ++i) (*grad_input)[i] = grad_output[i];
    }
  }
  std::vector<Parameter*> Parameters() override { return {&b_}; }

 private:
  Parameter b_;
};

void ExpectInputGradientMatchesFiniteDifferences(Sequential* model, Tensor* x,
                                                 const std::vector<int32_t>& labels) {
  Tensor logits;
  Tensor grad;
  model->ZeroGrad();
  model->Forward(*x, &logits, false);
  SoftmaxCrossEntropy(logits, labels, &grad);
  model->Backward(grad);
  const Parameter* probe = model->Parameters()[0];
  ASSERT_EQ(probe->name, "0.probe");
  auto loss = [&] { return Loss(model, *x, labels, false, 0); };
  const std::vector<int64_t> idx =
      SmoothLargeEntries(x->data(), probe->grad.data(), probe->grad.numel(), loss, 1e-3f, 32, 12);
  const std::vector<double> analytic = Gather(probe->grad.data(), idx);
  ASSERT_GT(std::fabs(analytic[0]), 1e-4) << "a degenerate check";
  EXPECT_LT(RelativeError(analytic, NumericGradient(x->data(), idx, loss)), 1e-2);
}

// Copies the weights of `from` into the layers of the same shape in `to`.
void CopyWeights(const Sequential& from, Sequential* to, size_t to_offset) {
  for (size_t i = 0; i < from.Parameters().size(); ++i) {
    const Tensor& src = from.Parameters()[i]->value;
    Tensor& dst = to->Parameters()[i + to_offset]->value;
    ASSERT_EQ(src.shape(), dst.shape());
    for (int64_t j = 0; j < src.numel(); ++j) dst[j] = src[j];
  }
}

TEST(Sequential, MlpInputGradientMatchesFiniteDifferences) {
  std::unique_ptr<Sequential> reference = Build(Mlp({24, 16}), 7);
  ASSERT_NE(reference, nullptr);
  Sequential model;
  model.Add(std::make_unique<InputProbe>(std::vector<int64_t>{3, 1, 28, 28}));
  model.Add(std::make_unique<Flatten>());
  model.Add(std::make_unique<Linear>(784, 24));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<Linear>(24, 16));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<Linear>(16, 10));
  CopyWeights(*reference, &model, 1);
  std::mt19937_64 rng(7);
  Tensor x = RandomImages(3, &rng);
  ExpectInputGradientMatchesFiniteDifferences(&model, &x, {1, 4, 4});
}

TEST(Sequential, CnnInputGradientMatchesFiniteDifferences) {
  std::unique_ptr<Sequential> reference = Build(Cnn(), 8);
  ASSERT_NE(reference, nullptr);
  Sequential model;
  model.Add(std::make_unique<InputProbe>(std::vector<int64_t>{2, 1, 28, 28}));
  model.Add(std::make_unique<Conv2d>(1, 32, 3));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<MaxPool2d>(2));
  model.Add(std::make_unique<Conv2d>(32, 64, 3));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<MaxPool2d>(2));
  model.Add(std::make_unique<Flatten>());
  model.Add(std::make_unique<Linear>(1600, 128));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<Linear>(128, 10));
  CopyWeights(*reference, &model, 1);
  std::mt19937_64 rng(8);
  Tensor x = RandomImages(2, &rng);
  ExpectInputGradientMatchesFiniteDifferences(&model, &x, {6, 2});
}

// Sequential fuses ReLU and MaxPool2d into the Conv2d or Linear before them
// (Layer::Fuse). The same layers driven one by one, unfused, must give the
// same logits and gradients bit for bit.
TEST(Sequential, FusedLayersMatchTheSameLayersRunOneByOne) {
  std::mt19937_64 rng(31);
  auto conv1 = std::make_unique<Conv2d>(1, 4, 3);
  auto conv2 = std::make_unique<Conv2d>(4, 6, 3);
  auto fc1 = std::make_unique<Linear>(6 * 5 * 5, 16);
  auto fc2 = std::make_unique<Linear>(16, 10);
  Conv2d plain_conv1(1, 4, 3);
  Conv2d plain_conv2(4, 6, 3);
  Linear plain_fc1(6 * 5 * 5, 16);
  Linear plain_fc2(16, 10);
  std::vector<Parameter*> fused_params, plain_params;
  for (Layer* l : std::vector<Layer*>{conv1.get(), conv2.get(), fc1.get(), fc2.get()}) {
    for (Parameter* p : l->Parameters()) fused_params.push_back(p);
  }
  for (Layer* l : std::vector<Layer*>{&plain_conv1, &plain_conv2, &plain_fc1, &plain_fc2}) {
    for (Parameter* p : l->Parameters()) plain_params.push_back(p);
  }
  for (size_t i = 0; i < fused_params.size(); ++i) {
    FillRandom(&fused_params[i]->value, &rng, 0.01f, 0.3f);
    std::memcpy(plain_params[i]->value.data(), fused_params[i]->value.data(),
                sizeof(float) * fused_params[i]->value.numel());
  }
  Sequential model;
  model.Add(std::move(conv1));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<MaxPool2d>(2));
  model.Add(std::move(conv2));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::make_unique<MaxPool2d>(2));
  model.Add(std::make_unique<Flatten>());
  model.Add(std::move(fc1));
  model.Add(std::make_unique<ReLU>());
  model.Add(std::move(fc2));

  // The plain stack, driven by hand.
  ReLU relu1, relu2, relu3;
  MaxPool2d pool1(2), pool2(2);
  Flatten flatten;
  std::vector<Layer*> plain = {&plain_conv1, &relu1,   &pool1,     &plain_conv2, &relu2,
                               &pool2,       &flatten, &plain_fc1, &relu3,       &plain_fc2};

  // Input 26x26: conv1's plane 24x24 takes the per-sample form, conv2's
  // 10x10 the batched one.
  Tensor x({3, 1, 26, 26});
  FillRandom(&x, &rng, 0.0f, 1.0f);
  const std::vector<int32_t> labels = {1, 5, 9};
  Tensor logits, grad;
  model.Forward(x, &logits, true);
  SoftmaxCrossEntropy(logits, labels, &grad);
  model.Backward(grad);

  std::vector<Tensor> acts(plain.size()), grads(plain.size());
  const Tensor* a = &x;
  for (size_t i = 0; i < plain.size(); ++i) {
    plain[i]->Forward(*a, &acts[i], true);
    a = &acts[i];
  }
  ASSERT_EQ(a->shape(), logits.shape());
  for (int64_t i = 0; i < logits.numel(); ++i) ASSERT_EQ(logits[i], (*a)[i]) << "logit " << i;
  Tensor plain_grad;
  SoftmaxCrossEntropy(*a, labels, &plain_grad);
  const Tensor* g = &plain_grad;
  for (int i = static_cast<int>(plain.size()) - 1; i >= 0; --i) {
    plain[static_cast<size_t>(i)]->Backward(*g, i > 0 ? &grads[static_cast<size_t>(i)] : nullptr);
    g = &grads[static_cast<size_t>(i)];
  }
  for (size_t i = 0; i < fused_params.size(); ++i) {
    const Tensor& want = plain_params[i]->grad;
    const Tensor& got = fused_params[i]->grad;
    double norm = 0.0;
    for (int64_t j = 0; j < got.numel(); ++j) {
      ASSERT_EQ(got[j], want[j]) << fused_params[i]->name << " at " << j;
      norm += std::fabs(got[j]);
    }
    EXPECT_GT(norm, 0.0) << fused_params[i]->name;
  }
}

TEST(Sequential, ALastLayerFusedIntoAnotherStillWritesTheLogits) {
  std::mt19937_64 rng(32);
  auto linear = std::make_unique<Linear>(5, 4);
  Linear plain(5, 4);
  FillRandom(&linear->weight().value, &rng);
  FillRandom(&linear->bias().value, &rng);
  std::memcpy(plain.weight().value.data(), linear->weight().value.data(), sizeof(float) * 20);
  std::memcpy(plain.bias().value.data(), linear->bias().value.data(), sizeof(float) * 4);
  Sequential model;
  model.Add(std::move(linear));
  model.Add(std::make_unique<ReLU>());
  Tensor x({3, 5});
  FillRandom(&x, &rng);
  Tensor logits;
  model.Forward(x, &logits, true);
  Tensor y, want;
  ReLU relu;
  plain.Forward(x, &y, true);
  relu.Forward(y, &want, true);
  ASSERT_EQ(logits.shape(), want.shape());
  int64_t zeros = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    ASSERT_EQ(logits[i], want[i]) << i;
    zeros += want[i] == 0.0f;
  }
  EXPECT_GT(zeros, 0);
  Tensor g(logits.shape());
  FillRandom(&g, &rng);
  model.Backward(g);
  Tensor g_relu;
  relu.Backward(g, &g_relu);
  plain.Backward(g_relu, nullptr);
  for (int64_t i = 0; i < 20; ++i) {
    ASSERT_EQ(model.Parameters()[0]->grad[i], plain.weight().grad[i]) << i;
  }
}

TEST(Sequential, SetSeedMakesDropoutReproducible) {
  std::unique_ptr<Sequential> model = Build(Mlp({64, 64}, 0.5), 9);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(9);
  Tensor x = RandomImages(4, &rng);
  Tensor a;
  Tensor b;
  Tensor c;
  model->SetSeed(1);
  model->Forward(x, &a, true);
  model->SetSeed(1);
  model->Forward(x, &b, true);
  model->SetSeed(2);
  model->Forward(x, &c, true);
  int differ = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    ASSERT_EQ(a[i], b[i]);
    differ += a[i] != c[i];
  }
  EXPECT_GT(differ, 0);
}

TEST(Sequential, SteadyStateTrainingStepsAllocateNothing) {
  for (const ModelConfig& config : {Mlp({256, 256}, 0.2), Cnn()}) {
    std::unique_ptr<Sequential> model = Build(config, 10);
    ASSERT_NE(model, nullptr);
    std::mt19937_64 rng(10);
    Tensor x = RandomImages(8, &rng);
    const std::vector<int32_t> labels = RandomLabels(8, &rng);
    int ready = 0;
    model->SetGradReadyCallback([&ready](Parameter*) { ++ready; });
    Tensor logits;
    Tensor grad;
    auto step = [&] {
      model->ZeroGrad();
      model->Forward(x, &logits, true);
      SoftmaxCrossEntropy(logits, labels, &grad);
      model->Backward(grad);
    };
    step();  // the first step sizes every buffer
    g_allocations = 0;
    g_count_allocations = true;
    step();
    step();
    g_count_allocations = false;
    EXPECT_EQ(g_allocations.load(), 0) << config.name;
    EXPECT_EQ(ready, 3 * static_cast<int>(model->Parameters().size()));
  }
}

TEST(Sequential, TheAllocationCounterSeesTensorAllocations) {
  // Guards the test above against a counter that never counts.
  g_allocations = 0;
  g_count_allocations = true;
  { Tensor t({16}); }
  g_count_allocations = false;
  EXPECT_GE(g_allocations.load(), 1);
}

// ------------------------------------------------------------------ PyTorch

constexpr char kTorchScript[] = R"PY(
import sys
import torch

d, kind, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
nn = torch.nn
if kind == "mlp":
    layers, width = [nn.Flatten()], 784
    for h in [int(v) for v in sys.argv[4].split(",")]:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 10))
else:
    layers = [nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10)]
model = nn.Sequential(*layers)

def load(name, dtype):
    with open(f"{d}/{name}.bin", "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)

with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(load(name, torch.float32).reshape(p.shape))
x = load("input", torch.float32).reshape(n, 1, 28, 28)
y = load("labels", torch.int32).long()
logits = model(x)
loss = nn.functional.cross_entropy(logits, y)
loss.backward()
with open(f"{d}/torch_names.txt", "w") as f:
    f.write("\n".join(name for name, _ in model.named_parameters()))
with open(f"{d}/torch_loss.txt", "w") as f:
    f.write(repr(loss.item()))
with open(f"{d}/torch_logits.bin", "wb") as f:
    f.write(logits.detach().numpy().astype("<f4").tobytes())
for name, p in model.named_parameters():
    with open(f"{d}/torch_grad_{name}.bin", "wb") as f:
        f.write(p.grad.numpy().astype("<f4").tobytes())
)PY";

constexpr char kPython[] = "/usr/bin/python3";

bool TorchAvailable() {
  const std::string cmd = std::string(kPython) + " -c 'import torch' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_nn_XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteRaw(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<double> ReadFloats(const std::string& path) {
  const std::string bytes = ReadAll(path);
  std::vector<float> f(bytes.size() / sizeof(float));
  std::memcpy(f.data(), bytes.data(), f.size() * sizeof(float));
  return std::vector<double>(f.begin(), f.end());
}

std::vector<double> AsDoubles(const Tensor& t) {
  return std::vector<double>(t.data(), t.data() + t.numel());
}

// Runs the same model in PyTorch on the same weights and batch, and compares
// loss, logits and every parameter gradient (‖a−b‖/‖b‖ per tensor).
void ExpectMatchesTorch(const ModelConfig& config, int64_t n, const std::string& hidden_arg,
                        double tolerance) {
  std::unique_ptr<Sequential> model = Build(config, 2024);
  ASSERT_NE(model, nullptr);
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::mt19937_64 rng(2024);
  Tensor x = RandomImages(n, &rng);
  const std::vector<int32_t> labels = RandomLabels(n, &rng);
  WriteRaw(dir.path() + "/input.bin", x.data(), static_cast<size_t>(x.numel()) * 4);
  WriteRaw(dir.path() + "/labels.bin", labels.data(), labels.size() * 4);
  for (const Parameter* p : model->Parameters()) {
    WriteRaw(dir.path() + "/" + p->name + ".bin", p->value.data(),
             static_cast<size_t>(p->value.numel()) * 4);
  }
  WriteRaw(dir.path() + "/check.py", kTorchScript, sizeof(kTorchScript) - 1);
  const std::string cmd = std::string(kPython) + " " + dir.path() + "/check.py " + dir.path() +
                          " " + config.name + " " + std::to_string(n) + " " + hidden_arg + " 2>" +
                          dir.path() + "/stderr.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << ReadAll(dir.path() + "/stderr.txt");

  Tensor logits;
  Tensor grad;
  model->ZeroGrad();
  model->Forward(x, &logits, true);
  const double loss = SoftmaxCrossEntropy(logits, labels, &grad);
  model->Backward(grad);

  std::string names;
  for (const Parameter* p : model->Parameters()) {
    if (!names.empty()) names += "\n";
    names += p->name;
  }
  EXPECT_EQ(names, ReadAll(dir.path() + "/torch_names.txt"));
  const double torch_loss = std::stod(ReadAll(dir.path() + "/torch_loss.txt"));
  EXPECT_LT(std::fabs(loss - torch_loss) / std::fabs(torch_loss), tolerance)
      << "aidn " << loss << " torch " << torch_loss;
  const double logits_error =
      RelativeError(AsDoubles(logits), ReadFloats(dir.path() + "/torch_logits.bin"));
  EXPECT_LT(logits_error, tolerance);
  double worst = logits_error;
  for (const Parameter* p : model->Parameters()) {
    const std::vector<double> want = ReadFloats(dir.path() + "/torch_grad_" + p->name + ".bin");
    ASSERT_EQ(static_cast<int64_t>(want.size()), p->grad.numel()) << p->name;
    const double error = RelativeError(AsDoubles(p->grad), want);
    EXPECT_LT(error, tolerance) << p->name;
    worst = std::max(worst, error);
  }
  std::printf("[ torch    ] %s: loss %.7f (torch %.7f), worst relative error %.2e\n",
              config.name.c_str(), loss, torch_loss, worst);
}

TEST(TorchCrossCheck, MlpLossAndGradientsMatchPyTorch) {
  if (!TorchAvailable()) GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  ExpectMatchesTorch(Mlp({256, 256}), 16, "256,256", 1e-4);
}

TEST(TorchCrossCheck, CnnLossAndGradientsMatchPyTorch) {
  if (!TorchAvailable()) GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
  ExpectMatchesTorch(Cnn(), 8, "-", 1e-3);
}

// ---------------------------------------------------------------- BLAS core

// Run by BlasCoreOverride.TheOverrideIsTakenByANewProcess in a child process.
TEST(BlasCore, PrintsTheCoreInUse) { std::printf("blas-core=%s\n", BlasCoreName().c_str()); }

TEST(BlasCoreOverride, LeavesAnExplicitChoiceAlone) {
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = before == nullptr ? "" : before;
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  EXPECT_EQ(BlasCoreOverride(), "");
  if (before == nullptr) {
    unsetenv("OPENBLAS_CORETYPE");
  } else {
    setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  }
}

TEST(BlasCoreOverride, TheOverrideIsTakenByANewProcess) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) GTEST_SKIP() << "OPENBLAS_CORETYPE is set";
  const std::string core = BlasCoreName();
  ASSERT_FALSE(core.empty());
  const std::string override_env = BlasCoreOverride();
  if (override_env.empty()) {
    GTEST_SKIP() << "no override here: OpenBLAS uses " << core
                 << (__builtin_cpu_supports("avx512f") ? " (an AVX-512 core)" : " (no AVX-512)");
  }
  EXPECT_EQ(override_env, "OPENBLAS_CORETYPE=SkylakeX");
  EXPECT_TRUE(__builtin_cpu_supports("avx512f"));
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string command =
      override_env + " '" + self + "' --gtest_filter=BlasCore.PrintsTheCoreInUse 2>&1";
  FILE* child = popen(command.c_str(), "r");
  ASSERT_NE(child, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), child) != nullptr) output += buffer;
  ASSERT_EQ(pclose(child), 0) << output;
  EXPECT_NE(output.find("blas-core=SkylakeX"), std::string::npos)
      << "this process uses " << core << "; the child printed:\n"
      << output;
}

}  // namespace
}  // namespace aidn::engine
