#include "worker/trainer/checkpoint_loader.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "common/digest.h"
#include "common/file.h"
#include "common/status.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/comm/gloo_communicator.h"

namespace aidn::trainer {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class CheckpointLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/loader-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    weight_.name = "w";
    weight_.value = engine::Tensor({4});
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes step `step` with every weight `value`; the committed record of
  // it (with its manifest's SHA-256, as the registry keeps it).
  v1::Checkpoint Write(int64_t step, float value) {
    for (int i = 0; i < 4; ++i) weight_.value.data()[i] = value;
    engine::CheckpointContents contents;
    contents.model.push_back(&weight_);
    contents.state = {{"step", absl::StrCat(step)}, {"optimizer_steps", absl::StrCat(step)}};
    absl::StatusOr<engine::WrittenCheckpoint> written =
        engine::WriteCheckpoint(dir_, step, contents);
    EXPECT_TRUE(written.ok()) << written.status();
    v1::Checkpoint c;
    c.set_job_id("job-1");
    c.set_step(step);
    c.set_committed(true);
    if (written.ok()) {
      c.set_path(written->path);
      c.set_manifest_sha256(Sha256Hex(written->manifest));
    }
    return c;
  }

  // LoadNewest on one rank; the weight's first value after it, and what
  // was reported invalid.
  float Load(const std::vector<v1::Checkpoint>& candidates, std::vector<std::string>* invalid) {
    engine::Parameter loaded;
    loaded.name = "w";
    loaded.value = engine::Tensor({4});
    EXPECT_TRUE(testing::AllOk(
        testing::RunRanks(1, [&](int rank, engine::KeyValueStore& store) -> absl::Status {
          engine::GlooOptions options;
          options.rank = rank;
          options.world_size = 1;
          AIDN_ASSIGN_OR_RETURN(std::unique_ptr<engine::Communicator> comm,
                                engine::CreateGlooCommunicator(options, &store));
          CheckpointLoader loader(
              {.dir = dir_,
               .job_id = "job-1",
               .every_rank = false,
               .comm = comm.get(),
               .report_invalid = [&](const v1::Checkpoint& c, const std::string&,
                                     const absl::Status& why) {
                 invalid->push_back(absl::StrCat(c.step(), ": ", why.message()));
               }});
          return loader.LoadNewest(candidates, {&loaded});
        })));
    return loaded.value.data()[0];
  }

  std::string dir_;
  engine::Parameter weight_;
};

TEST_F(CheckpointLoaderTest, ReadsTheNewestCommittedCheckpoint) {
  const v1::Checkpoint c10 = Write(10, 1.0f);
  const v1::Checkpoint c20 = Write(20, 2.0f);
  std::vector<std::string> invalid;
  EXPECT_EQ(Load({c20, c10}, &invalid), 2.0f);
  EXPECT_TRUE(invalid.empty());
}

TEST_F(CheckpointLoaderTest, AStepWrittenAgainAfterItsCommitIsNeverRead) {
  const v1::Checkpoint c10 = Write(10, 1.0f);
  const v1::Checkpoint c20 = Write(20, 2.0f);
  // A generation cut off from the coordinator, superseded but still
  // running, writes step 20 again: complete and self-consistent, but not
  // what was committed.
  Write(20, 3.0f);
  std::vector<std::string> invalid;
  EXPECT_EQ(Load({c20, c10}, &invalid), 1.0f);
  ASSERT_EQ(invalid.size(), 1u);
  EXPECT_THAT(invalid[0], HasSubstr("20: MANIFEST: sha256"));
  EXPECT_THAT(invalid[0], HasSubstr("written again after its commit"));
}

}  // namespace
}  // namespace aidn::trainer
