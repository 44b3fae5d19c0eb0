#include "worker/engine/optimizer.h"

#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/support/process.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

Parameter MakeParam(std::string name, std::vector<int64_t> shape, std::vector<float> values = {}) {
  Parameter p;
  p.name = std::move(name);
  p.value = Tensor(shape);
  p.grad = Tensor(shape);
  for (size_t i = 0; i < values.size(); ++i) p.value[static_cast<int64_t>(i)] = values[i];
  return p;
}

// Runs three steps of `config` at lr 0.1 on a one-element parameter that
// starts at 1.0, with gradients 0.5, -0.25, 1.0; returns p after each step.
std::vector<double> ThreeSteps(OptimizerConfig config) {
  Parameter p = MakeParam("w", {1}, {1.0f});
  auto opt = Optimizer::Create(config, {&p});
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return {};
  std::vector<double> out;
  for (float g : {0.5f, -0.25f, 1.0f}) {
    p.grad[0] = g;
    EXPECT_TRUE((*opt)->Step(0.1).ok());
    out.push_back(p.value[0]);
  }
  EXPECT_EQ((*opt)->steps(), 3);
  return out;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i])) << "after step " << i + 1;
  }
}

TEST(Sgd, PlainStepsSubtractLrTimesGradient) {
  OptimizerConfig c;
  c.name = "sgd";
  // 1 - 0.1*0.5 = 0.95; 0.95 + 0.1*0.25 = 0.975; 0.975 - 0.1*1 = 0.875.
  ExpectNear(ThreeSteps(c), {0.95, 0.975, 0.875});
}

TEST(Sgd, MomentumStartsTheBufferAtTheFirstGradient) {
  OptimizerConfig c;
  c.momentum = 0.9;
  // buf 0.5 → p 0.95; buf 0.9*0.5 - 0.25 = 0.2 → p 0.93; buf 0.18 + 1 = 1.18 → p 0.812.
  ExpectNear(ThreeSteps(c), {0.95, 0.93, 0.812});
}

TEST(Sgd, NesterovStepsAlongGradientPlusMomentumTimesBuffer) {
  OptimizerConfig c;
  c.momentum = 0.9;
  c.nesterov = true;
  // buf 0.5, d 0.5 + 0.45 = 0.95 → 0.905; buf 0.2, d -0.25 + 0.18 = -0.07 → 0.912;
  // buf 1.18, d 1 + 1.062 = 2.062 → 0.7058.
  ExpectNear(ThreeSteps(c), {0.905, 0.912, 0.7058});
}

TEST(Sgd, WeightDecayIsAddedToTheGradientBeforeMomentum) {
  OptimizerConfig c;
  c.momentum = 0.9;
  c.weight_decay = 0.1;
  // d 0.5 + 0.1 = 0.6 → 0.94; d -0.25 + 0.094 = -0.156, buf 0.54 - 0.156 = 0.384 → 0.9016;
  // d 1 + 0.09016, buf 0.3456 + 1.09016 = 1.43576 → 0.758024.
  ExpectNear(ThreeSteps(c), {0.94, 0.9016, 0.758024});
}

TEST(Sgd, WeightDecayWithoutMomentumIsPlainL2) {
  OptimizerConfig c;
  c.weight_decay = 0.1;
  // 0.94; d -0.25 + 0.094 → 0.9556; d 1 + 0.09556 → 0.846044.
  ExpectNear(ThreeSteps(c), {0.94, 0.9556, 0.846044});
}

TEST(AdamW, MatchesTheClosedFormOverThreeSteps) {
  OptimizerConfig c;
  c.name = "adamw";
  c.weight_decay = 0.01;
  // Step 1: p = 1 * (1 - 0.1*0.01) = 0.999; m = 0.05, v = 0.00025;
  // m̂ = 0.05/0.1 = 0.5, sqrt(v̂) = sqrt(0.00025/0.001) = 0.5;
  // p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.899000002. Steps 2, 3 likewise
  // (m 0.02, 0.118; v 0.00031225, 0.00131193775).
  ExpectNear(ThreeSteps(c), {0.899000002, 0.8714672987058463, 0.804784672376384});
}

TEST(AdamW, WithoutWeightDecayLeavesTheDecayOut) {
  OptimizerConfig c;
  c.name = "adamw";
  ExpectNear(ThreeSteps(c), {0.900000002, 0.8733662987078463, 0.8075551396770898});
}

// decay_matrices_only: a [1, 1] matrix follows the decayed closed form, a
// [1] vector (a bias) the undecayed one, under both optimizers.
TEST(Optimizer, DecayMatricesOnlyLeavesVectorsUndecayed) {
  for (const char* name : {"adamw", "sgd"}) {
    OptimizerConfig c;
    c.name = name;
    c.weight_decay = name == std::string("adamw") ? 0.01 : 0.1;
    c.decay_matrices_only = true;
    Parameter matrix = MakeParam("w", {1, 1}, {1.0f});
    Parameter vector = MakeParam("b", {1}, {1.0f});
    auto opt = Optimizer::Create(c, {&matrix, &vector});
    ASSERT_TRUE(opt.ok()) << opt.status();
    std::vector<double> m, v;
    for (float g : {0.5f, -0.25f, 1.0f}) {
      matrix.grad[0] = g;
      vector.grad[0] = g;
      ASSERT_TRUE((*opt)->Step(0.1).ok());
      m.push_back(matrix.value[0]);
      v.push_back(vector.value[0]);
    }
    OptimizerConfig all = c;
    all.decay_matrices_only = false;
    OptimizerConfig none = c;
    none.weight_decay = 0.0;
    SCOPED_TRACE(name);
    ExpectNear(m, ThreeSteps(all));
    ExpectNear(v, ThreeSteps(none));
  }
}

TEST(AdamW, KeepsItsMomentsAsStateNamedAfterTheParameter) {
  OptimizerConfig c;
  c.name = "adamw";
  Parameter p = MakeParam("1.weight", {1}, {1.0f});
  auto opt = Optimizer::Create(c, {&p});
  ASSERT_TRUE(opt.ok()) << opt.status();
  p.grad[0] = 0.5f;
  ASSERT_TRUE((*opt)->Step(0.1).ok());
  p.grad[0] = -0.25f;
  ASSERT_TRUE((*opt)->Step(0.1).ok());
  auto state = (*opt)->State();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].first, "1.weight.exp_avg");
  EXPECT_EQ(state[1].first, "1.weight.exp_avg_sq");
  EXPECT_NEAR((*state[0].second)[0], 0.02, 1e-8);
  EXPECT_NEAR((*state[1].second)[0], 0.00031225, 1e-10);
}

TEST(Optimizer, AllocatesItsStateOnceAndUpdatesItInPlace) {
  for (const char* name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    OptimizerConfig c;
    c.name = name;
    c.momentum = std::string(name) == "sgd" ? 0.9 : 0.0;
    Parameter a = MakeParam("a", {3, 5});
    Parameter b = MakeParam("b", {5});
    auto opt = Optimizer::Create(c, {&a, &b});
    ASSERT_TRUE(opt.ok()) << opt.status();
    std::vector<const float*> before;
    for (const auto& [n, t] : (*opt)->State()) before.push_back(t->data());
    ASSERT_FALSE(before.empty());
    a.grad.Fill(1.0f);
    b.grad.Fill(-1.0f);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*opt)->Step(0.01).ok());
    std::vector<const float*> after;
    for (const auto& [n, t] : (*opt)->State()) after.push_back(t->data());
    EXPECT_EQ(before, after);
    EXPECT_NE((*(*opt)->State()[0].second)[0], 0.0f);
  }
}

TEST(Optimizer, PlainSgdHasNoState) {
  Parameter p = MakeParam("w", {4});
  auto opt = Optimizer::Create(OptimizerConfig{}, {&p});
  ASSERT_TRUE(opt.ok());
  EXPECT_TRUE((*opt)->State().empty());
}

TEST(Optimizer, CreateRefusesBadConfigsAndParameters) {
  Parameter p = MakeParam("w", {2});
  auto refused = [&](OptimizerConfig c, absl::string_view needle) {
    auto opt = Optimizer::Create(c, {&p});
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_THAT(std::string(opt.status().message()), HasSubstr(std::string(needle)));
  };
  OptimizerConfig c;
  c.name = "adagrad";
  refused(c, "adagrad");
  c = OptimizerConfig{};
  c.nesterov = true;
  refused(c, "nesterov");
  c = OptimizerConfig{};
  c.lr = -1;
  refused(c, "lr");
  c = OptimizerConfig{};
  c.lr = NAN;
  refused(c, "lr");
  c = OptimizerConfig{};
  c.momentum = -0.5;
  refused(c, "momentum");
  c = OptimizerConfig{};
  c.weight_decay = -0.1;
  refused(c, "weight_decay");
  c = OptimizerConfig{};
  c.grad_clip_norm = -1;
  refused(c, "grad_clip_norm");
  c = OptimizerConfig{};
  c.name = "adamw";
  c.beta1 = 1.0;
  refused(c, "beta1");
  c.beta1 = 0.9;
  c.beta2 = -0.1;
  refused(c, "beta2");
  c.beta2 = 0.999;
  c.eps = -1;
  refused(c, "eps");

  EXPECT_EQ(Optimizer::Create(OptimizerConfig{}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Optimizer::Create(OptimizerConfig{}, {nullptr}).status().code(),
            absl::StatusCode::kInvalidArgument);
  Parameter twin = MakeParam("w", {2});
  auto dup = Optimizer::Create(OptimizerConfig{}, {&p, &twin});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dup.status().message()), HasSubstr("\"w\""));
  Parameter odd = MakeParam("odd", {2});
  odd.grad = Tensor({3});
  auto mismatch = Optimizer::Create(OptimizerConfig{}, {&odd});
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("odd"));
}

TEST(Optimizer, StepRefusesABadLearningRateAndResizedParameters) {
  Parameter p = MakeParam("w", {2}, {1.0f, 2.0f});
  OptimizerConfig c;
  c.momentum = 0.9;
  auto opt = Optimizer::Create(c, {&p});
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->Step(-0.1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->Step(INFINITY).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->Step(NAN).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->steps(), 0);
  EXPECT_EQ(p.value[0], 1.0f);
  p.value.Resize({4});
  p.grad.Resize({4});
  auto status = (*opt)->Step(0.1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("w"));
}

// Two optimizers: one runs 3 steps; the other runs 2, is saved and loaded
// into a fresh optimizer over a copy of the parameters, which then takes the
// third step. Both must agree exactly.
void ExpectResumeMatches(const OptimizerConfig& c) {
  std::vector<std::vector<float>> grads = {
      {0.5f, -1.0f, 2.0f}, {0.25f, 0.5f, -1.5f}, {-0.75f, 1.0f, 0.125f}};
  Parameter full = MakeParam("w", {3}, {1.0f, -1.0f, 0.5f});
  auto a = Optimizer::Create(c, {&full});
  ASSERT_TRUE(a.ok());
  Parameter first = MakeParam("w", {3}, {1.0f, -1.0f, 0.5f});
  auto b = Optimizer::Create(c, {&first});
  ASSERT_TRUE(b.ok());
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 3; ++i) full.grad[i] = first.grad[i] = grads[s][i];
    ASSERT_TRUE((*a)->Step(0.1).ok());
    ASSERT_TRUE((*b)->Step(0.1).ok());
  }
  // The "checkpoint": copies of b's state.
  std::vector<Tensor> saved;
  std::vector<Optimizer::StateEntry> entries;
  for (const auto& [name, t] : (*b)->State()) saved.push_back(t->Clone());
  size_t k = 0;
  for (const auto& [name, t] : (*b)->State()) entries.emplace_back(name, &saved[k++]);

  Parameter resumed = MakeParam("w", {3});
  for (int i = 0; i < 3; ++i) resumed.value[i] = first.value[i];
  auto r = Optimizer::Create(c, {&resumed});
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->LoadState(entries, (*b)->steps()).ok());
  EXPECT_EQ((*r)->steps(), 2);
  for (int i = 0; i < 3; ++i) full.grad[i] = resumed.grad[i] = grads[2][i];
  ASSERT_TRUE((*a)->Step(0.1).ok());
  ASSERT_TRUE((*r)->Step(0.1).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.value[i], full.value[i]) << i;
}

TEST(Optimizer, ResumesExactlyFromLoadedState) {
  OptimizerConfig sgd;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  sgd.weight_decay = 0.01;
  ExpectResumeMatches(sgd);
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.weight_decay = 0.01;
  ExpectResumeMatches(adamw);
}

TEST(Optimizer, LoadStateValidatesNamesAndShapesAndChangesNothingOnError) {
  OptimizerConfig c;
  c.name = "adamw";
  Parameter p = MakeParam("w", {2});
  auto opt = Optimizer::Create(c, {&p});
  ASSERT_TRUE(opt.ok());
  Tensor m({2});
  m.Fill(3.0f);
  Tensor v({2});
  v.Fill(4.0f);
  Tensor wrong({3});
  auto expect_refused = [&](std::vector<Optimizer::StateEntry> entries, absl::string_view what) {
    absl::Status s = (*opt)->LoadState(entries, 7);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(s.message()), HasSubstr(std::string(what)));
    EXPECT_EQ((*opt)->steps(), 0);
    EXPECT_EQ((*(*opt)->State()[0].second)[0], 0.0f);
  };
  expect_refused({{"w.exp_avg", &m}}, "w.exp_avg_sq");                                  // missing
  expect_refused({{"w.exp_avg", &m}, {"w.exp_avg_sq", &wrong}}, "[3]");                 // shape
  expect_refused({{"w.exp_avg", &m}, {"w.exp_avg_sq", &v}, {"w.step", &v}}, "w.step");  // extra
  expect_refused({{"w.exp_avg", &m}, {"w.exp_avg", &m}}, "twice");
  expect_refused({{"w.momentum_buffer", &m}, {"w.exp_avg_sq", &v}}, "w.exp_avg");

  ASSERT_TRUE((*opt)->LoadState({{"w.exp_avg_sq", &v}, {"w.exp_avg", &m}}, 7).ok());
  EXPECT_EQ((*opt)->steps(), 7);
  EXPECT_EQ((*(*opt)->State()[0].second)[1], 3.0f);
  EXPECT_EQ((*(*opt)->State()[1].second)[1], 4.0f);
}

TEST(ClipGradNorm, ScalesGradientsDownToMaxNormAndReturnsTheNormBefore) {
  Parameter a = MakeParam("a", {2});
  Parameter b = MakeParam("b", {1});
  a.grad[0] = 3.0f;
  a.grad[1] = 4.0f;
  b.grad[0] = 12.0f;  // total sqrt(9 + 16 + 144) = 13
  EXPECT_DOUBLE_EQ(ClipGradNorm({&a, &b}, 26.0), 13.0);
  EXPECT_EQ(a.grad[0], 3.0f);  // coefficient 2: left alone
  EXPECT_EQ(b.grad[0], 12.0f);
  EXPECT_DOUBLE_EQ(ClipGradNorm({&a, &b}, 6.5), 13.0);
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_FLOAT_EQ(a.grad[0], static_cast<float>(3.0 * coef));
  EXPECT_FLOAT_EQ(a.grad[1], static_cast<float>(4.0 * coef));
  EXPECT_FLOAT_EQ(b.grad[0], static_cast<float>(12.0 * coef));
  EXPECT_NEAR(ClipGradNorm({&a, &b}, 100.0), 6.5, 1e-5);
}

TEST(ClipGradNorm, LeavesNonFiniteGradientsAlone) {
  Parameter a = MakeParam("a", {2});
  a.grad[0] = INFINITY;
  a.grad[1] = 1.0f;
  EXPECT_TRUE(std::isinf(ClipGradNorm({&a}, 1.0)));
  EXPECT_EQ(a.grad[1], 1.0f);
}

TEST(Optimizer, ClippingInStepEqualsClipGradNormThenStepAndKeepsGradients) {
  for (const char* name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    OptimizerConfig clipped;
    clipped.name = name;
    clipped.momentum = std::string(name) == "sgd" ? 0.9 : 0.0;
    clipped.grad_clip_norm = 1.0;
    OptimizerConfig plain = clipped;
    plain.grad_clip_norm = 0;
    Parameter x = MakeParam("x", {3}, {1.0f, 2.0f, 3.0f});
    Parameter y = MakeParam("x", {3}, {1.0f, 2.0f, 3.0f});
    auto ox = Optimizer::Create(clipped, {&x});
    auto oy = Optimizer::Create(plain, {&y});
    ASSERT_TRUE(ox.ok() && oy.ok());
    for (int s = 0; s < 3; ++s) {
      for (int i = 0; i < 3; ++i) x.grad[i] = y.grad[i] = static_cast<float>(2 * i + s - 1);
      const double norm = ClipGradNorm({&y}, 1.0);
      ASSERT_TRUE((*ox)->Step(0.1).ok());
      ASSERT_TRUE((*oy)->Step(0.1).ok());
      EXPECT_DOUBLE_EQ((*ox)->last_grad_norm(), norm);
      EXPECT_EQ(x.grad[2], static_cast<float>(4 + s - 1));  // not modified
      for (int i = 0; i < 3; ++i) EXPECT_EQ(x.value[i], y.value[i]) << "step " << s << " i " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// The oracle: torch.optim on the same parameters and gradients.

constexpr char kOptimizerOracleScript[] = R"PY(
import json, os, struct, sys
import torch

d = sys.argv[1]
spec = json.load(open(os.path.join(d, "spec.json")))
shapes = spec["shapes"]

def load(name, shape):
    with open(os.path.join(d, name), "rb") as f:
        raw = f.read()
    values = struct.unpack("<%df" % (len(raw) // 4), raw)
    return torch.tensor(values, dtype=torch.float32).reshape(shape)

def save(name, t):
    flat = t.detach().reshape(-1).tolist()
    with open(os.path.join(d, name), "wb") as f:
        f.write(struct.pack("<%df" % len(flat), *flat))

for ci, c in enumerate(spec["configs"]):
    params = [torch.nn.Parameter(load("init_p%d.bin" % k, s)) for k, s in enumerate(shapes)]
    if c["name"] == "sgd":
        opt = torch.optim.SGD(params, lr=spec["lrs"][0], momentum=c["momentum"],
                              nesterov=c["nesterov"], weight_decay=c["wd"], foreach=False)
    else:
        opt = torch.optim.AdamW(params, lr=spec["lrs"][0], betas=(c["b1"], c["b2"]),
                                eps=c["eps"], weight_decay=c["wd"], foreach=False)
    for s in range(spec["steps"]):
        for k, p in enumerate(params):
            p.grad = load("grad_s%d_p%d.bin" % (s, k), shapes[k])
        if c["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, c["clip"])
        for g in opt.param_groups:
            g["lr"] = spec["lrs"][s]
        opt.step()
    for k, p in enumerate(params):
        save("out_c%d_p%d.bin" % (ci, k), p)
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if opt.state[p].get(key) is not None:
                save("state_c%d_p%d_%s.bin" % (ci, k, key), opt.state[p][key])
print("ok")
)PY";

void WriteFloats(const std::string& path, const Tensor& t) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data()),
            static_cast<std::streamsize>(t.numel() * sizeof(float)));
  ASSERT_TRUE(out.good()) << path;
}

std::vector<float> ReadFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> v(raw.size() / sizeof(float));
  std::memcpy(v.data(), raw.data(), v.size() * sizeof(float));
  return v;
}

// How far aidn's tensor `a` is from torch's `b`, relative to the tensor's
// scale: the larger of ‖b‖ and ‖scale‖ (its values before the steps), so a
// value that cancels to near zero is not judged by its own tiny size.
// Reported as a norm (‖a − b‖ / scale, the measure the integration oracle
// uses) and per element (max |a − b| / max |scale or b|). Both sides round in
// float32 but not identically (torch's kernels fuse some multiply-adds), so
// elements may differ by an ulp or two; bit equality is not the bar.
struct Error {
  double tensor = 0;
  double element = 0;
};
Error Compare(const Tensor& a, const std::vector<float>& b, const std::vector<float>& scale) {
  Error e;
  double diff = 0, norm_b = 0, norm_s = 0, max_diff = 0, max_abs = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double bi = b[static_cast<size_t>(i)];
    const double si = scale[static_cast<size_t>(i)];
    const double d = static_cast<double>(a[i]) - bi;
    diff += d * d;
    norm_b += bi * bi;
    norm_s += si * si;
    max_diff = std::max(max_diff, std::fabs(d));
    max_abs = std::max({max_abs, std::fabs(bi), std::fabs(si)});
  }
  const double norm = std::sqrt(std::max(norm_b, norm_s));
  e.tensor = norm > 0 ? std::sqrt(diff) / norm : std::sqrt(diff);
  e.element = max_abs > 0 ? max_diff / max_abs : max_diff;
  return e;
}

TEST(Optimizer, MatchesTorchOptimStepForStep) {
  if (!testing::PythonHasTorch()) {
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (install python3-torch): skipping the "
                    "comparison with torch.optim; the hand-computed tests still ran";
  }
  char tmpl[] = "/tmp/aidn_optimizer_test_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};

  // Odd sizes so vectorised loops run their tails.
  const std::vector<std::vector<int64_t>> shapes = {{37, 19}, {19}, {1}};
  const int steps = 5;
  const std::vector<double> lrs = {0.1, 0.05, 0.2, 0.01, 0.1};
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t k = 0; k < shapes.size(); ++k) {
    Tensor t(shapes[k]);
    for (int64_t i = 0; i < t.numel(); ++i) t[i] = uniform(rng);
    WriteFloats(absl::StrCat(dir, "/init_p", k, ".bin"), t);
    for (int s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < t.numel(); ++i) t[i] = uniform(rng) * (s == 2 ? 5.0f : 1.0f);
      WriteFloats(absl::StrCat(dir, "/grad_s", s, "_p", k, ".bin"), t);
    }
  }

  struct Case {
    OptimizerConfig config;
    std::string label;
  };
  std::vector<Case> cases;
  auto sgd = [&](double momentum, bool nesterov, double wd, double clip, std::string label) {
    OptimizerConfig c;
    c.momentum = momentum;
    c.nesterov = nesterov;
    c.weight_decay = wd;
    c.grad_clip_norm = clip;
    cases.push_back({c, label});
  };
  auto adamw = [&](double wd, double b1, double b2, double eps, double clip, std::string label) {
    OptimizerConfig c;
    c.name = "adamw";
    c.weight_decay = wd;
    c.beta1 = b1;
    c.beta2 = b2;
    c.eps = eps;
    c.grad_clip_norm = clip;
    cases.push_back({c, label});
  };
  sgd(0, false, 0, 0, "sgd");
  sgd(0.9, false, 0, 0, "sgd momentum");
  sgd(0.9, true, 0, 0, "sgd nesterov");
  sgd(0.9, false, 1e-2, 0, "sgd momentum weight decay");
  sgd(0, false, 1e-2, 0, "sgd weight decay");
  sgd(0.5, true, 5e-4, 1.0, "sgd nesterov weight decay clip");
  adamw(0.01, 0.9, 0.999, 1e-8, 0, "adamw");
  adamw(0, 0.9, 0.999, 1e-8, 0, "adamw no decay");
  adamw(0.1, 0.8, 0.99, 1e-6, 2.0, "adamw clip");

  std::string spec = absl::StrCat("{\"steps\": ", steps, ", \"shapes\": [");
  for (size_t k = 0; k < shapes.size(); ++k) {
    absl::StrAppend(&spec, k ? ", " : "", "[");
    for (size_t i = 0; i < shapes[k].size(); ++i)
      absl::StrAppend(&spec, i ? ", " : "", shapes[k][i]);
    absl::StrAppend(&spec, "]");
  }
  absl::StrAppend(&spec, "], \"lrs\": [");
  for (size_t s = 0; s < lrs.size(); ++s) {
    absl::StrAppend(&spec, s ? ", " : "", absl::StrFormat("%.17g", lrs[s]));
  }
  absl::StrAppend(&spec, "], \"configs\": [");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const OptimizerConfig& c = cases[ci].config;
    absl::StrAppend(
        &spec, ci ? ", " : "",
        absl::StrFormat("{\"name\": \"%s\", \"momentum\": %.17g, \"nesterov\": %s, \"wd\": %.17g, "
                        "\"b1\": %.17g, \"b2\": %.17g, \"eps\": %.17g, \"clip\": %.17g}",
                        c.name, c.momentum, c.nesterov ? "true" : "false", c.weight_decay, c.beta1,
                        c.beta2, c.eps, c.grad_clip_norm));
  }
  absl::StrAppend(&spec, "]}");
  {
    std::ofstream(dir + "/spec.json") << spec;
    std::ofstream(dir + "/oracle.py") << kOptimizerOracleScript;
  }
  const std::string command =
      absl::StrCat("/usr/bin/python3 ", dir, "/oracle.py ", dir, " >", dir, "/oracle.log 2>&1");
  const int rc = std::system(command.c_str());
  std::ifstream log_file(dir + "/oracle.log");
  const std::string log((std::istreambuf_iterator<char>(log_file)),
                        std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << "torch oracle failed:\n" << log;

  for (size_t ci = 0; ci < cases.size(); ++ci) {
    SCOPED_TRACE(cases[ci].label);
    std::vector<Parameter> params;
    for (size_t k = 0; k < shapes.size(); ++k) {
      params.push_back(MakeParam(absl::StrCat("p", k), shapes[k]));
      const std::vector<float> init = ReadFloats(absl::StrCat(dir, "/init_p", k, ".bin"));
      ASSERT_EQ(static_cast<int64_t>(init.size()), params.back().value.numel());
      std::memcpy(params.back().value.data(), init.data(), init.size() * sizeof(float));
    }
    std::vector<Parameter*> ptrs;
    for (Parameter& p : params) ptrs.push_back(&p);
    auto opt = Optimizer::Create(cases[ci].config, ptrs);
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (int s = 0; s < steps; ++s) {
      for (size_t k = 0; k < shapes.size(); ++k) {
        const std::vector<float> g = ReadFloats(absl::StrCat(dir, "/grad_s", s, "_p", k, ".bin"));
        std::memcpy(params[k].grad.data(), g.data(), g.size() * sizeof(float));
      }
      ASSERT_TRUE((*opt)->Step(lrs[static_cast<size_t>(s)]).ok());
    }
    for (size_t k = 0; k < shapes.size(); ++k) {
      const std::vector<float> want = ReadFloats(absl::StrCat(dir, "/out_c", ci, "_p", k, ".bin"));
      ASSERT_EQ(static_cast<int64_t>(want.size()), params[k].value.numel());
      const Error e =
          Compare(params[k].value, want, ReadFloats(absl::StrCat(dir, "/init_p", k, ".bin")));
      std::printf("%-32s p%zu: relative error %.2e (tensor), %.2e (max element)\n",
                  cases[ci].label.c_str(), k, e.tensor, e.element);
      EXPECT_LE(e.tensor, 1e-6) << "p" << k;
      EXPECT_LE(e.element, 1e-6) << "p" << k;
    }
    size_t compared = 0;
    for (const auto& [name, tensor] : (*opt)->State()) {
      // "p0.exp_avg" → state_c<ci>_p0_exp_avg.bin
      const size_t dot = name.find('.');
      const std::string path = absl::StrCat(dir, "/state_c", ci, "_", name.substr(0, dot), "_",
                                            name.substr(dot + 1), ".bin");
      const std::vector<float> want = ReadFloats(path);
      ASSERT_EQ(static_cast<int64_t>(want.size()), tensor->numel()) << path;
      const Error e = Compare(*tensor, want, want);
      EXPECT_LE(e.tensor, 1e-6) << name;
      EXPECT_LE(e.element, 1e-6) << name;
      ++compared;
    }
    EXPECT_EQ(compared, cases[ci].config.name == "adamw"
                            ? 2 * shapes.size()
                            : (cases[ci].config.momentum > 0 ? shapes.size() : 0));
  }
}

}  // namespace
}  // namespace aidn::engine
