// The GPT decoder (worker/engine/gpt.h): parameter names, shapes and counts
// against GPT-2's, the initialisation's statistics, and every parameter's
// gradient against central finite differences of the loss (in double over
// the float model: a directional derivative per tensor). PyTorch checks the
// same model value for value in tests/integration/gpt_torch_test.cc.

#include "worker/engine/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "worker/engine/safetensors.h"
#include "worker/engine/tensor.h"
#include "worker/engine/token_positions.h"

namespace aidn::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

GptConfig Tiny(double dropout = 0.0, bool bias = true) {
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 11;
  c.dropout = dropout;
  c.bias = bias;
  return c;
}

std::vector<int32_t> Tokens(int64_t n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

TEST(GptConfig, NamedConfigsHaveGpt2sParameterCounts) {
  // Hugging Face's GPT-2 small has 124,439,808 parameters (the LM head tied
  // to wte); medium 354,823,168.
  EXPECT_EQ(Gpt::ParameterCount(*NamedGptConfig("gpt2")), 124'439'808);
  EXPECT_EQ(Gpt::ParameterCount(*NamedGptConfig("gpt2-medium")), 354'823'168);
  // nanoGPT's character-level shape over bytes: 6 blocks of 1,774,464,
  // wte and wpe of 256 x 384 each, ln_f 768; the model built agrees.
  absl::StatusOr<std::unique_ptr<Gpt>> chr = Gpt::Create(*NamedGptConfig("gpt-char"), 1);
  ASSERT_TRUE(chr.ok());
  EXPECT_EQ((*chr)->ParameterCount(), 10'844'160);
  EXPECT_EQ(Gpt::ParameterCount((*chr)->config()), 10'844'160);
  std::unique_ptr<Gpt> no_bias = *Gpt::Create(Tiny(0.0, false), 1);
  EXPECT_EQ(no_bias->ParameterCount(), Gpt::ParameterCount(Tiny(0.0, false)));
  EXPECT_EQ(NamedGptConfig("gpt5").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(NamedGptConfig("gpt5").status().message(), HasSubstr("gpt-char"));
}

TEST(GptConfig, BadConfigsNameTheField) {
  GptConfig c = Tiny();
  c.n_head = 3;
  EXPECT_THAT(ValidateGptConfig(c).message(), HasSubstr("multiple of n_head"));
  c = Tiny();
  c.n_layer = 0;
  EXPECT_THAT(ValidateGptConfig(c).message(), HasSubstr("n_layer"));
  c = Tiny();
  c.dropout = 1.0;
  EXPECT_THAT(ValidateGptConfig(c).message(), HasSubstr("dropout"));
  EXPECT_FALSE(Gpt::Create(c, 1).ok());
}

TEST(Gpt, ParametersHaveHuggingFaceNamesAndLayouts) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 1);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const Parameter* p : gpt->Parameters()) shapes[p->name] = p->value.shape();
  EXPECT_EQ(shapes.size(), 2u + 2u * 12u + 2u);
  EXPECT_THAT(shapes["transformer.wte.weight"], ElementsAre(11, 16));
  EXPECT_THAT(shapes["transformer.wpe.weight"], ElementsAre(8, 16));
  EXPECT_THAT(shapes["transformer.h.1.attn.c_attn.weight"], ElementsAre(16, 48));
  EXPECT_THAT(shapes["transformer.h.1.attn.c_proj.weight"], ElementsAre(16, 16));
  EXPECT_THAT(shapes["transformer.h.0.mlp.c_fc.weight"], ElementsAre(16, 64));
  EXPECT_THAT(shapes["transformer.h.0.mlp.c_proj.bias"], ElementsAre(16));
  EXPECT_THAT(shapes["transformer.ln_f.bias"], ElementsAre(16));
  EXPECT_EQ(gpt->Parameters().front()->name, "transformer.wte.weight");
  // decay_matrices_only decays by rank: c_attn's weight yes, ln_1's no.
  EXPECT_EQ(gpt->Parameters()[2]->value.rank(), 1);  // h.0.ln_1.weight
  EXPECT_EQ(gpt->Parameters()[4]->value.rank(), 2);  // h.0.attn.c_attn.weight

  std::unique_ptr<Gpt> no_bias = *Gpt::Create(Tiny(0.0, false), 1);
  EXPECT_EQ(no_bias->Parameters().size(), 2u + 2u * 6u + 1u);
}

TEST(Gpt, InitialisationIsGpt2s) {
  GptConfig c = Tiny();
  c.n_embd = 64;
  c.vocab_size = 256;
  std::unique_ptr<Gpt> gpt = *Gpt::Create(c, 7);
  for (const Parameter* p : gpt->Parameters()) {
    const Tensor& v = p->value;
    double sum = 0.0, sq = 0.0;
    for (int64_t i = 0; i < v.numel(); ++i) {
      sum += v[i];
      sq += static_cast<double>(v[i]) * v[i];
    }
    const double mean = sum / static_cast<double>(v.numel());
    const double std = std::sqrt(sq / static_cast<double>(v.numel()) - mean * mean);
    const std::string& n = p->name;
    if (n.find("ln_") != std::string::npos && n.ends_with("weight")) {
      EXPECT_EQ(mean, 1.0) << n;
    } else if (v.rank() == 1) {
      EXPECT_EQ(sq, 0.0) << n;
    } else {
      const double want = n.ends_with("c_proj.weight") ? 0.02 / std::sqrt(4.0) : 0.02;
      EXPECT_NEAR(std, want, 0.1 * want) << n;
      EXPECT_NEAR(mean, 0.0, 0.1 * want) << n;
    }
  }
  // The same seed, the same weights; another seed, others.
  std::unique_ptr<Gpt> again = *Gpt::Create(c, 7);
  std::unique_ptr<Gpt> other = *Gpt::Create(c, 8);
  const Tensor& w = gpt->Parameters()[4]->value;
  EXPECT_EQ(w[5], again->Parameters()[4]->value[5]);
  EXPECT_NE(w[5], other->Parameters()[4]->value[5]);
}

// The loss in double through the float model after moving every element of
// `p` by `step` * direction.
double LossAt(Gpt& gpt, Parameter* p, const std::vector<float>& direction, double step,
              const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, int64_t b,
              int64_t t, uint64_t seed) {
  std::vector<float> saved(p->value.data(), p->value.data() + p->value.numel());
  for (int64_t i = 0; i < p->value.numel(); ++i) {
    p->value[i] = static_cast<float>(saved[static_cast<size_t>(i)] +
                                     step * direction[static_cast<size_t>(i)]);
  }
  gpt.SetSeed(seed);
  const double loss = gpt.Forward(tokens.data(), targets.data(), b, t, /*training=*/true);
  for (int64_t i = 0; i < p->value.numel(); ++i) p->value[i] = saved[static_cast<size_t>(i)];
  return loss;
}

void CheckGradients(const GptConfig& config, int64_t b, int64_t t) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(config, 3);
  // Larger LayerNorm and bias values than the initialisation's, so that
  // every term of every gradient is exercised.
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Parameter* p : gpt->Parameters()) {
    if (p->value.rank() == 1) {
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value[i] += 0.3f * normal(rng);
    } else {
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value[i] *= 5.0f;
    }
  }
  const std::vector<int32_t> tokens = Tokens(b * t, config.vocab_size, 1);
  const std::vector<int32_t> targets = Tokens(b * t, config.vocab_size, 2);
  constexpr uint64_t kSeed = 99;
  gpt->ZeroGrad();
  std::vector<std::string> ready;
  gpt->SetGradReadyCallback([&ready](Parameter* p) { ready.push_back(p->name); });
  gpt->SetSeed(kSeed);
  gpt->Forward(tokens.data(), targets.data(), b, t, /*training=*/true);
  gpt->Backward();
  // Every parameter a kept block holds reported ready once, wte last; a
  // skipped block's (stochastic_depth) none, their gradients zero.
  const std::vector<Parameter*> unused = gpt->UnusedParameters();
  if (config.stochastic_depth > 0) {
    EXPECT_FALSE(unused.empty()) << "the seed skips no block";
    EXPECT_LT(unused.size() + 6, gpt->Parameters().size()) << "the seed skips every block";
  }
  EXPECT_EQ(ready.size() + unused.size(), gpt->Parameters().size());
  EXPECT_EQ(ready.back(), "transformer.wte.weight");
  for (const Parameter* p : unused) {
    EXPECT_EQ(std::count(ready.begin(), ready.end(), p->name), 0) << p->name;
    for (int64_t i = 0; i < p->grad.numel(); ++i) ASSERT_EQ(p->grad[i], 0.0f) << p->name;
  }

  for (Parameter* p : gpt->Parameters()) {
    std::vector<float> direction(static_cast<size_t>(p->value.numel()));
    double analytic = 0.0;
    for (size_t i = 0; i < direction.size(); ++i) {
      direction[i] = normal(rng);
      analytic += static_cast<double>(direction[i]) * p->grad[static_cast<int64_t>(i)];
    }
    constexpr double kStep = 1e-3;
    const double up = LossAt(*gpt, p, direction, kStep, tokens, targets, b, t, kSeed);
    const double down = LossAt(*gpt, p, direction, -kStep, tokens, targets, b, t, kSeed);
    const double numeric = (up - down) / (2 * kStep);
    EXPECT_NEAR(analytic, numeric, 2e-2 * std::abs(numeric) + 2e-4)
        << p->name << " (dropout " << config.dropout << ", bias " << config.bias << ")";
  }
}

TEST(Gpt, GradientsMatchFiniteDifferences) { CheckGradients(Tiny(), 3, 8); }

TEST(Gpt, GradientsMatchFiniteDifferencesWithDropout) {
  // The same seed draws the same masks in every Forward.
  CheckGradients(Tiny(0.2), 2, 8);
}

TEST(Gpt, GradientsMatchFiniteDifferencesWithoutBiasesOnShortSequences) {
  CheckGradients(Tiny(0.0, false), 2, 5);
}

GptConfig Deep(double dropout, double stochastic_depth) {
  GptConfig c = Tiny(dropout);
  c.n_layer = 4;
  c.stochastic_depth = stochastic_depth;
  return c;
}

TEST(Gpt, GradientsMatchFiniteDifferencesWithStochasticDepth) {
  // The same seed skips the same blocks in every Forward.
  CheckGradients(Deep(0.0, 0.5), 2, 8);
  CheckGradients(Deep(0.1, 0.5), 2, 6);
}

// A skipped block is the identity and a kept one's branches are scaled by
// 1 / (1 - p): the same loss as a model without stochastic depth whose
// residual projections (c_proj's weight and bias, which end each branch)
// are zero in the skipped blocks and scaled in the kept ones. Evaluation
// runs every block unscaled.
TEST(Gpt, StochasticDepthSkipsWholeBlocksAndScalesTheKeptBranches) {
  constexpr double kDrop = 0.5;
  const std::vector<int32_t> tokens = Tokens(16, 11, 1);
  const std::vector<int32_t> targets = Tokens(16, 11, 2);
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Deep(0.0, kDrop), 3);
  std::unique_ptr<Gpt> plain = *Gpt::Create(Deep(0.0, 0.0), 3);
  const Tensor& eval_logits = gpt->Logits(tokens.data(), 2, 8);
  const std::vector<float> want(eval_logits.data(), eval_logits.data() + eval_logits.numel());
  const Tensor& plain_logits = plain->Logits(tokens.data(), 2, 8);
  EXPECT_EQ(std::vector<float>(plain_logits.data(), plain_logits.data() + plain_logits.numel()),
            want);

  gpt->SetSeed(7);
  const double loss = gpt->Forward(tokens.data(), targets.data(), 2, 8, /*training=*/true);
  std::vector<std::string> unused;
  for (const Parameter* p : gpt->UnusedParameters()) unused.push_back(p->name);
  ASSERT_FALSE(unused.empty()) << "seed 7 skips no block";
  ASSERT_LT(unused.size(), 4u * 12) << "seed 7 skips every block";
  for (Parameter* p : plain->Parameters()) {
    if (p->name.find("c_proj") == std::string::npos) continue;
    const bool skipped = std::find(unused.begin(), unused.end(), p->name) != unused.end();
    const float scale = skipped ? 0.0f : static_cast<float>(1.0 / (1.0 - kDrop));
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value[i] *= scale;
  }
  const double emulated = plain->Forward(tokens.data(), targets.data(), 2, 8, /*training=*/true);
  EXPECT_NEAR(loss, emulated, 1e-5 * std::abs(emulated));
  EXPECT_TRUE(plain->UnusedParameters().empty());
}

TEST(Gpt, BackwardAccumulatesAndScales) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  const std::vector<int32_t> tokens = Tokens(16, 11, 1);
  const std::vector<int32_t> targets = Tokens(16, 11, 2);
  gpt->ZeroGrad();
  gpt->Forward(tokens.data(), targets.data(), 2, 8, false);
  gpt->Backward();
  const Tensor& g = gpt->Parameters()[4]->grad;
  std::vector<float> once(g.data(), g.data() + g.numel());
  gpt->Forward(tokens.data(), targets.data(), 2, 8, false);
  gpt->Backward(0.5);
  for (int64_t i = 0; i < g.numel(); ++i) {
    EXPECT_FLOAT_EQ(g[i], 1.5f * once[static_cast<size_t>(i)]) << i;
  }
}

// Activation checkpointing recomputes each block's forward in backward with
// the dropout masks (and skipped blocks) of the first run: the same losses
// and gradients, bit for bit, over micro-steps that do not reseed (the stream goes on as
// without it), and switching it off again gives the first mode back.
TEST(Gpt, ActivationCheckpointingGivesTheSameGradientsBitwise) {
  const std::vector<int32_t> tokens = Tokens(24, 11, 1);
  const std::vector<int32_t> targets = Tokens(24, 11, 2);
  for (const double depth : {0.0, 0.5}) {
    auto run = [&](bool checkpointing, bool toggle) {
      std::unique_ptr<Gpt> gpt = *Gpt::Create(Deep(/*dropout=*/0.2, depth), 3);
      gpt->SetSeed(5);
      gpt->ZeroGrad();
      std::vector<double> losses;
      for (int micro = 0; micro < 3; ++micro) {
        gpt->SetActivationCheckpointing(toggle ? micro % 2 == 1 : checkpointing);
        losses.push_back(gpt->Forward(tokens.data(), targets.data(), 3, 8, /*training=*/true));
        gpt->Backward(1.0 / 3);
      }
      std::vector<float> grads;
      for (const Parameter* p : gpt->Parameters()) {
        grads.insert(grads.end(), p->grad.data(), p->grad.data() + p->grad.numel());
      }
      return std::pair{losses, grads};
    };
    const auto plain = run(false, false);
    for (const auto& [name, other] :
         {std::pair{"checkpointing", run(true, false)}, std::pair{"toggled", run(false, true)}}) {
      EXPECT_EQ(other.first, plain.first) << name;
      ASSERT_EQ(other.second.size(), plain.second.size());
      EXPECT_EQ(std::memcmp(other.second.data(), plain.second.data(),
                            sizeof(float) * plain.second.size()),
                0)
          << name << ", stochastic_depth " << depth;
    }
  }
}

TEST(Gpt, LaterPositionsDoNotChangeEarlierLogits) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  std::vector<int32_t> tokens = Tokens(8, 11, 1);
  const Tensor& logits = gpt->Logits(tokens.data(), 1, 8);
  std::vector<float> before(logits.data(), logits.data() + logits.numel());
  tokens[5] = (tokens[5] + 1) % 11;
  gpt->Logits(tokens.data(), 1, 8);
  for (int64_t i = 0; i < 5 * 11; ++i) EXPECT_EQ(logits[i], before[static_cast<size_t>(i)]) << i;
  bool changed = false;
  for (int64_t i = 5 * 11; i < 8 * 11; ++i) changed |= logits[i] != before[static_cast<size_t>(i)];
  EXPECT_TRUE(changed);
}

// The GPU decoder's embedding gradient sums each token's positions in
// the order these groups give: every position once, grouped by token,
// ascending, tokens ascending.
TEST(TokenPositions, GroupEveryPositionByTokenInAscendingOrder) {
  const std::vector<int32_t> tokens = {5, 0, 5, 9, 0, 5, 3};
  const TokenPositions g = GroupPositionsByToken(tokens.data(), 7, 10);
  EXPECT_EQ(g.tokens, (std::vector<int32_t>{0, 3, 5, 9}));
  EXPECT_EQ(g.offsets, (std::vector<int32_t>{0, 2, 3, 6, 7}));
  EXPECT_EQ(g.positions, (std::vector<int32_t>{1, 4, 6, 0, 2, 5, 3}));

  std::mt19937_64 rng(4);
  std::vector<int32_t> many(5000);
  for (int32_t& t : many) t = static_cast<int32_t>(rng() % 300);
  const TokenPositions h = GroupPositionsByToken(many.data(), 5000, 300);
  ASSERT_EQ(h.offsets.size(), h.tokens.size() + 1);
  ASSERT_EQ(h.offsets.back(), 5000);
  std::vector<int> seen(5000, 0);
  for (size_t u = 0; u < h.tokens.size(); ++u) {
    if (u > 0) {
      EXPECT_LT(h.tokens[u - 1], h.tokens[u]);
    }
    EXPECT_LT(h.offsets[u], h.offsets[u + 1]) << "no empty group";
    for (int32_t k = h.offsets[u]; k < h.offsets[u + 1]; ++k) {
      const int32_t pos = h.positions[static_cast<size_t>(k)];
      EXPECT_EQ(many[static_cast<size_t>(pos)], h.tokens[u]);
      if (k > h.offsets[u]) {
        EXPECT_LT(h.positions[static_cast<size_t>(k) - 1], pos);
      }
      ++seen[static_cast<size_t>(pos)];
    }
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 5000);
  EXPECT_TRUE(GroupPositionsByToken(nullptr, 0, 4).tokens.empty());
}

TEST(GptGenerate, GreedyPicksTheArgmaxAndTopOneIsGreedy) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  SampleOptions greedy;
  greedy.greedy = true;
  greedy.length = 12;  // beyond block_size 8 with the prompt: the context slides
  absl::StatusOr<std::vector<int32_t>> text = Generate(*gpt, {1, 2, 3}, greedy);
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_EQ(text->size(), 15u);
  EXPECT_EQ((*text)[0], 1);
  // Each token is the argmax of the logits at the end of its context.
  for (size_t n = 3; n < text->size(); ++n) {
    const size_t context = std::min<size_t>(n, 8);
    const Tensor& logits =
        gpt->Logits(text->data() + n - context, 1, static_cast<int64_t>(context));
    const float* last = logits.data() + (context - 1) * 11;
    int32_t best = 0;
    for (int32_t v = 1; v < 11; ++v) {
      if (last[v] > last[best]) best = v;
    }
    EXPECT_EQ((*text)[n], best) << n;
  }
  SampleOptions top1;
  top1.top_k = 1;
  top1.length = 12;
  top1.seed = 5;
  EXPECT_EQ(*Generate(*gpt, {1, 2, 3}, top1), *text);
}

TEST(GptGenerate, DrawsRepeatWithTheSeedAndStayInTheTopK) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  SampleOptions o;
  o.length = 30;
  o.top_k = 3;
  o.temperature = 2.0;
  o.seed = 9;
  const std::vector<int32_t> a = *Generate(*gpt, {4}, o);
  EXPECT_EQ(*Generate(*gpt, {4}, o), a);
  o.seed = 10;
  EXPECT_NE(*Generate(*gpt, {4}, o), a);
  for (size_t n = 1; n < a.size(); ++n) {
    const size_t context = std::min<size_t>(n, 8);
    const Tensor& logits = gpt->Logits(a.data() + n - context, 1, static_cast<int64_t>(context));
    const float* last = logits.data() + (context - 1) * 11;
    int above = 0;  // tokens strictly more likely than the one drawn
    for (int32_t v = 0; v < 11; ++v) above += last[v] > last[a[n]];
    EXPECT_LT(above, 3) << n;
  }
}

TEST(GptGenerate, BadOptionsNameTheProblem) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  EXPECT_THAT(Generate(*gpt, {}, {}).status().message(), HasSubstr("empty"));
  EXPECT_THAT(Generate(*gpt, {11}, {}).status().message(), HasSubstr("outside the vocabulary"));
  SampleOptions o;
  o.temperature = 0.0;
  EXPECT_THAT(Generate(*gpt, {1}, o).status().message(), HasSubstr("temperature"));
  o = SampleOptions();
  o.top_k = -1;
  EXPECT_THAT(Generate(*gpt, {1}, o).status().message(), HasSubstr("top_k"));
}

// A model saved with its sizes in the metadata loads back whole: the same
// logits; files without the sizes, or with tensors of another model, are
// refused naming the problem.
TEST(GptFiles, FormatAndLoadGiveTheSameModelBack) {
  const GptConfig c = Tiny();
  EXPECT_EQ(FormatGptConfig(*ParseGptConfig(FormatGptConfig(c))), FormatGptConfig(c));
  EXPECT_FALSE(ParseGptConfig("n_layer=2").ok());
  EXPECT_FALSE(ParseGptConfig(FormatGptConfig(c) + ",colour=3").ok());
  std::unique_ptr<Gpt> gpt = *Gpt::Create(c, 11);
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/gpt_files_test.safetensors";
  std::vector<const Parameter*> params(gpt->Parameters().begin(), gpt->Parameters().end());
  ASSERT_TRUE(SaveSafetensors(path, params, {{"aidn.gpt", FormatGptConfig(c)}}).ok());
  absl::StatusOr<std::unique_ptr<Gpt>> loaded = LoadGpt(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  const Tensor& logits = gpt->Logits(tokens.data(), 1, 5);
  const std::vector<float> want(logits.data(), logits.data() + logits.numel());
  const Tensor& got = (*loaded)->Logits(tokens.data(), 1, 5);
  EXPECT_EQ(std::vector<float>(got.data(), got.data() + got.numel()), want);

  ASSERT_TRUE(SaveSafetensors(path, params, {{"aidn.model", "mlp"}}).ok());
  EXPECT_THAT(LoadGpt(path).status().message(), ::testing::HasSubstr("holds no gpt model"));
  GptConfig wider = c;
  wider.n_embd *= 2;
  ASSERT_TRUE(SaveSafetensors(path, params, {{"aidn.gpt", FormatGptConfig(wider)}}).ok());
  EXPECT_THAT(LoadGpt(path).status().message(), ::testing::HasSubstr("has shape"));
  std::remove(path.c_str());
}

TEST(GptDeathTest, BackwardAfterLogitsAloneAborts) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  const std::vector<int32_t> tokens = Tokens(8, 11, 1);
  gpt->Forward(tokens.data(), tokens.data(), 1, 8, false);
  gpt->Logits(tokens.data(), 1, 8);
  EXPECT_DEATH(gpt->Backward(), "without a Forward");
}

TEST(GptDeathTest, SequencesLongerThanTheBlockAbort) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Tiny(), 3);
  const std::vector<int32_t> tokens(9, 0);
  EXPECT_DEATH(gpt->Logits(tokens.data(), 1, 9), "block_size");
}

}  // namespace
}  // namespace aidn::engine
