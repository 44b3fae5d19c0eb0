// The GPT under tensor parallelism (Gpt::SetTensorParallel), against the
// dense model it splits: over 2 and 3 ranks (shared memory and Gloo), the
// first step's loss and gathered logits are the dense model's, and every
// rank's gradient of a split parameter is the matching slice of the dense
// gradient (the whole parameters' the whole gradient), within 1e-5 of the
// largest element; 20 AdamW steps with clipping end on the dense run's
// weights, slice by slice, within 1e-5 relative (in norm). With
// dropout, runs repeat bit for bit, and activation checkpointing changes no
// bit. Shapes that do not divide are refused.

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
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpt.h"
#include "worker/engine/tensor_parallel.h"
#include "worker/engine/trainable.h"

// A namespace of its own: the test binary is a unity build.
namespace aidn::engine::gpt_tensor_parallel_test {
namespace {

constexpr int64_t kRows = 3;
constexpr int64_t kSeq = 8;
constexpr int kSteps = 20;

GptConfig Config(bool bias, double dropout) {
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 6;
  c.n_embd = 24;
  c.block_size = kSeq;
  c.vocab_size = 96;  // divides by 2 and 3
  c.bias = bias;
  c.dropout = dropout;
  return c;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};
Batch MakeBatch(int step) {
  std::mt19937 gen(static_cast<uint32_t>(100 + step));
  Batch b;
  for (int64_t i = 0; i < kRows * kSeq; ++i) {
    b.tokens.push_back(static_cast<int32_t>(gen() % 96));
    b.targets.push_back(static_cast<int32_t>(gen() % 96));
  }
  return b;
}

// The shard of `whole` a split names (rows or columns, concatenated).
std::vector<float> Slice(const Tensor& whole, const std::optional<Gpt::Split>& split) {
  if (!split.has_value()) return {whole.data(), whole.data() + whole.numel()};
  std::vector<float> out;
  if (whole.rank() == 1 || split->dim == 0) {
    const int64_t row = whole.rank() == 1 ? 1 : whole.dim(1);
    for (const auto& [b, e] : split->ranges) {
      out.insert(out.end(), whole.data() + b * row, whole.data() + e * row);
    }
    return out;
  }
  for (int64_t r = 0; r < whole.dim(0); ++r) {
    for (const auto& [b, e] : split->ranges) {
      out.insert(out.end(), whole.data() + r * whole.dim(1) + b,
                 whole.data() + r * whole.dim(1) + e);
    }
  }
  return out;
}

// max |a - b| / max |b| (or / 1e-6 when b is all but 0).
double MaxRelative(const float* a, const std::vector<float>& b) {
  double diff = 0, scale = 1e-6;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// ||a - b|| / ||b||.
double NormRelative(const float* a, const std::vector<float>& b) {
  double diff = 0, norm = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

absl::Status Near(const std::string& what, const float* got, const std::vector<float>& want,
                  bool norm = false) {
  const double d = norm ? NormRelative(got, want) : MaxRelative(got, want);
  if (d > 1e-5) return absl::InternalError(absl::StrCat(what, ": relative difference ", d));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Communicator>> Group(int rank, int world, CpuTransport transport,
                                                    KeyValueStore& store) {
  CpuCommunicatorOptions options;
  options.gloo.rank = rank;
  options.gloo.world_size = world;
  options.gloo.timeout = std::chrono::seconds(60);
  options.transport = transport;
  options.shm_slot_bytes = size_t{64} << 10;
  AIDN_ASSIGN_OR_RETURN(CpuCommunicator c, CreateCpuCommunicator(options, &store));
  return std::move(c.communicator);
}

class GptTensorParallelTest : public ::testing::TestWithParam<std::tuple<int, CpuTransport>> {};

TEST_P(GptTensorParallelTest, TheFirstStepIsTheDenseModelsSliceBySlice) {
  const auto [world, transport] = GetParam();
  const GptConfig config = Config(/*bias=*/true, 0.0);
  const Batch batch = MakeBatch(0);
  std::unique_ptr<Gpt> dense = *Gpt::Create(config, 5);
  dense->ZeroGrad();
  const double loss = dense->Forward(batch.tokens.data(), batch.targets.data(), kRows, kSeq, true);
  dense->Backward();
  const Tensor logits = dense->Logits(batch.tokens.data(), kRows, kSeq).Clone();
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        ConfigureCpu(1);
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group,
                              Group(rank, world, transport, store));
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> gpt, Gpt::Create(config, 5));
        AIDN_RETURN_IF_ERROR(gpt->SetTensorParallel(group.get()));
        gpt->ZeroGrad();
        const double mine =
            gpt->Forward(batch.tokens.data(), batch.targets.data(), kRows, kSeq, true);
        gpt->Backward();
        AIDN_RETURN_IF_ERROR(gpt->TakeCollectiveStatus());
        if (std::abs(mine - loss) > 1e-5 * std::abs(loss)) {
          return absl::InternalError(absl::StrCat("loss ", mine, " against the dense ", loss));
        }
        for (size_t i = 0; i < gpt->Parameters().size(); ++i) {
          const Parameter& p = *gpt->Parameters()[i];
          const Parameter& whole = *dense->Parameters()[i];
          const std::optional<Gpt::Split> split = gpt->SplitOf(p);
          const std::vector<float> want = Slice(whole.grad, split);
          if (static_cast<int64_t>(want.size()) != p.grad.numel()) {
            return absl::InternalError(absl::StrCat(
                p.name, ": ", p.grad.numel(), " gradient elements, the slice has ", want.size()));
          }
          AIDN_RETURN_IF_ERROR(Near(absl::StrCat(p.name, " gradient"), p.grad.data(), want));
          AIDN_RETURN_IF_ERROR(
              Near(absl::StrCat(p.name, " weight"), p.value.data(), Slice(whole.value, split)));
        }
        const Tensor& gathered = gpt->Logits(batch.tokens.data(), kRows, kSeq);
        AIDN_RETURN_IF_ERROR(Near("gathered logits", gathered.data(), Slice(logits, std::nullopt)));
        return gpt->TakeCollectiveStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
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

TEST_P(GptTensorParallelTest, TwentyAdamWStepsEndOnTheDenseRunsSlices) {
  const auto [world, transport] = GetParam();
  // No biases: c_attn's key bias has a true gradient of 0, whose rounding
  // noise AdamW turns into steps of about lr in either run.
  const GptConfig config = Config(/*bias=*/false, 0.0);
  std::unique_ptr<Gpt> dense = *Gpt::Create(config, 9);
  LanguageModel dense_lm(dense.get());
  std::unique_ptr<CpuSession> dense_session = *CpuSession::Create({}, &dense_lm, Adam());
  std::vector<Batch> batches;
  std::vector<double> dense_losses;
  for (int step = 0; step < kSteps; ++step) {
    batches.push_back(MakeBatch(step));
    MicroBatch mb{nullptr, &batches.back().targets, std::nullopt, &batches.back().tokens, kSeq};
    dense_losses.push_back(*dense_session->Step({mb}, 3e-3));
  }
  std::vector<absl::Status> results =
      testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
        ConfigureCpu(1);
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group,
                              Group(rank, world, transport, store));
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> gpt, Gpt::Create(config, 9));
        AIDN_RETURN_IF_ERROR(gpt->SetTensorParallel(group.get()));
        LanguageModel lm(gpt.get());
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<CpuSession> session,
                              CpuSession::Create({}, &lm, Adam()));
        std::vector<const Parameter*> whole;
        for (const Parameter* p : gpt->Parameters()) {
          if (!gpt->SplitOf(*p).has_value()) whole.push_back(p);
        }
        session->optimizer().SetSumOfSquaresReduction(
            TensorParallelSumOfSquares(group.get(), whole));
        for (int step = 0; step < kSteps; ++step) {
          const Batch& b = batches[static_cast<size_t>(step)];
          MicroBatch mb{nullptr, &b.targets, std::nullopt, &b.tokens, kSeq};
          AIDN_ASSIGN_OR_RETURN(const double loss, session->Step({mb}, 3e-3));
          AIDN_RETURN_IF_ERROR(gpt->TakeCollectiveStatus());
          const double want = dense_losses[static_cast<size_t>(step)];
          if (std::abs(loss - want) > 1e-5 * std::abs(want)) {
            return absl::InternalError(
                absl::StrCat("step ", step, ": loss ", loss, ", dense ", want));
          }
        }
        for (size_t i = 0; i < gpt->Parameters().size(); ++i) {
          const Parameter& p = *gpt->Parameters()[i];
          AIDN_RETURN_IF_ERROR(Near(p.name, p.value.data(),
                                    Slice(dense->Parameters()[i]->value, gpt->SplitOf(p)),
                                    /*norm=*/true));
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
}

TEST_P(GptTensorParallelTest, DropoutRepeatsAndActivationCheckpointingChangesNoBit) {
  const auto [world, transport] = GetParam();
  const GptConfig config = Config(/*bias=*/true, 0.1);
  // Each rank's losses and gradients over three micro-steps.
  auto run = [&](bool checkpointing) {
    std::vector<std::vector<float>> out(static_cast<size_t>(world));
    std::vector<absl::Status> results =
        testing::RunRanks(world, [&](int rank, KeyValueStore& store) -> absl::Status {
          ConfigureCpu(1);
          AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group,
                                Group(rank, world, transport, store));
          AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> gpt, Gpt::Create(config, 3));
          AIDN_RETURN_IF_ERROR(gpt->SetTensorParallel(group.get()));
          gpt->SetActivationCheckpointing(checkpointing);
          gpt->ZeroGrad();
          std::vector<float>& mine = out[static_cast<size_t>(rank)];
          for (int step = 0; step < 3; ++step) {
            const Batch b = MakeBatch(step);
            gpt->SetSeed(static_cast<uint64_t>(40 + step));
            mine.push_back(static_cast<float>(
                gpt->Forward(b.tokens.data(), b.targets.data(), kRows, kSeq, true)));
            gpt->Backward(1.0 / 3);
          }
          for (const Parameter* p : gpt->Parameters()) {
            mine.insert(mine.end(), p->grad.data(), p->grad.data() + p->grad.numel());
          }
          return gpt->TakeCollectiveStatus();
        });
    EXPECT_TRUE(testing::AllOk(results));
    return out;
  };
  const auto first = run(false);
  EXPECT_EQ(first, run(false)) << "two runs differ";
  EXPECT_EQ(first, run(true)) << "activation checkpointing changed the gradients";
  // The ranks' losses agree (the residual masks are shared).
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(first[static_cast<size_t>(r)][0], first[0][0]) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, GptTensorParallelTest,
                         ::testing::Values(std::tuple{2, CpuTransport::kShm},
                                           std::tuple{3, CpuTransport::kShm},
                                           std::tuple{2, CpuTransport::kGloo}),
                         [](const auto& info) {
                           return absl::StrCat(
                               std::get<0>(info.param), "Ranks",
                               std::get<1>(info.param) == CpuTransport::kGloo ? "Gloo" : "Shm");
                         });

TEST(GptTensorParallel, ShapesThatDoNotDivideAreRefused) {
  std::vector<absl::Status> results =
      testing::RunRanks(4, [&](int rank, KeyValueStore& store) -> absl::Status {
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group,
                              Group(rank, 4, CpuTransport::kShm, store));
        std::unique_ptr<Gpt> heads = *Gpt::Create(Config(true, 0.0), 1);  // 6 heads
        const absl::Status s = heads->SetTensorParallel(group.get());
        if (s.message() != "gpt: n_head 6 does not divide among 4 tensor-parallel ranks") {
          return absl::InternalError(absl::StrCat("got: ", s.ToString()));
        }
        GptConfig c = Config(true, 0.0);
        c.n_head = 4;
        c.vocab_size = 258;
        std::unique_ptr<Gpt> vocab = *Gpt::Create(c, 1);
        const absl::Status v = vocab->SetTensorParallel(group.get());
        if (v.message() != "gpt: vocab_size 258 does not divide among 4 tensor-parallel ranks") {
          return absl::InternalError(absl::StrCat("got: ", v.ToString()));
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(testing::AllOk(results));
}

}  // namespace
}  // namespace aidn::engine::gpt_tensor_parallel_test
