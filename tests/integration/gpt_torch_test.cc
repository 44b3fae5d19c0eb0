// The GPT decoder against PyTorch (python3-torch 1.13): a GPT of the same
// definition, written out in plain torch (gpt_torch.py: Hugging Face's
// [in, out] Conv1D weights, tanh GELU, explicit causal attention), loads
// aidn's initial weights through safetensors and runs the same batches of
// bytes on one process. aidn trains them with 1, 2 and 3 ranks (threads,
// DDP over Gloo, each rank a slice of every batch), through the trainer's
// step (CpuSession over a LanguageModel). On the first batch the logits,
// the loss and every (averaged) gradient must agree within 1e-4 relative
// (‖a − b‖ / ‖b‖ per tensor); after 20 steps of AdamW (betas 0.9/0.95,
// weight decay 0.1 on matrices and embeddings only, gradient clipping at
// 1.0, as nanoGPT trains) every weight must (but the key bias, whose true
// gradient is zero: see below), and so must each step's loss. aidn's ZeRO-1
// on 2 ranks must end within 1e-4 of torch's own ZeRO-1
// (torch.distributed.optim.ZeroRedundancyOptimizer on 2 gloo processes).
//
// Skips only when /usr/bin/python3 cannot import torch.

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpt.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/safetensors.h"
#include "worker/engine/trainable.h"

namespace aidn::engine {
namespace {

constexpr char kPython[] = "/usr/bin/python3";
constexpr int kSteps = 20;
// Sequences per step, split evenly over 1, 2 or 3 ranks.
constexpr int kBatch = 6;
constexpr int kSeqLen = 32;
constexpr double kTolerance = 1e-4;

double RelativeError(const float* a, const float* b, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

GptConfig Config() {
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.block_size = 64;
  c.vocab_size = 256;
  return c;
}
constexpr uint64_t kSeed = 5;

// Torch's side, run once for every rank count: the batches, its first step
// and its final weights.
struct Oracle {
  bool torch_available = false;
  std::string failure;  // the script's output when it failed
  std::vector<int32_t> tokens;
  std::vector<double> losses;
  std::map<std::string, Tensor> first, final_weights;
  // torch.distributed.optim.ZeroRedundancyOptimizer on 2 ranks.
  std::map<std::string, Tensor> zero_weights;
};

std::map<std::string, Tensor> Read(const std::string& path) {
  auto tensors = ReadSafetensors(path);
  EXPECT_TRUE(tensors.ok()) << tensors.status();
  return tensors.ok() ? std::move(*tensors) : std::map<std::string, Tensor>{};
}

Oracle RunOracle() {
  Oracle o;
  const std::string probe = absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1");
  if (std::system(probe.c_str()) != 0) return o;
  o.torch_available = true;
  std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_gpt_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    o.failure = "mkdtemp failed";
    return o;
  }
  const std::string dir = tmpl;
  const GptConfig c = Config();
  std::unique_ptr<Gpt> gpt = *Gpt::Create(c, kSeed);
  // Bytes of text-like skew: mostly a small alphabet, some of everything.
  std::mt19937_64 rng(17);
  o.tokens.resize(static_cast<size_t>(kSteps * kBatch * (kSeqLen + 1)));
  for (int32_t& t : o.tokens) {
    t = static_cast<int32_t>(rng() % 4 == 0 ? rng() % 256 : 97 + rng() % 26);
  }
  std::vector<const Parameter*> params(gpt->Parameters().begin(), gpt->Parameters().end());
  if (!SaveSafetensors(dir + "/init.safetensors", params).ok()) o.failure = "cannot write init";
  std::ofstream(dir + "/tokens.i32", std::ios::binary)
      .write(reinterpret_cast<const char*>(o.tokens.data()),
             static_cast<std::streamsize>(o.tokens.size() * sizeof(int32_t)));
  const std::string command = absl::StrCat(
      kPython, " ", AIDN_SOURCE_DIR, "/tests/integration/gpt_torch.py oracle ", dir, " ", c.n_layer,
      " ", c.n_head, " ", c.n_embd, " ", c.block_size, " ", c.vocab_size, " ", kSteps, " ", kBatch,
      " ", kSeqLen, " >", dir, "/oracle.log 2>&1");
  // torch's own ZeRO-1 on 2 gloo ranks, from the same weights and batches.
  {
    std::ofstream script(dir + "/zero.sh");
    script << "export MASTER_ADDR=127.0.0.1 WORLD_SIZE=2\n"
           << "export MASTER_PORT=$(" << kPython
           << " -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); "
              "print(s.getsockname()[1])')\n"
           << "for r in 0 1; do RANK=$r " << kPython << " " << AIDN_SOURCE_DIR
           << "/tests/integration/gpt_torch.py zero " << dir << " " << c.n_layer << " " << c.n_head
           << " " << c.n_embd << " " << c.block_size << " " << c.vocab_size << " " << kSteps << " "
           << kBatch << " " << kSeqLen << " & done\n"
           << "wait %1 && wait %2\n";
  }
  int rc = std::system(command.c_str());
  if (rc == 0)
    rc = std::system(absl::StrCat("bash ", dir, "/zero.sh >>", dir, "/oracle.log 2>&1").c_str());
  std::ifstream log(dir + "/oracle.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  std::printf("%s", text.c_str());
  if (rc != 0) {
    o.failure = absl::StrCat("the torch script failed:\n", text);
  } else {
    std::ifstream losses(dir + "/losses.txt");
    for (double v; losses >> v;) o.losses.push_back(v);
    o.first = Read(dir + "/first.safetensors");
    o.final_weights = Read(dir + "/final.safetensors");
    o.zero_weights = Read(dir + "/zero.safetensors");
  }
  std::filesystem::remove_all(dir);
  return o;
}

const Oracle& GetOracle() {
  static const Oracle* oracle = new Oracle(RunOracle());
  return *oracle;
}

// One rank's run: its steps' losses (the mean over the ranks), its logits
// and gradients after the first step, and its final weights.
struct RankRun {
  absl::Status status;
  std::vector<double> losses;
  Tensor first_logits;
  std::map<std::string, Tensor> first_grads;
  std::map<std::string, Tensor> final_weights;
};

absl::Status TrainRank(int rank, int ranks, const std::vector<int32_t>& tokens, Communicator* comm,
                       bool zero, RankRun* run) {
  std::unique_ptr<Gpt> gpt = *Gpt::Create(Config(), kSeed);
  LanguageModel lm(gpt.get());
  OptimizerConfig oc;
  oc.name = "adamw";
  oc.lr = 1e-3;
  oc.beta1 = 0.9;
  oc.beta2 = 0.95;
  oc.weight_decay = 0.1;
  oc.decay_matrices_only = true;
  oc.grad_clip_norm = 1.0;
  // The session makes the optimizer (over this rank's shards with ZeRO-1).
  AIDN_ASSIGN_OR_RETURN(
      std::unique_ptr<CpuSession> session,
      CpuSession::Create({.communicator = comm,
                          .bucket_mb = 0.05,
                          .sharding = zero ? Sharding::kOptimizer : Sharding::kNone},
                         &lm, oc));
  const int rows = kBatch / ranks;
  std::vector<int32_t> x(static_cast<size_t>(rows * kSeqLen)), y(x.size());
  for (int s = 0; s < kSteps; ++s) {
    for (int b = 0; b < rows; ++b) {
      const int32_t* row = tokens.data() + (s * kBatch + rank * rows + b) * (kSeqLen + 1);
      std::memcpy(x.data() + b * kSeqLen, row, kSeqLen * sizeof(int32_t));
      std::memcpy(y.data() + b * kSeqLen, row + 1, kSeqLen * sizeof(int32_t));
    }
    MicroBatch batch;
    batch.tokens = &x;
    batch.labels = &y;
    batch.seq_len = kSeqLen;
    AIDN_ASSIGN_OR_RETURN(const double loss, session->Step({batch}, oc.lr));
    run->losses.push_back(loss);
    if (s == 0 && !zero) {
      // The optimizer reads the averaged gradients and leaves them.
      run->first_logits = gpt->logits().Clone();
      for (const Parameter* p : gpt->Parameters()) run->first_grads[p->name] = p->grad.Clone();
    }
  }
  for (const Parameter* p : gpt->Parameters()) run->final_weights[p->name] = p->value.Clone();
  return absl::OkStatus();
}

// Every rank's run, each on a thread of its own (Gloo over an in-memory
// store; one rank without a communicator).
std::vector<RankRun> Train(int ranks, const std::vector<int32_t>& tokens, bool zero) {
  std::vector<RankRun> runs(static_cast<size_t>(ranks));
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      RankRun& run = runs[static_cast<size_t>(rank)];
      if (ranks == 1) {
        run.status = TrainRank(rank, ranks, tokens, nullptr, zero, &run);
        return;
      }
      GlooOptions options;
      options.rank = rank;
      options.world_size = ranks;
      options.timeout = std::chrono::milliseconds(30'000);
      options.prefix = "gpt-oracle";
      absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateGlooCommunicator(options, &store);
      run.status =
          comm.ok() ? TrainRank(rank, ranks, tokens, comm->get(), zero, &run) : comm.status();
    });
  }
  for (std::thread& t : threads) t.join();
  return runs;
}

class GptTorchTest : public ::testing::TestWithParam<int> {};

TEST_P(GptTorchTest, FirstStepAndTwentyAdamWStepsMatchPyTorch) {
  const int ranks = GetParam();
  const Oracle& oracle = GetOracle();
  if (!oracle.torch_available) GTEST_SKIP() << "no torch for " << kPython;
  ASSERT_TRUE(oracle.failure.empty()) << oracle.failure;
  ASSERT_EQ(oracle.losses.size(), static_cast<size_t>(kSteps));
  ConfigureCpu(1);

  const std::vector<RankRun> runs = Train(ranks, oracle.tokens, /*zero=*/false);
  for (const RankRun& run : runs) ASSERT_TRUE(run.status.ok()) << run.status;

  // Each step's loss: the mean over the ranks, torch's over the batch.
  for (int s = 0; s < kSteps; ++s) {
    const double want = oracle.losses[static_cast<size_t>(s)];
    EXPECT_NEAR(runs[0].losses[static_cast<size_t>(s)], want, kTolerance * std::abs(want))
        << "step " << s;
  }
  // First step: each rank's logits are its rows of torch's; the averaged
  // gradients are torch's whole-batch ones, on every rank.
  const Tensor& logits = oracle.first.at("logits");
  const int64_t per_rank = logits.numel() / ranks;
  for (int rank = 0; rank < ranks; ++rank) {
    const RankRun& run = runs[static_cast<size_t>(rank)];
    ASSERT_EQ(run.first_logits.numel(), per_rank);
    EXPECT_LT(RelativeError(run.first_logits.data(), logits.data() + rank * per_rank, per_rank),
              kTolerance)
        << "logits of rank " << rank;
    for (const auto& [name, grad] : run.first_grads) {
      const Tensor& g = oracle.first.at("grad." + name);
      ASSERT_EQ(g.numel(), grad.numel()) << name;
      EXPECT_LT(RelativeError(grad.data(), g.data(), g.numel()), kTolerance)
          << "gradient of " << name << " on rank " << rank;
    }
  }
  // The key part of each c_attn.bias is left out: it adds q·b_k to every
  // score of a row, which the softmax cancels, so its true gradient is 0
  // and each side's is float rounding noise (1e-10), which AdamW's m/sqrt(v)
  // turns into steps of about lr either way. The query and value parts
  // must match.
  const int64_t width = Config().n_embd;
  for (const auto& [name, value] : runs[0].final_weights) {
    const Tensor& w = oracle.final_weights.at(name);
    ASSERT_EQ(w.numel(), value.numel()) << name;
    if (name.ends_with("attn.c_attn.bias")) {
      EXPECT_LT(RelativeError(value.data(), w.data(), width), kTolerance) << name << " q";
      EXPECT_LT(RelativeError(value.data() + 2 * width, w.data() + 2 * width, width), kTolerance)
          << name << " v";
      continue;
    }
    EXPECT_LT(RelativeError(value.data(), w.data(), w.numel()), kTolerance)
        << "after " << kSteps << " steps: " << name;
  }
  // DDP keeps the ranks' weights identical.
  for (int rank = 1; rank < ranks; ++rank) {
    for (const auto& [name, value] : runs[static_cast<size_t>(rank)].final_weights) {
      const Tensor& w0 = runs[0].final_weights.at(name);
      EXPECT_EQ(std::memcmp(value.data(), w0.data(), sizeof(float) * value.numel()), 0)
          << name << " differs between rank 0 and rank " << rank;
    }
  }
}

// ZeRO-1 on 2 ranks against torch's ZeroRedundancyOptimizer on 2 gloo ranks
// (the same shards' arithmetic is not required: only the result).
TEST(GptTorchZero, ZeroOneEndsWhereTorchsZeroRedundancyOptimizerEnds) {
  const Oracle& oracle = GetOracle();
  if (!oracle.torch_available) GTEST_SKIP() << "no torch for " << kPython;
  ASSERT_TRUE(oracle.failure.empty()) << oracle.failure;
  ASSERT_FALSE(oracle.zero_weights.empty());
  ConfigureCpu(1);
  const std::vector<RankRun> runs = Train(2, oracle.tokens, /*zero=*/true);
  for (const RankRun& run : runs) ASSERT_TRUE(run.status.ok()) << run.status;
  const int64_t width = Config().n_embd;
  for (const RankRun& run : runs) {
    for (const auto& [name, value] : run.final_weights) {
      const Tensor& w = oracle.zero_weights.at(name);
      ASSERT_EQ(w.numel(), value.numel()) << name;
      // The key bias's third, as above.
      const int64_t n = name.ends_with("attn.c_attn.bias") ? width : w.numel();
      EXPECT_LT(RelativeError(value.data(), w.data(), n), kTolerance) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GptTorchTest, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Ranks");
                         });

}  // namespace
}  // namespace aidn::engine
