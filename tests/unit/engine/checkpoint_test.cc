#include "worker/engine/checkpoint.h"

#include <unistd.h>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A small MLP with dropout and AdamW: a resume must restore the weights,
// both moments and the step count exactly.
struct Trainer {
  std::unique_ptr<Sequential> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<CpuSession> session;

  static Trainer Make(uint64_t seed) {
    ModelConfig config;
    config.hidden_sizes = {32, 16};
    config.dropout = 0.25;
    Trainer t;
    t.model = *BuildModel(config, seed);
    OptimizerConfig o;
    o.name = "adamw";
    o.lr = 1e-2;
    o.weight_decay = 0.01;
    t.optimizer = *Optimizer::Create(o, t.model->Parameters());
    t.session = *CpuSession::Create({}, t.model.get(), t.optimizer.get());
    return t;
  }

  // Step `step` sees data and a dropout seed that depend on the step alone,
  // as in the trainer, and runs the trainer's step.
  void Step(int64_t step) {
    std::mt19937 gen(static_cast<uint32_t>(1000 + step));
    std::normal_distribution<float> normal;
    Tensor images({8, 784});
    for (int64_t i = 0; i < images.numel(); ++i) images[i] = normal(gen);
    std::vector<int32_t> labels(8);
    for (int32_t& l : labels) l = static_cast<int32_t>(gen() % 10);
    const uint64_t seed = DropoutSeed(77, step, /*accum=*/1, /*micro=*/0, /*world_size=*/1,
                                      /*rank=*/0);
    ASSERT_TRUE(session->Step({MicroBatch{&images, &labels, seed}}, 1e-2).ok());
  }

  CheckpointContents Contents(int64_t step) const {
    CheckpointContents c;
    for (const Parameter* p : model->Parameters()) c.model.push_back(p);
    for (const auto& [name, t] : optimizer->State()) c.optimizer_state.emplace_back(name, t);
    c.state = {{"step", absl::StrCat(step)}, {"optimizer_steps", absl::StrCat(optimizer->steps())}};
    return c;
  }
};

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/ckpt-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir_;
};

TEST_F(CheckpointTest, ResumedTrainingEndsBitwiseEqualToAnUninterruptedRun) {
  Trainer full = Trainer::Make(5);
  for (int64_t s = 0; s < 12; ++s) full.Step(s);

  Trainer first = Trainer::Make(5);
  for (int64_t s = 0; s < 5; ++s) first.Step(s);
  absl::StatusOr<WrittenCheckpoint> written = WriteCheckpoint(dir_, 5, first.Contents(5));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->path, dir_ + "/step-00000005");

  // A different seed: everything must come from the checkpoint.
  Trainer resumed = Trainer::Make(99);
  absl::StatusOr<LoadedCheckpoint> loaded =
      LoadCheckpoint(written->path, resumed.model->Parameters());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 5);
  EXPECT_EQ(loaded->state.at("optimizer_steps"), "5");
  std::vector<Optimizer::StateEntry> entries;
  for (const auto& [name, t] : loaded->optimizer_state) entries.emplace_back(name, &t);
  ASSERT_TRUE(resumed.optimizer->LoadState(entries, 5).ok());
  for (int64_t s = 5; s < 12; ++s) resumed.Step(s);

  const std::vector<Parameter*>& a = full.model->Parameters();
  const std::vector<Parameter*>& b = resumed.model->Parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->value.numel(), b[i]->value.numel());
    EXPECT_EQ(std::memcmp(a[i]->value.data(), b[i]->value.data(),
                          static_cast<size_t>(a[i]->value.numel()) * sizeof(float)),
              0)
        << a[i]->name;
  }
}

TEST_F(CheckpointTest, WritesTheLayoutAtomicallyAndReplacesAStaleDirectoryOfTheSameStep) {
  Trainer t = Trainer::Make(1);
  ASSERT_TRUE(WriteCheckpoint(dir_, 10, t.Contents(10)).ok());
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_ + "/step-00000010")) {
    names.insert(e.path().filename().string());
  }
  EXPECT_EQ(names, (std::set<std::string>{"MANIFEST", "model.safetensors", "optimizer.safetensors",
                                          "state.txt"}));
  // Nothing else left in the parent: no temporary directory.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
  // The weights are readable as plain safetensors with torch's names.
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::map<std::string, Tensor>> weights =
      ReadSafetensors(dir_ + "/step-00000010/model.safetensors", &metadata);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(weights->contains("1.weight"));
  EXPECT_EQ(metadata["format"], "pt");

  // Same step again (a generation that failed before committing it).
  t.Step(0);
  ASSERT_TRUE(WriteCheckpoint(dir_, 10, t.Contents(10)).ok());
  EXPECT_TRUE(VerifyCheckpointDir(dir_ + "/step-00000010").ok());
}

TEST_F(CheckpointTest, ACorruptCheckpointIsRefusedNamingTheFileAndLoadsNothing) {
  Trainer t = Trainer::Make(1);
  ASSERT_TRUE(WriteCheckpoint(dir_, 3, t.Contents(3)).ok());
  const std::string path = dir_ + "/step-00000003";
  Trainer other = Trainer::Make(2);
  const float before = other.model->Parameters()[0]->value[0];

  {  // a flipped byte in the middle of the weights
    std::fstream f(path + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2000);
    char c = 0;
    f.read(&c, 1);
    f.seekp(2000);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  absl::Status s = LoadCheckpoint(path, other.model->Parameters()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors: CRC-32C"));
  EXPECT_EQ(other.model->Parameters()[0]->value[0], before);

  ASSERT_TRUE(WriteCheckpoint(dir_, 3, t.Contents(3)).ok());
  fs::resize_file(path + "/optimizer.safetensors", 100);
  s = LoadCheckpoint(path, other.model->Parameters()).status();
  EXPECT_THAT(s.message(), HasSubstr("optimizer.safetensors: 100 bytes"));
  EXPECT_EQ(other.model->Parameters()[0]->value[0], before);
}

TEST_F(CheckpointTest, RemovesLeftoverTemporariesAndRetiredCheckpoints) {
  Trainer t = Trainer::Make(1);
  ASSERT_TRUE(WriteCheckpoint(dir_, 1, t.Contents(1)).ok());
  ASSERT_TRUE(WriteCheckpoint(dir_, 2, t.Contents(2)).ok());
  fs::create_directories(dir_ + "/.tmp-step-00000003-123/sub");
  ASSERT_TRUE(RemoveTemporaries(dir_).ok());
  EXPECT_FALSE(fs::exists(dir_ + "/.tmp-step-00000003-123"));
  EXPECT_TRUE(fs::exists(dir_ + "/step-00000001"));
  ASSERT_TRUE(RemoveCheckpoint(dir_, 1).ok());
  EXPECT_FALSE(fs::exists(dir_ + "/step-00000001"));
  EXPECT_TRUE(fs::exists(dir_ + "/step-00000002"));
  EXPECT_TRUE(RemoveCheckpoint(dir_, 1).ok());  // already gone: fine
  EXPECT_TRUE(RemoveTemporaries(dir_ + "/missing").ok());
}

TEST_F(CheckpointTest, AStepALaterGenerationWroteIsNotReplaced) {
  Trainer t = Trainer::Make(1);
  CheckpointContents c = t.Contents(7);
  c.state["generation"] = "2";
  absl::StatusOr<WrittenCheckpoint> second = WriteCheckpoint(dir_, 7, c);
  ASSERT_TRUE(second.ok()) << second.status();
  // Generation 1, superseded but cut off, writes the step too: refused.
  c.state["generation"] = "1";
  absl::StatusOr<WrittenCheckpoint> first = WriteCheckpoint(dir_, 7, c);
  EXPECT_EQ(first.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(first.status().message(), HasSubstr("written by generation 2"));
  std::ifstream manifest(second->path + "/MANIFEST");
  std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, second->manifest);
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string(), "step-00000007") << "left behind";
  }
  // The same or a later generation replaces it.
  c.state["generation"] = "3";
  EXPECT_TRUE(WriteCheckpoint(dir_, 7, c).ok());
}

TEST_F(CheckpointTest, RemovesTheStepsBelowACommitThatTheRegistryDoesNotHold) {
  for (const char* name : {"step-00000010", "step-00000020", "step-00000030", "step-00000040",
                           "step-00000050", "step-1", "notes", ".tmp-step-00000060-g2"}) {
    fs::create_directories(dir_ + "/" + name);
  }
  // Held: 30 and 40 (retention kept them) and 50 (this commit); 10 and 20
  // were retired by answers that never arrived. At or above the commit,
  // and names that are not step directories, stay.
  absl::StatusOr<std::vector<int64_t>> removed = RemoveCheckpointsNotHeld(dir_, 50, {30, 40, 50});
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_THAT(*removed, ::testing::ElementsAre(10, 20));
  for (const char* name : {"step-00000030", "step-00000040", "step-00000050", "step-1", "notes",
                           ".tmp-step-00000060-g2"}) {
    EXPECT_TRUE(fs::exists(dir_ + "/" + name)) << name;
  }
  EXPECT_FALSE(fs::exists(dir_ + "/step-00000010"));
  removed = RemoveCheckpointsNotHeld(dir_, 40, {});
  ASSERT_TRUE(removed.ok());
  EXPECT_THAT(*removed, ::testing::ElementsAre(30));
  EXPECT_TRUE(RemoveCheckpointsNotHeld(dir_ + "/missing", 10, {}).ok());
}

TEST_F(CheckpointTest, RefusesBadStateKeys) {
  Trainer t = Trainer::Make(1);
  CheckpointContents c = t.Contents(1);
  c.state["Bad Key"] = "1";
  EXPECT_EQ(WriteCheckpoint(dir_, 1, c).status().code(), absl::StatusCode::kInvalidArgument);
  c = t.Contents(1);
  c.state["ok"] = "two\nlines";
  EXPECT_EQ(WriteCheckpoint(dir_, 1, c).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aidn::engine
