// Pipeline parallelism (PipelineSession over stages of a model): an MLP
// with dropout, a GPT and a ResNet-18 (below), cut into 2 and 3 stages and run with GPipe and
// 1F1B over shared memory (and Gloo), with and without data parallelism
// (2 x 2), AdamW and clipping, end 20 steps with the losses and weights of
// one rank that accumulates the same micro-batches, within 1e-5 relative.
// A stage has all m micro-batches in flight under GPipe and at most P - s
// under 1F1B; a GPT stage keeps their activations, an MLP's runs their
// forward again (but 1F1B's last stage, whose backward follows at once).

#include "worker/engine/pipeline_session.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/comm/grid_communicators.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpt.h"
#include "worker/engine/model.h"
#include "worker/engine/pipeline_stage.h"
#include "worker/engine/trainable.h"

namespace aidn::engine {
namespace {

constexpr int kSteps = 20;
constexpr int kMicro = 4;
constexpr int64_t kRows = 3;
constexpr int64_t kSeq = 8;

struct Model {
  std::unique_ptr<Sequential> mlp;
  std::unique_ptr<Gpt> gpt;

  static Model Make(bool gpt) {
    Model m;
    if (gpt) {
      GptConfig c;
      c.n_layer = 6;
      c.n_head = 2;
      c.n_embd = 16;
      c.block_size = kSeq;
      c.vocab_size = 256;
      c.dropout = 0.0;  // a stage's dropout stream is not a one-rank run's
      m.gpt = *Gpt::Create(c, 11);
    } else {
      ModelConfig config;
      config.hidden_sizes = {33, 17, 12};
      config.dropout = 0.2;
      m.mlp = *BuildModel(config, 5);
    }
    return m;
  }
};

// Micro-batch `micro` of replica `replica` at `step`: the same in every run.
struct Batch {
  Tensor images;
  std::vector<int32_t> labels, tokens;
  MicroBatch micro;
};
std::unique_ptr<Batch> MakeBatch(bool gpt, int step, int replica, int micro) {
  std::mt19937 gen(static_cast<uint32_t>(1000 * step + 100 * replica + micro));
  auto b = std::make_unique<Batch>();
  if (gpt) {
    std::vector<int32_t> text;
    for (int64_t i = 0; i < kRows * (kSeq + 1); ++i)
      text.push_back(static_cast<int32_t>(gen() % 97));
    for (int64_t r = 0; r < kRows; ++r) {
      const auto row = text.begin() + r * (kSeq + 1);
      b->tokens.insert(b->tokens.end(), row, row + kSeq);
      b->labels.insert(b->labels.end(), row + 1, row + kSeq + 1);
    }
    b->micro.tokens = &b->tokens;
    b->micro.seq_len = kSeq;
  } else {
    std::normal_distribution<float> normal;
    b->images = Tensor({kRows, 1, 28, 28});
    for (int64_t i = 0; i < b->images.numel(); ++i) b->images[i] = normal(gen);
    for (int64_t r = 0; r < kRows; ++r) b->labels.push_back(static_cast<int32_t>(gen() % 10));
    b->micro.images = &b->images;
  }
  b->micro.labels = &b->labels;
  b->micro.seed = 77 + static_cast<uint64_t>(1000 * step + 100 * replica + micro);
  return b;
}

OptimizerConfig Adam() {
  OptimizerConfig o;
  o.name = "adamw";
  o.lr = 3e-3;
  o.weight_decay = 0.1;
  o.decay_matrices_only = true;
  o.grad_clip_norm = 0.5;  // small enough to clip
  return o;
}

struct TrainedRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  std::vector<PipelineSession::Stats> stats;  // the last step's, per rank
  // Per rank: the floats of its optimizer state and of its stage's
  // parameters.
  std::vector<int64_t> state_floats;
  std::vector<int64_t> parameter_floats;
};

// One rank accumulating every replica's micro-batches.
TrainedRun Reference(bool gpt, int replicas) {
  Model model = Model::Make(gpt);
  std::unique_ptr<TrainableModel> trainable;
  if (gpt) {
    trainable = std::make_unique<LanguageModel>(model.gpt.get());
  } else {
    trainable = std::make_unique<Classifier>(model.mlp.get());
  }
  auto session = CpuSession::Create({}, trainable.get(), Adam());
  EXPECT_TRUE(session.ok()) << session.status();
  TrainedRun run;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::unique_ptr<Batch>> batches;
    std::vector<MicroBatch> micro;
    for (int d = 0; d < replicas; ++d) {
      for (int m = 0; m < kMicro; ++m) {
        batches.push_back(MakeBatch(gpt, step, d, m));
        micro.push_back(batches.back()->micro);
      }
    }
    absl::StatusOr<double> loss = (*session)->Step(micro, 3e-3);
    EXPECT_TRUE(loss.ok()) << loss.status();
    run.losses.push_back(loss.value_or(0));
  }
  for (const Parameter* p : trainable->Parameters()) {
    run.weights[p->name].assign(p->value.data(), p->value.data() + p->value.numel());
  }
  return run;
}

struct Shape {
  bool gpt;
  int data;
  int stages;
  PipelineSchedule schedule;
  CpuTransport transport;
  // The GPT stages' blocks keep only their input and run again in backward.
  bool checkpointing = false;
  // ZeRO-1 over the replicas within each stage.
  bool zero1 = false;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << (s.gpt ? "gpt" : "mlp") << " " << s.data << "x" << s.stages << " "
      << (s.schedule == PipelineSchedule::kGPipe ? "gpipe" : "1f1b") << " "
      << (s.transport == CpuTransport::kGloo ? "gloo" : "shm")
      << (s.checkpointing ? " checkpointing" : "") << (s.zero1 ? " zero1" : "");
}

// Rank `rank`'s communicators of `grid`, meeting through `store`.
absl::StatusOr<GridCommunicators> GridOf(int rank, const ProcessGrid& grid, CpuTransport transport,
                                         KeyValueStore& store) {
  CpuCommunicatorOptions options;
  options.gloo.rank = rank;
  options.gloo.world_size = grid.world_size();
  options.gloo.timeout = std::chrono::seconds(60);
  options.transport = transport;
  options.shm_slot_bytes = size_t{64} << 10;
  return CreateGridCommunicators(options, grid, &store);
}

TrainedRun Pipelined(const Shape& shape) {
  const int world = shape.data * shape.stages;
  TrainedRun run;
  run.stats.resize(static_cast<size_t>(world));
  run.state_floats.resize(static_cast<size_t>(world));
  run.parameter_floats.resize(static_cast<size_t>(world));
  std::vector<std::vector<double>> losses(static_cast<size_t>(world));
  std::vector<std::map<std::string, std::vector<float>>> weights(static_cast<size_t>(world));
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        ConfigureCpu(1);
        AIDN_ASSIGN_OR_RETURN(ProcessGrid grid,
                              ProcessGrid::Create(world, {shape.data, 1, shape.stages}));
        AIDN_ASSIGN_OR_RETURN(GridCommunicators comms, GridOf(rank, grid, shape.transport, store));
        const GridCoords at = grid.CoordsOf(rank);
        Model model = Model::Make(shape.gpt);
        if (shape.checkpointing) model.gpt->SetActivationCheckpointing(true);
        std::unique_ptr<PipelineStageModel> stage;
        if (shape.gpt) {
          AIDN_ASSIGN_OR_RETURN(stage,
                                MakeLanguageModelStage(model.gpt.get(), shape.stages, at.pipeline));
        } else {
          AIDN_ASSIGN_OR_RETURN(
              stage, MakeClassifierStage(model.mlp.get(), {1, 28, 28}, shape.stages, at.pipeline));
        }
        PipelineSessionOptions o = comms.SessionOptions(shape.schedule, /*bucket_mb=*/0.01);
        o.shard_optimizer = shape.zero1;
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<PipelineSession> session,
                              PipelineSession::Create(o, stage.get(), Adam()));
        if (shape.zero1 && (session->shard_map() == nullptr) != (shape.data == 1)) {
          return absl::InternalError("ZeRO-1 shards over two replicas or more");
        }
        for (int step = 0; step < kSteps; ++step) {
          std::vector<std::unique_ptr<Batch>> batches;
          std::vector<MicroBatch> micro;
          for (int m = 0; m < kMicro; ++m) {
            batches.push_back(MakeBatch(shape.gpt, step, at.data, m));
            micro.push_back(batches.back()->micro);
          }
          AIDN_ASSIGN_OR_RETURN(double loss, session->Step(micro, 3e-3));
          losses[static_cast<size_t>(rank)].push_back(loss);
        }
        run.stats[static_cast<size_t>(rank)] = session->last_stats();
        for (const auto& [name, tensor] : session->optimizer().State()) {
          run.state_floats[static_cast<size_t>(rank)] += tensor->numel();
        }
        for (const Parameter* p : stage->Parameters()) {
          run.parameter_floats[static_cast<size_t>(rank)] += p->value.numel();
        }
        for (const Parameter* p : stage->Parameters()) {
          weights[static_cast<size_t>(rank)][p->name].assign(p->value.data(),
                                                             p->value.data() + p->value.numel());
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
  // Every rank reports the same losses; the weights are the union of the
  // stages' (replicas and the tied copies must agree: checked by the caller
  // through each rank's own map).
  run.losses = losses[0];
  for (int r = 1; r < world; ++r) EXPECT_EQ(losses[static_cast<size_t>(r)], run.losses) << r;
  for (int r = 0; r < world; ++r) {
    for (auto& [name, w] : weights[static_cast<size_t>(r)]) {
      auto [it, added] = run.weights.emplace(name, w);
      if (!added) {
        EXPECT_EQ(it->second, w) << name << " differs between copies (rank " << r << ")";
      }
    }
  }
  return run;
}

double Relative(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

const TrainedRun& ReferenceRun(bool gpt, int replicas) {
  static auto* runs = new std::map<std::pair<bool, int>, TrainedRun>();
  auto it = runs->find({gpt, replicas});
  if (it == runs->end())
    it = runs->emplace(std::pair{gpt, replicas}, Reference(gpt, replicas)).first;
  return it->second;
}

class PipelineSessionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(PipelineSessionTest, TwentyStepsEndWhereOneRankEnds) {
  const Shape shape = GetParam();
  const TrainedRun& want = ReferenceRun(shape.gpt, shape.data);
  const TrainedRun got = Pipelined(shape);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < got.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * std::max(1.0, std::abs(want.losses[s])))
        << "step " << s;
  }
  ASSERT_EQ(got.weights.size(), want.weights.size()) << "every parameter on some stage";
  for (const auto& [name, w] : want.weights) {
    const std::vector<float>& g = got.weights.at(name);
    ASSERT_EQ(g.size(), w.size()) << name;
    if (name.ends_with("attn.c_attn.bias")) {
      // The key third's true gradient is 0 (the softmax cancels it): AdamW
      // turns its rounding noise into steps of about lr. Query and value
      // thirds must agree.
      const size_t c = w.size() / 3;
      for (size_t third : {size_t{0}, size_t{2}}) {
        const std::vector<float> gt(g.begin() + third * c, g.begin() + (third + 1) * c);
        const std::vector<float> wt(w.begin() + third * c, w.begin() + (third + 1) * c);
        EXPECT_LT(Relative(gt, wt), 1e-5) << name << " third " << third;
      }
      continue;
    }
    EXPECT_LT(Relative(g, w), 1e-5) << name;
  }
  // What each stage kept and ran again in the last step: a GPT stage keeps
  // its micro-batches' activations, an MLP's only their inputs (and runs
  // their forward again, but where the backward follows at once).
  const int world = shape.data * shape.stages;
  for (int r = 0; r < world; ++r) {
    const int s = r / shape.data;  // pipeline outermost, no tensor groups
    const PipelineSession::Stats& st = got.stats[static_cast<size_t>(r)];
    const int in_flight =
        shape.schedule == PipelineSchedule::kGPipe ? kMicro : std::min(kMicro, shape.stages - s);
    EXPECT_EQ(st.peak_in_flight, in_flight) << "stage " << s;
    if (shape.gpt) {
      EXPECT_EQ(st.recomputed, 0) << "stage " << s;
      EXPECT_GT(st.peak_kept_bytes, 0) << "stage " << s;
    } else if (shape.schedule == PipelineSchedule::k1F1B && s == shape.stages - 1) {
      EXPECT_EQ(st.recomputed, 0) << "1F1B's last stage runs each backward after its forward";
    } else {
      EXPECT_GT(st.recomputed, 0) << "stage " << s;
    }
    // AdamW keeps two floats a parameter; ZeRO-1 a replica's share of them
    // (the tied embedding's whole on each end).
    const int64_t whole = 2 * got.parameter_floats[static_cast<size_t>(r)];
    if (shape.zero1 && shape.data > 1) {
      EXPECT_LT(got.state_floats[static_cast<size_t>(r)], whole) << "rank " << r;
    } else {
      EXPECT_EQ(got.state_floats[static_cast<size_t>(r)], whole) << "rank " << r;
    }
  }
}

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat(s.gpt ? "Gpt" : "Mlp", "_D", s.data, "xP", s.stages, "_",
                      s.schedule == PipelineSchedule::kGPipe ? "GPipe" : "OneFOneB", "_",
                      s.transport == CpuTransport::kGloo ? "Gloo" : "Shm",
                      s.checkpointing ? "_ActivationCheckpointing" : "", s.zero1 ? "_Zero1" : "");
}

using PS = PipelineSchedule;
constexpr CpuTransport kShm = CpuTransport::kShm;
INSTANTIATE_TEST_SUITE_P(
    Shapes, PipelineSessionTest,
    ::testing::Values(Shape{false, 1, 2, PS::kGPipe, kShm}, Shape{false, 1, 2, PS::k1F1B, kShm},
                      Shape{false, 1, 4, PS::k1F1B, kShm}, Shape{false, 2, 2, PS::k1F1B, kShm},
                      Shape{false, 1, 3, PS::kGPipe, CpuTransport::kGloo},
                      Shape{true, 1, 2, PS::k1F1B, kShm}, Shape{true, 1, 3, PS::kGPipe, kShm},
                      Shape{true, 1, 3, PS::k1F1B, kShm}, Shape{true, 2, 2, PS::kGPipe, kShm},
                      Shape{true, 1, 2, PS::k1F1B, CpuTransport::kGloo},
                      Shape{true, 1, 3, PS::kGPipe, kShm, /*checkpointing=*/true},
                      Shape{false, 2, 2, PS::k1F1B, kShm, false, /*zero1=*/true},
                      Shape{true, 2, 2, PS::k1F1B, kShm, false, /*zero1=*/true},
                      Shape{true, 3, 2, PS::kGPipe, CpuTransport::kGloo, false, /*zero1=*/true}),
    ShapeName);

// A ResNet-18 (BatchNorm, residual blocks) on 16x16 images in 2 stages, as
// one rank accumulating the same micro-batches: the BatchNorms normalise
// with each micro-batch's statistics in both, and update their running
// statistics once per micro-batch in micro-batch order (a stage's second
// forward before a backward leaves them alone), so losses, weights and
// running statistics agree. With 2 replicas the first replica's buffers go
// to the second before each forward, and the weights still agree.
struct ResNetRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;  // buffers included
  std::vector<int> recomputed;                        // per rank
};

constexpr int kResNetSteps = 4;
constexpr int kResNetMicro = 2;

std::unique_ptr<Sequential> MakeResNet() {
  ModelConfig c;
  c.name = "resnet18";
  c.height = 16;
  c.width = 16;
  return *BuildModel(c, 5);
}

// SGD, and images large enough for 12 values a channel in the last
// stage's BatchNorms: with fewer, a channel's tiny variance multiplies the
// rounding of replicas summing in another order than one rank, and AdamW
// turns near-zero gradients' noise into steps of about lr.
OptimizerConfig Sgd() {
  OptimizerConfig o;
  o.name = "sgd";
  o.lr = 0.01;
  o.momentum = 0.9;
  o.weight_decay = 1e-4;
  return o;
}

std::unique_ptr<Batch> MakeImageBatch(int step, int replica, int micro) {
  std::mt19937 gen(static_cast<uint32_t>(500 * step + 50 * replica + micro));
  std::normal_distribution<float> normal;
  auto b = std::make_unique<Batch>();
  b->images = Tensor({kRows, 1, 16, 16});
  for (int64_t i = 0; i < b->images.numel(); ++i) b->images[i] = normal(gen);
  for (int64_t r = 0; r < kRows; ++r) b->labels.push_back(static_cast<int32_t>(gen() % 10));
  b->micro.images = &b->images;
  b->micro.labels = &b->labels;
  return b;
}

ResNetRun ResNetReference(int replicas) {
  ConfigureCpu(1);  // the GEMMs the ranks run (gemm.h), for the same rounding
  std::unique_ptr<Sequential> model = MakeResNet();
  Classifier trainable(model.get());
  auto session = CpuSession::Create({}, &trainable, Sgd());
  EXPECT_TRUE(session.ok()) << session.status();
  ResNetRun run;
  for (int step = 0; step < kResNetSteps; ++step) {
    std::vector<std::unique_ptr<Batch>> batches;
    std::vector<MicroBatch> micro;
    for (int d = 0; d < replicas; ++d) {
      for (int m = 0; m < kResNetMicro; ++m) {
        batches.push_back(MakeImageBatch(step, d, m));
        micro.push_back(batches.back()->micro);
      }
    }
    absl::StatusOr<double> loss = (*session)->Step(micro, 0.01);
    EXPECT_TRUE(loss.ok()) << loss.status();
    run.losses.push_back(loss.value_or(0));
  }
  for (const Parameter* p : model->Parameters()) {
    run.weights[p->name].assign(p->value.data(), p->value.data() + p->value.numel());
  }
  for (const Parameter* b : model->Buffers()) {
    run.weights[b->name].assign(b->value.data(), b->value.data() + b->value.numel());
  }
  return run;
}

ResNetRun ResNetPipelined(int replicas, PipelineSchedule schedule) {
  constexpr int kStages = 2;
  const int world = replicas * kStages;
  ResNetRun run;
  run.recomputed.resize(static_cast<size_t>(world));
  std::vector<std::vector<double>> losses(static_cast<size_t>(world));
  std::vector<std::map<std::string, std::vector<float>>> weights(static_cast<size_t>(world));
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        ConfigureCpu(1);
        AIDN_ASSIGN_OR_RETURN(ProcessGrid grid, ProcessGrid::Create(world, {replicas, 1, kStages}));
        AIDN_ASSIGN_OR_RETURN(GridCommunicators comms,
                              GridOf(rank, grid, CpuTransport::kShm, store));
        const GridCoords at = grid.CoordsOf(rank);
        std::unique_ptr<Sequential> model = MakeResNet();
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<PipelineStageModel> stage,
                              MakeClassifierStage(model.get(), {1, 16, 16}, kStages, at.pipeline));
        AIDN_ASSIGN_OR_RETURN(
            std::unique_ptr<PipelineSession> session,
            PipelineSession::Create(comms.SessionOptions(schedule, 0.5), stage.get(), Sgd()));
        for (int step = 0; step < kResNetSteps; ++step) {
          std::vector<std::unique_ptr<Batch>> batches;
          std::vector<MicroBatch> micro;
          for (int m = 0; m < kResNetMicro; ++m) {
            batches.push_back(MakeImageBatch(step, at.data, m));
            micro.push_back(batches.back()->micro);
          }
          AIDN_ASSIGN_OR_RETURN(double loss, session->Step(micro, 0.01));
          losses[static_cast<size_t>(rank)].push_back(loss);
        }
        run.recomputed[static_cast<size_t>(rank)] = session->last_stats().recomputed;
        std::vector<Parameter*> state = stage->Parameters();
        // The first replica's running statistics are the ones to compare.
        if (at.data == 0) {
          for (Parameter* b : stage->Buffers()) state.push_back(b);
        }
        for (const Parameter* p : state) {
          weights[static_cast<size_t>(rank)][p->name].assign(p->value.data(),
                                                             p->value.data() + p->value.numel());
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
  run.losses = losses[0];
  for (int r = 0; r < world; ++r) {
    for (auto& [name, w] : weights[static_cast<size_t>(r)]) {
      auto [it, added] = run.weights.emplace(name, w);
      if (!added) {
        EXPECT_EQ(it->second, w) << name << " differs between replicas";
      }
    }
  }
  return run;
}

TEST(PipelineSession, AResNetsStagesEndWhereOneRankAccumulatingEnds) {
  for (const auto& [replicas, schedule] :
       {std::pair{1, PipelineSchedule::kGPipe}, std::pair{1, PipelineSchedule::k1F1B},
        std::pair{2, PipelineSchedule::k1F1B}}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replica(s), ",
                              schedule == PipelineSchedule::kGPipe ? "GPipe" : "1F1B"));
    const ResNetRun want = ResNetReference(replicas);
    const ResNetRun got = ResNetPipelined(replicas, schedule);
    ASSERT_FALSE(::testing::Test::HasFailure());
    for (size_t s = 0; s < want.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * std::max(1.0, std::abs(want.losses[s])))
          << "step " << s;
    }
    int buffers = 0;
    for (const auto& [name, w] : want.weights) {
      const bool buffer = name.ends_with("running_mean") || name.ends_with("running_var");
      // With replicas, a running statistic is its replica's micro-batches'.
      if (buffer && replicas > 1) continue;
      buffers += buffer;
      ASSERT_TRUE(got.weights.contains(name)) << name;
      EXPECT_LT(Relative(got.weights.at(name), w), 1e-5) << name;
    }
    if (replicas == 1) {
      EXPECT_EQ(buffers, 2 * 20) << "every BatchNorm's two statistics";
    }
    // The first stage ran forwards again (and kept its statistics still).
    EXPECT_GT(got.recomputed[0], 0);
  }
}

TEST(SplitStages, SpreadsUnitsEvenlyEarlierStagesTakingTheExtra) {
  EXPECT_EQ(*SplitStages(6, 3), (std::vector<std::pair<int, int>>{{0, 2}, {2, 4}, {4, 6}}));
  EXPECT_EQ(*SplitStages(4, 3), (std::vector<std::pair<int, int>>{{0, 2}, {2, 3}, {3, 4}}));
  EXPECT_FALSE(SplitStages(2, 3).ok());
}

TEST(PipelineStage, ShapesThatDoNotSplitAreRefusedNamingWhy) {
  Model mlp = Model::Make(false);
  absl::StatusOr<std::unique_ptr<PipelineStageModel>> s =
      MakeClassifierStage(mlp.mlp.get(), {1, 28, 28}, 5, 0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("4 layers with parameters, fewer than 5"), std::string::npos)
      << s.status();
  Model gpt = Model::Make(true);
  s = MakeLanguageModelStage(gpt.gpt.get(), 4, 0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("n_layer 6 does not divide into 4"), std::string::npos)
      << s.status();
}

TEST(PipelineSession, AMiddleStageWithoutItsLinksIsRefused) {
  Model gpt = Model::Make(true);
  auto stage = MakeLanguageModelStage(gpt.gpt.get(), 3, 1);
  ASSERT_TRUE(stage.ok());
  absl::StatusOr<std::unique_ptr<PipelineSession>> s =
      PipelineSession::Create({}, stage->get(), Adam());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("needs a link to each neighbour"), std::string::npos)
      << s.status();
}

}  // namespace
}  // namespace aidn::engine
