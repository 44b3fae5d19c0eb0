// Sharded checkpoints (checkpoint.h, checkpoint_reader.h): written by 4
// FSDP ranks in threads over Gloo, read back whole, resharded for 2 and 3
// ranks of ZeRO-1, ZeRO-2 and FSDP, put together into one file, and
// refused with the file named when a piece is corrupt or missing.

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/checkpoint_reader.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/model.h"
#include "worker/engine/trainable.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
using Part = CheckpointReader::Part;

constexpr int kWriters = 4;

std::unique_ptr<Sequential> Mlp() {
  ModelConfig config;
  config.hidden_sizes = {37, 21};  // sizes no world size divides
  return *BuildModel(config, /*seed=*/5);
}

OptimizerConfig ShardedAdam() {
  OptimizerConfig o;
  o.name = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.01;
  return o;
}

// Runs `body(rank, communicator)` on `world` threads joined over Gloo.
template <typename Body>
void OnRanks(int world, const std::string& prefix, Body body) {
  EXPECT_TRUE(
      testing::AllOk(testing::RunRanks(world, [&](int r, KeyValueStore& store) -> absl::Status {
        ConfigureCpu(1);
        GlooOptions options;
        options.rank = r;
        options.world_size = world;
        options.timeout = std::chrono::seconds(30);
        options.prefix = prefix;
        AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                              CreateGlooCommunicator(options, &store));
        body(r, comm.get());
        return absl::OkStatus();
      })));
}

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/sharded-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Three FSDP steps on kWriters ranks, then the sharded checkpoint of step
  // 3; the whole weights and optimizer state it stands for are kept.
  void WriteAtFourRanks(Sharding sharding = Sharding::kFullShard) {
    std::mutex mu;
    OnRanks(kWriters, "write", [&](int r, Communicator* comm) {
      std::unique_ptr<Sequential> model = Mlp();
      Classifier classifier(model.get());
      auto session =
          CpuSession::Create({.communicator = comm, .bucket_mb = 0.01, .sharding = sharding},
                             &classifier, ShardedAdam());
      ASSERT_TRUE(session.ok()) << session.status();
      std::mt19937 gen(static_cast<uint32_t>(r));
      std::normal_distribution<float> normal;
      for (int step = 0; step < 3; ++step) {
        Tensor images({4, 784});
        for (int64_t i = 0; i < images.numel(); ++i) images[i] = normal(gen);
        std::vector<int32_t> labels = {1, 2, 3, 4};
        absl::StatusOr<double> loss = (*session)->Step(images, labels, 1e-2);
        ASSERT_TRUE(loss.ok()) << loss.status();
      }
      ShardContents contents;
      contents.weights = (*session)->WeightPieces();
      contents.optimizer_state = *(*session)->StatePieces();
      for (const Parameter* p : model->Parameters()) contents.parameters.push_back(p->name);
      contents.model_metadata = {{"aidn.model", "mlp"}};
      contents.state = {{"step", "3"}};
      absl::StatusOr<WrittenCheckpoint> written =
          WriteShardedCheckpoint(dir_, 3, "g1", contents, comm);
      ASSERT_TRUE(written.ok()) << written.status();
      EXPECT_EQ(written->path, absl::StrCat(dir_, "/step-00000003"));
      EXPECT_EQ(written->manifest.empty(), r != 0);
      // A collective: outside the lock.
      ASSERT_TRUE((*session)->GatherFullParameters().ok());
      std::lock_guard<std::mutex> lock(mu);
      for (const ShardMap::Piece& p : contents.optimizer_state) {
        Tensor& whole = state_.try_emplace(p.whole, p.whole_shape).first->second;
        std::memcpy(whole.data() + p.begin, p.tensor->data(), sizeof(float) * (p.end - p.begin));
      }
      if (r == 0) {
        for (const Parameter* p : model->Parameters()) weights_.emplace(p->name, p->value.Clone());
      }
      (*session)->ReleaseFullParameters();
    });
  }

  std::string dir_;
  std::map<std::string, Tensor> weights_;
  std::map<std::string, Tensor> state_;
};

bool SameBits(const Tensor& a, const float* b) {
  return std::memcmp(a.data(), b, sizeof(float) * static_cast<size_t>(a.numel())) == 0;
}

TEST_F(ShardedCheckpointTest, EveryRankWritesItsPiecesAndAnyWorldSizeReadsThemBack) {
  WriteAtFourRanks();
  const std::string path = absl::StrCat(dir_, "/step-00000003");
  for (int r = 0; r < kWriters; ++r) {
    EXPECT_TRUE(fs::exists(absl::StrCat(path, "/", ShardFileName("model", r, kWriters))));
    EXPECT_TRUE(fs::exists(absl::StrCat(path, "/", ShardFileName("optimizer", r, kWriters))));
  }
  EXPECT_FALSE(fs::exists(absl::StrCat(path, "/", kModelFile)));
  EXPECT_TRUE(VerifyCheckpointDir(path).ok());

  // Whole, as a DDP rank 0 reads it.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->shards(), kWriters);
  EXPECT_EQ((*reader)->step(), 3);
  EXPECT_EQ((*reader)->state().at("step"), "3");
  EXPECT_EQ((*reader)->model_metadata().at("aidn.model"), "mlp");
  std::unique_ptr<Sequential> fresh = Mlp();
  for (Parameter* p : fresh->Parameters()) p->value.Fill(0.0f);
  ASSERT_TRUE((*reader)->ReadParameters(fresh->Parameters()).ok());
  for (const Parameter* p : fresh->Parameters()) {
    EXPECT_TRUE(SameBits(p->value, weights_.at(p->name).data())) << p->name;
  }

  // Resharded: each rank of 2 and of 3, under each sharded strategy, reads
  // exactly its own pieces of the optimizer state.
  for (Sharding sharding : {Sharding::kOptimizer, Sharding::kGradients, Sharding::kFullShard}) {
    for (int world : {2, 3}) {
      OnRanks(world, absl::StrCat("read-", world, "-", static_cast<int>(sharding)),
              [&](int r, Communicator* comm) {
                std::unique_ptr<Sequential> model = Mlp();
                Classifier classifier(model.get());
                auto session = CpuSession::Create(
                    {.communicator = comm, .bucket_mb = 0.004, .sharding = sharding}, &classifier,
                    ShardedAdam());
                ASSERT_TRUE(session.ok()) << session.status();
                auto mine = CheckpointReader::Open(path);
                ASSERT_TRUE(mine.ok()) << mine.status();
                absl::StatusOr<std::vector<ShardMap::Piece>> pieces = (*session)->StatePieces();
                ASSERT_TRUE(pieces.ok()) << pieces.status();
                for (const ShardMap::Piece& p : *pieces) {
                  std::vector<float> got(p.end - p.begin);
                  absl::Status read =
                      (*mine)->Read(Part::kOptimizer, p.whole, p.begin, p.end, got.data());
                  ASSERT_TRUE(read.ok()) << read;
                  EXPECT_EQ(std::memcmp(got.data(), state_.at(p.whole).data() + p.begin,
                                        sizeof(float) * got.size()),
                            0)
                      << "rank " << r << " of " << world << ": " << p.name;
                }
              });
    }
  }

  // Put together: one safetensors file of the whole weights, in the
  // model's order, as a DDP checkpoint's model.safetensors.
  const std::string one = absl::StrCat(dir_, "/one.safetensors");
  ASSERT_TRUE((*reader)->Consolidate(one).ok());
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::map<std::string, Tensor>> tensors = ReadSafetensors(one, &metadata);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(metadata.at("format"), "pt");
  EXPECT_EQ(metadata.at("aidn.model"), "mlp");
  ASSERT_EQ(tensors->size(), weights_.size());
  for (const auto& [name, t] : *tensors) {
    EXPECT_EQ(t.shape(), weights_.at(name).shape()) << name;
    EXPECT_TRUE(SameBits(t, weights_.at(name).data())) << name;
  }
}

TEST_F(ShardedCheckpointTest, ACorruptOrMissingShardIsNamedAndOnlyItsReadersFail) {
  WriteAtFourRanks(Sharding::kGradients);
  const std::string path = absl::StrCat(dir_, "/step-00000003");
  const std::string bad = ShardFileName("optimizer", 2, kWriters);
  {
    std::fstream f(absl::StrCat(path, "/", bad), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    const char byte = static_cast<char>(f.get());
    f.seekp(-3, std::ios::end);
    f.put(static_cast<char>(byte ^ 0xff));
  }
  auto reader = CheckpointReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();  // sizes agree; data is checked when read
  // A piece in another rank's file reads; one in the corrupt file does not.
  const auto& [name, shape] = (*reader)->Tensors(Part::kOptimizer).front();
  std::vector<float> first(4);
  EXPECT_TRUE((*reader)->Read(Part::kOptimizer, name, 0, 4, first.data()).ok());
  bool refused = false;
  for (const auto& [whole, whole_shape] : (*reader)->Tensors(Part::kOptimizer)) {
    size_t n = 1;
    for (int64_t d : whole_shape) n *= static_cast<size_t>(d);
    std::vector<float> all(n);
    absl::Status s = (*reader)->Read(Part::kOptimizer, whole, 0, n, all.data());
    if (s.ok()) continue;
    refused = true;
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(bad));
    EXPECT_THAT(std::string(s.message()), HasSubstr("CRC-32C"));
  }
  EXPECT_TRUE(refused);

  fs::remove(absl::StrCat(path, "/", ShardFileName("model", 1, kWriters)));
  absl::Status missing = CheckpointReader::Open(path).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(missing.message()),
              HasSubstr("model-00001-of-00004.safetensors: missing"));
}

TEST_F(ShardedCheckpointTest, ARankThatCannotWriteOrIsNotSeenFailsTheCheckpointEverywhere) {
  // Rank 1's pieces are misshapen: every rank's call fails, naming it, and
  // nothing is published.
  std::vector<absl::Status> got(2);
  OnRanks(2, "fail", [&](int r, Communicator* comm) {
    Tensor values({4});
    ShardContents contents;
    contents.weights = {{"w[0:4]",
                         "w",
                         {r == 1 ? 5 : 8},
                         r == 1 ? size_t{0} : size_t{4},
                         r == 1 ? size_t{5} : size_t{8},
                         &values}};
    contents.state = {{"step", "1"}};
    got[static_cast<size_t>(r)] = WriteShardedCheckpoint(dir_, 1, "g1", contents, comm).status();
  });
  EXPECT_EQ(got[0].code(), absl::StatusCode::kAborted) << got[0];
  EXPECT_THAT(std::string(got[0].message()), HasSubstr("rank(s) 1 could not write"));
  EXPECT_EQ(got[1].code(), absl::StatusCode::kInvalidArgument) << got[1];
  EXPECT_FALSE(fs::exists(absl::StrCat(dir_, "/step-00000001")));

  // Rank 1 writes where rank 0 does not look (storage it does not share).
  OnRanks(2, "blind", [&](int r, Communicator* comm) {
    Tensor values({4});
    ShardContents contents;
    contents.weights = {{"w", "w", {8}, size_t(4 * r), size_t(4 * r + 4), &values}};
    contents.state = {{"step", "1"}};
    got[static_cast<size_t>(r)] =
        WriteShardedCheckpoint(r == 0 ? dir_ : absl::StrCat(dir_, "-elsewhere"), 1, "g2", contents,
                               comm)
            .status();
  });
  fs::remove_all(absl::StrCat(dir_, "-elsewhere"));
  EXPECT_EQ(got[0].code(), absl::StatusCode::kFailedPrecondition) << got[0];
  EXPECT_THAT(std::string(got[0].message()), HasSubstr("rank 1 wrote model-00001-of-00002"));
  EXPECT_THAT(std::string(got[0].message()), HasSubstr("every rank shares"));
  EXPECT_FALSE(fs::exists(absl::StrCat(dir_, "/step-00000001")));
}

}  // namespace
}  // namespace aidn::engine
