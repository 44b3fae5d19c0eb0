// CpuSession: its Step is the hand-written sequence (forward, loss,
// backward, update) bit for bit, with dropout seeds, gradient accumulation
// and clipping; and with 2 Gloo ranks in threads it applies the average of
// the ranks' gradients.

#include "worker/engine/cpu_session.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cpu.h"
#include "worker/engine/gpt.h"
#include "worker/engine/layers.h"
#include "worker/engine/loss.h"
#include "worker/engine/resnet.h"
#include "worker/engine/trainable.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kRows = 8;

// A small MLP with dropout, and SGD with momentum and clipping.
struct Net {
  std::unique_ptr<Sequential> model;
  std::unique_ptr<Optimizer> optimizer;

  static Net Make() {
    ModelConfig config;
    config.hidden_sizes = {32, 16};
    config.dropout = 0.25;
    Net n;
    n.model = *BuildModel(config, /*seed=*/3);
    OptimizerConfig o;
    o.name = "sgd";
    o.lr = 0.05;
    o.momentum = 0.9;
    o.grad_clip_norm = 0.5;
    n.optimizer = *Optimizer::Create(o, n.model->Parameters());
    return n;
  }
};

struct Batch {
  Tensor images = Tensor({kRows, 784});
  std::vector<int32_t> labels = std::vector<int32_t>(kRows);
};

Batch MakeBatch(uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Batch b;
  for (int64_t i = 0; i < b.images.numel(); ++i) b.images[i] = normal(gen);
  for (int32_t& l : b.labels) l = static_cast<int32_t>(gen() % 10);
  return b;
}

// Rank r of n in a thread, over `store`.
absl::StatusOr<std::unique_ptr<Communicator>> GlooRank(int r, int n, const char* prefix,
                                                       InMemoryKeyValueStore* store) {
  GlooOptions options;
  options.rank = r;
  options.world_size = n;
  options.timeout = std::chrono::seconds(30);
  options.prefix = prefix;
  return CreateGlooCommunicator(options, store);
}

void ExpectSameWeights(const Sequential& a, const Sequential& b) {
  ASSERT_EQ(a.Parameters().size(), b.Parameters().size());
  for (size_t i = 0; i < a.Parameters().size(); ++i) {
    const Tensor& x = a.Parameters()[i]->value;
    const Tensor& y = b.Parameters()[i]->value;
    ASSERT_EQ(x.numel(), y.numel());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), static_cast<size_t>(x.numel()) * sizeof(float)), 0)
        << a.Parameters()[i]->name;
  }
}

// The step as the trainer used to write it out, for `micro` batches.
double HandWrittenStep(Net& net, const std::vector<Batch>& micro, int64_t step, double lr) {
  Tensor logits, grad;
  double loss = 0;
  const int64_t accum = static_cast<int64_t>(micro.size());
  net.model->ZeroGrad();
  for (int64_t m = 0; m < accum; ++m) {
    net.model->SetSeed(DropoutSeed(11, step, accum, m, 1, 0));
    net.model->Forward(micro[static_cast<size_t>(m)].images, &logits, /*training=*/true);
    loss += SoftmaxCrossEntropy(logits, micro[static_cast<size_t>(m)].labels, &grad,
                                1.0 / static_cast<double>(accum)) /
            static_cast<double>(accum);
    net.model->Backward(grad);
  }
  EXPECT_TRUE(net.optimizer->Step(lr).ok());
  return loss;
}

std::vector<MicroBatch> MicroBatches(const std::vector<Batch>& batches, int64_t step) {
  std::vector<MicroBatch> micro;
  const int64_t accum = static_cast<int64_t>(batches.size());
  for (int64_t m = 0; m < accum; ++m) {
    const Batch& b = batches[static_cast<size_t>(m)];
    micro.push_back(MicroBatch{&b.images, &b.labels, DropoutSeed(11, step, accum, m, 1, 0)});
  }
  return micro;
}

TEST(CpuSession, AStepIsTheHandWrittenSequenceBitForBit) {
  for (int accum : {1, 3}) {
    Net reference = Net::Make();
    Net net = Net::Make();
    absl::StatusOr<std::unique_ptr<CpuSession>> session =
        CpuSession::Create({}, net.model.get(), net.optimizer.get());
    ASSERT_TRUE(session.ok()) << session.status();
    for (int64_t step = 0; step < 4; ++step) {
      std::vector<Batch> batches;
      for (int m = 0; m < accum; ++m)
        batches.push_back(MakeBatch(static_cast<uint32_t>(100 * step + m)));
      const double want = HandWrittenStep(reference, batches, step, 0.05);
      absl::StatusOr<double> got = (*session)->Step(MicroBatches(batches, step), 0.05);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want) << "accum " << accum << " step " << step;
    }
    ExpectSameWeights(*net.model, *reference.model);
    EXPECT_EQ(net.optimizer->steps(), 4);
    EXPECT_EQ((*session)->last_allreduce_seconds(), 0.0);
  }
}

// A world of one: the reducer only checks that every gradient arrived.
class OneRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  absl::Status AllReduce(float*, size_t, ReduceOp) override { return Unexpected(); }
  absl::Status Broadcast(float*, size_t, int) override { return Unexpected(); }
  absl::Status AllGather(const float*, size_t, float*) override { return Unexpected(); }
  absl::Status ReduceScatter(const float*, size_t, float*, ReduceOp) override {
    return Unexpected();
  }
  absl::Status Barrier() override { return Unexpected(); }
  int64_t sequence() const override { return 0; }

 private:
  static absl::Status Unexpected() { return absl::InternalError("one rank: no collective"); }
};

TEST(CpuSession, WithOneRankTheReducerChangesNothingButTheLossRounding) {
  Net reference = Net::Make();
  Net net = Net::Make();
  OneRank comm;
  absl::StatusOr<std::unique_ptr<CpuSession>> session =
      CpuSession::Create({.communicator = &comm}, net.model.get(), net.optimizer.get());
  ASSERT_TRUE(session.ok()) << session.status();
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<Batch> batches;
    batches.push_back(MakeBatch(static_cast<uint32_t>(7 + step)));
    batches.push_back(MakeBatch(static_cast<uint32_t>(70 + step)));
    const double want = HandWrittenStep(reference, batches, step, 0.05);
    absl::StatusOr<double> got = (*session)->Step(MicroBatches(batches, step), 0.05);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, static_cast<double>(static_cast<float>(want)));
  }
  ExpectSameWeights(*net.model, *reference.model);
}

TEST(CpuSession, RefusesAnEmptyStepAndMissingParts) {
  Net net = Net::Make();
  EXPECT_EQ(CpuSession::Create({}, static_cast<Sequential*>(nullptr), net.optimizer.get())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  OneRank comm;
  EXPECT_EQ(CpuSession::Create({.communicator = &comm, .bucket_mb = 0}, net.model.get(),
                               net.optimizer.get())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::unique_ptr<CpuSession> session =
      *CpuSession::Create({}, net.model.get(), net.optimizer.get());
  absl::Status s = session->Step(std::vector<MicroBatch>{}, 0.1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // A bad learning rate comes back from the optimizer, named.
  const Batch b = MakeBatch(1);
  s = session->Step(b.images, b.labels, -1.0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("optimizer: "));
}

TEST(CpuSession, TwoGlooRanksApplyTheAverageOfTheirGradients) {
  constexpr int kRanks = 2;
  constexpr int kSteps = 3;
  // Rank r's batch of step s.
  auto batch = [](int rank, int64_t step) {
    return MakeBatch(static_cast<uint32_t>(1000 * rank + step));
  };
  // Flush-to-zero as on the ranks' threads.
  ConfigureCpu(1);

  // The reference: one thread, each rank's gradients by hand (with its
  // dropout seed), averaged.
  Net reference = Net::Make();
  std::vector<double> want_losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<std::vector<float>> sums;
    double loss = 0;
    for (int r = 0; r < kRanks; ++r) {
      const Batch b = batch(r, step);
      Tensor logits, grad;
      reference.model->ZeroGrad();
      reference.model->SetSeed(DropoutSeed(5, step, 1, 0, kRanks, r));
      reference.model->Forward(b.images, &logits, /*training=*/true);
      loss += SoftmaxCrossEntropy(logits, b.labels, &grad);
      reference.model->Backward(grad);
      const std::vector<Parameter*>& params = reference.model->Parameters();
      sums.resize(params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        sums[i].resize(static_cast<size_t>(params[i]->grad.numel()));
        for (int64_t k = 0; k < params[i]->grad.numel(); ++k) {
          sums[i][static_cast<size_t>(k)] += params[i]->grad[k];
        }
      }
    }
    const std::vector<Parameter*>& params = reference.model->Parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      for (int64_t k = 0; k < params[i]->grad.numel(); ++k) {
        params[i]->grad[k] = sums[i][static_cast<size_t>(k)] / kRanks;
      }
    }
    ASSERT_TRUE(reference.optimizer->Step(0.05).ok());
    want_losses.push_back(loss / kRanks);
  }

  std::vector<Net> nets(kRanks);
  std::vector<std::vector<double>> losses(kRanks);
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ConfigureCpu(1);
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          GlooRank(r, kRanks, "cpu-session-test", &store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      Net& net = nets[static_cast<size_t>(r)];
      net = Net::Make();
      absl::StatusOr<std::unique_ptr<CpuSession>> session = CpuSession::Create(
          {.communicator = comm->get(), .bucket_mb = 0.01}, net.model.get(), net.optimizer.get());
      ASSERT_TRUE(session.ok()) << session.status();
      for (int64_t step = 0; step < kSteps; ++step) {
        const Batch b = batch(r, step);
        absl::StatusOr<double> loss = (*session)->Step(
            {MicroBatch{&b.images, &b.labels, DropoutSeed(5, step, 1, 0, kRanks, r)}}, 0.05);
        ASSERT_TRUE(loss.ok()) << loss.status();
        losses[static_cast<size_t>(r)].push_back(*loss);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  // The ranks agree bit for bit, on the weights and the averaged loss.
  ExpectSameWeights(*nets[1].model, *nets[0].model);
  EXPECT_EQ(losses[1], losses[0]);
  // And match the reference up to the rounding of the average.
  for (int64_t step = 0; step < kSteps; ++step) {
    EXPECT_FLOAT_EQ(static_cast<float>(losses[0][static_cast<size_t>(step)]),
                    static_cast<float>(want_losses[static_cast<size_t>(step)]));
  }
  const std::vector<Parameter*>& got = nets[0].model->Parameters();
  const std::vector<Parameter*>& want = reference.model->Parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    for (int64_t k = 0; k < got[i]->value.numel(); ++k) {
      ASSERT_NEAR(got[i]->value[k], want[i]->value[k], 1e-6f) << got[i]->name << "[" << k << "]";
    }
  }
}

// broadcast_buffers: rank 0's BatchNorm running statistics reach every
// rank before each forward (torch's DDP), so ranks that trained on
// different batches and then on the same one end with the same statistics;
// without it, each rank keeps its own.
TEST(CpuSession, BroadcastBuffersGivesEveryRankRankZerosStatisticsBeforeAStep) {
  constexpr int kRanks = 2;
  auto images = [](uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(1.0f, 2.0f);
    Tensor t({8, 1, 6, 6});
    for (int64_t i = 0; i < t.numel(); ++i) t[i] = normal(gen);
    return t;
  };
  const std::vector<int32_t> labels = {0, 1, 2, 3, 4, 5, 6, 7};
  for (bool broadcast : {true, false}) {
    std::vector<std::vector<float>> means(kRanks), accumulated(kRanks);
    InMemoryKeyValueStore store;
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Communicator>> comm =
            GlooRank(r, kRanks, "buffers-test", &store);
        ASSERT_TRUE(comm.ok()) << comm.status();
        Sequential model;
        model.Add(std::make_unique<Conv2d>(1, 4, 3, 1, 1, /*bias=*/false));
        model.Add(std::make_unique<BatchNorm2d>(4));
        model.Add(std::make_unique<ReLU>());
        model.Add(std::make_unique<GlobalAvgPool2d>());
        model.Add(std::make_unique<Flatten>());
        model.Add(std::make_unique<Linear>(4, 10));
        for (Parameter* p : model.Parameters()) {
          for (int64_t i = 0; i < p->value.numel(); ++i) p->value[i] = 0.1f * (i % 5) - 0.2f;
        }
        ASSERT_EQ(model.Buffers().size(), 2u);
        Classifier classifier(&model);
        OptimizerConfig o;
        o.name = "sgd";
        o.lr = 0.01;
        std::unique_ptr<Optimizer> optimizer = *Optimizer::Create(o, model.Parameters());
        absl::StatusOr<std::unique_ptr<CpuSession>> session =
            CpuSession::Create({.communicator = comm->get(), .broadcast_buffers = broadcast},
                               &classifier, optimizer.get());
        ASSERT_TRUE(session.ok()) << session.status();
        // Each rank its own batch, then both the same one.
        for (const Tensor& x : {images(10 + r), images(99)}) {
          ASSERT_TRUE((*session)->Step({MicroBatch{&x, &labels, std::nullopt}}, 0.01).ok());
        }
        const Tensor& m = model.Buffers()[0]->value;
        means[static_cast<size_t>(r)].assign(m.data(), m.data() + m.numel());
        // A step of two micro-batches, each rank's own then the shared one:
        // the copy comes once, before the first (as torch's DDP skips it
        // in the forwards of an accumulation), so the ranks end apart.
        const Tensor own = images(20 + r), shared = images(99);
        ASSERT_TRUE((*session)
                        ->Step({MicroBatch{&own, &labels, std::nullopt},
                                MicroBatch{&shared, &labels, std::nullopt}},
                               0.01)
                        .ok());
        accumulated[static_cast<size_t>(r)].assign(m.data(), m.data() + m.numel());
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    if (broadcast) {
      EXPECT_EQ(means[0], means[1]) << "with broadcast_buffers";
    } else {
      EXPECT_NE(means[0], means[1]) << "without broadcast_buffers";
    }
    EXPECT_NE(accumulated[0], accumulated[1]) << "a copy before the step's second micro-batch";
  }
}

// One rank's model for the stochastic-depth test: a ResNet-18 on 8x8
// images or a 4-block GPT on bytes, each skipping blocks with p = 0.5.
struct SkippingModel {
  explicit SkippingModel(bool gpt) {
    if (gpt) {
      GptConfig c;
      c.n_layer = 4;
      c.n_head = 2;
      c.n_embd = 16;
      c.block_size = 8;
      c.vocab_size = 11;
      c.stochastic_depth = 0.5;
      decoder = *Gpt::Create(c, 4);
      trainable = std::make_unique<LanguageModel>(decoder.get());
      for (int i = 0; i < 2 * 8; ++i) {
        tokens.push_back(static_cast<int32_t>((i * 7) % 11));
        targets.push_back(static_cast<int32_t>((i * 7 + 7) % 11));
      }
      return;
    }
    ModelConfig config;
    config.name = "resnet18";
    config.height = 8;
    config.width = 8;
    config.stochastic_depth = 0.5;
    classifier = *BuildModel(config, 4);
    trainable = std::make_unique<Classifier>(classifier.get());
    for (int64_t i = 0; i < x.numel(); ++i) x[i] = 0.01f * static_cast<float>(i % 37) - 0.2f;
  }
  MicroBatch Batch(uint64_t seed) const {
    if (decoder != nullptr)
      return MicroBatch{.labels = &targets, .seed = seed, .tokens = &tokens, .seq_len = 8};
    return MicroBatch{&x, &labels, seed};
  }

  std::unique_ptr<Sequential> classifier;
  std::unique_ptr<Gpt> decoder;
  std::unique_ptr<TrainableModel> trainable;
  Tensor x{{2, 1, 8, 8}};
  std::vector<int32_t> labels = {1, 2};
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

// Stochastic depth skips residual blocks (ResNet) or whole blocks (GPT),
// each rank its own: with find_unused_parameters every step finishes, the
// ranks end with the same weights, and a parameter no rank used in a step
// is not updated (its weight decay and momentum too); without it the first
// such step fails, naming the parameters.
TEST(CpuSession, FindUnusedParametersLetsRanksSkipDifferentBlocks) {
  constexpr int kRanks = 2;
  for (bool gpt : {false, true}) {
    for (bool find_unused : {true, false}) {
      SCOPED_TRACE(absl::StrCat(gpt ? "gpt" : "resnet18", find_unused ? ", find_unused" : ""));
      std::vector<std::vector<float>> weights(kRanks);
      std::vector<absl::Status> results(kRanks);
      std::vector<int> skipped_globally(kRanks, 0);
      InMemoryKeyValueStore store;
      std::vector<std::thread> threads;
      for (int r = 0; r < kRanks; ++r) {
        threads.emplace_back([&, r] {
          absl::StatusOr<std::unique_ptr<Communicator>> comm =
              GlooRank(r, kRanks, "unused-test", &store);
          ASSERT_TRUE(comm.ok()) << comm.status();
          SkippingModel model(gpt);
          const std::vector<Parameter*>& params = model.trainable->Parameters();
          OptimizerConfig o;
          o.name = "sgd";
          o.lr = 0.01;
          o.momentum = 0.9;
          o.weight_decay = 0.1;
          std::unique_ptr<Optimizer> optimizer = *Optimizer::Create(o, params);
          absl::StatusOr<std::unique_ptr<CpuSession>> session = CpuSession::Create(
              {.communicator = comm->get(), .find_unused_parameters = find_unused},
              model.trainable.get(), optimizer.get());
          ASSERT_TRUE(session.ok()) << session.status();
          for (uint64_t step = 0; step < 6 && results[static_cast<size_t>(r)].ok(); ++step) {
            // Each rank its own draws, as a job's ranks have.
            const uint64_t seed = 100 * step + static_cast<uint64_t>(r);
            std::vector<std::vector<float>> before;
            for (const Parameter* p : params) {
              before.emplace_back(p->value.data(), p->value.data() + p->value.numel());
            }
            absl::StatusOr<double> loss = (*session)->Step({model.Batch(seed)}, 0.01);
            if (!loss.ok()) {
              results[static_cast<size_t>(r)] = loss.status();
              break;
            }
            for (size_t i = 0; i < params.size(); ++i) {
              if (!params[i]->no_grad) continue;
              ++skipped_globally[static_cast<size_t>(r)];
              EXPECT_EQ(std::vector<float>(params[i]->value.data(),
                                           params[i]->value.data() + params[i]->value.numel()),
                        before[i])
                  << params[i]->name << " moved without a gradient";
            }
          }
          for (const Parameter* p : params) {
            weights[static_cast<size_t>(r)].insert(weights[static_cast<size_t>(r)].end(),
                                                   p->value.data(),
                                                   p->value.data() + p->value.numel());
          }
        });
      }
      for (std::thread& t : threads) t.join();
      ASSERT_FALSE(::testing::Test::HasFatalFailure());
      if (find_unused) {
        EXPECT_TRUE(results[0].ok()) << results[0];
        EXPECT_TRUE(results[1].ok()) << results[1];
        EXPECT_EQ(weights[0], weights[1]);
        EXPECT_GT(skipped_globally[0], 0) << "no block was skipped by both ranks in 6 steps";
        EXPECT_EQ(skipped_globally[0], skipped_globally[1]);
      } else {
        // The first rank that skipped a block names it (the other may then
        // fail on its collectives).
        bool named = false;
        for (const absl::Status& s : results) {
          named = named || (absl::IsInvalidArgument(s) &&
                            absl::StrContains(s.message(), "got no gradient this step ("));
        }
        EXPECT_TRUE(named) << results[0] << " / " << results[1];
      }
    }
  }
}

// A single rank (no DDP) leaves what its forward skipped alone as well.
TEST(CpuSession, ASingleRankDoesNotUpdateWhatItsForwardSkipped) {
  SkippingModel model(/*gpt=*/true);
  const std::vector<Parameter*>& params = model.trainable->Parameters();
  OptimizerConfig o;
  o.name = "adamw";
  o.lr = 0.01;
  o.weight_decay = 0.1;
  std::unique_ptr<Optimizer> optimizer = *Optimizer::Create(o, params);
  std::unique_ptr<CpuSession> session =
      *CpuSession::Create({}, model.trainable.get(), optimizer.get());
  int skipped = 0;
  for (uint64_t step = 0; step < 4; ++step) {
    std::vector<std::vector<float>> before;
    for (const Parameter* p : params) {
      before.emplace_back(p->value.data(), p->value.data() + p->value.numel());
    }
    ASSERT_TRUE(session->Step({model.Batch(step)}, 0.01).ok());
    const std::vector<Parameter*> unused = model.decoder->UnusedParameters();
    skipped += static_cast<int>(unused.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const bool was_unused = std::find(unused.begin(), unused.end(), params[i]) != unused.end();
      EXPECT_EQ(params[i]->no_grad, was_unused) << params[i]->name;
      const bool moved =
          std::vector<float>(params[i]->value.data(),
                             params[i]->value.data() + params[i]->value.numel()) != before[i];
      EXPECT_EQ(moved, !was_unused) << params[i]->name << " at step " << step;
    }
  }
  EXPECT_GT(skipped, 0) << "no block skipped in 4 steps";
}

}  // namespace
}  // namespace aidn::engine
