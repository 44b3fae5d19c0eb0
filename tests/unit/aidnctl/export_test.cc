// Tests of `aidnctl export` against the fake coordinator, over real
// checkpoint directories written here as the trainer writes them (three
// files and a MANIFEST of their sizes and CRC-32C).

#include "aidnctl/export.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_manifest.h"
#include "common/crc32c.h"
#include "common/digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/aidnctl/fake_job_coordinator.h"

namespace aidn::ctl {
namespace {

using testing::FakeServer;
using ::testing::HasSubstr;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Weights of `step` in the safetensors layout (an 8-byte header length, the
// JSON header, the data), over 2 MiB so the copy takes several reads, and
// different for every step.
std::string ModelBytes(int64_t step) {
  constexpr size_t kFloats = (2 << 20) / 4 + 100;
  const std::string header = absl::StrCat(R"({"fc.weight":{"dtype":"F32","shape":[)", kFloats,
                                          R"(],"data_offsets":[0,)", kFloats * 4, "]}}");
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  bytes += header;
  for (size_t i = 0; i < kFloats * 4; ++i) {
    bytes += static_cast<char>((i * 31 + static_cast<size_t>(step)) & 0xFF);
  }
  return bytes;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = absl::StrCat(::testing::TempDir(), "/aidnctl-export-", getpid(), "-",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ + "/out");
    output_ = root_ + "/out/model.safetensors";
    // Oldest first, as the coordinator lists them: two good ones, a
    // committed one a rank found invalid, one not yet committed.
    Add(10);
    Add(20);
    Add(30).set_invalid_reason("model.safetensors: CRC-32C 1a2b3c4d, the manifest says 5e6f7a8b");
    Add(40, /*committed=*/false);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // Writes <root>/ckpt/step-NNNNNNNN and lists it with the coordinator.
  v1::Checkpoint& Add(int64_t step, bool committed = true) {
    const std::string dir = StepDir(step);
    std::filesystem::create_directories(dir);
    WriteAll(dir + "/model.safetensors", ModelBytes(step));
    WriteAll(dir + "/optimizer.safetensors", std::string(3000, static_cast<char>(step)));
    WriteAll(dir + "/state.txt", absl::StrCat("step ", step, "\nepoch 1\nseed 7\n"));
    Manifest manifest;
    manifest.step = step;
    int64_t bytes = 0;
    for (const char* name : {"model.safetensors", "optimizer.safetensors", "state.txt"}) {
      absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(dir, "/", name));
      EXPECT_TRUE(sum.ok()) << sum.status();
      manifest.files.push_back({name, sum->bytes, sum->crc32c});
      bytes += sum->bytes;
    }
    const std::string text = FormatManifest(manifest);
    WriteAll(absl::StrCat(dir, "/", kManifestName), text);

    v1::Checkpoint& c = server_.fake.checkpoints_.emplace_back();
    c.set_job_id("job-1");
    c.set_step(step);
    c.set_generation(1);
    c.set_path(dir);
    c.add_ranks_expected(0);
    if (committed) c.add_ranks_reported(0);
    c.set_committed(committed);
    c.set_bytes(bytes + static_cast<int64_t>(text.size()));
    c.set_manifest_sha256(Sha256Hex(text));
    *c.mutable_created_at() = testing::At(static_cast<double>(step));
    return c;
  }

  std::string StepDir(int64_t step) const {
    return absl::StrFormat("%s/ckpt/step-%08d", root_, step);
  }

  v1::Checkpoint& Listed(int64_t step) {
    for (v1::Checkpoint& c : server_.fake.checkpoints_) {
      if (c.step() == step) return c;
    }
    ADD_FAILURE() << "no step " << step;
    return server_.fake.checkpoints_.front();
  }

  absl::Status Export(std::optional<int64_t> step = std::nullopt, bool force = false) {
    if (!started_) {
      server_.Start();
      started_ = true;
    }
    ExportOptions options;
    options.job_id = "job-1";
    options.step = step;
    options.output_path = output_;
    options.force = force;
    return RunExport(server_.env, options);
  }

  // Nothing at the output path, and no temporary beside it.
  void ExpectNothingWritten() {
    EXPECT_FALSE(std::filesystem::exists(output_));
    EXPECT_FALSE(std::filesystem::exists(output_ + ".tmp"));
  }

  FakeServer server_;
  bool started_ = false;
  std::string root_;
  std::string output_;
};

TEST_F(ExportTest, WritesTheNewestCommittedValidCheckpointsWeights) {
  const absl::Status status = Export();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(ReadAll(output_) == ModelBytes(20)) << "the output is not step 20's weights";
  EXPECT_FALSE(std::filesystem::exists(output_ + ".tmp"));
  EXPECT_EQ(server_.out.str(),
            absl::StrCat("exported step 20 of job-1 (generation 1, 2.0MiB) to ", output_, "\n"));
}

TEST_F(ExportTest, WritesTheStepAskedFor) {
  const absl::Status status = Export(10);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(ReadAll(output_) == ModelBytes(10)) << "the output is not step 10's weights";
}

TEST_F(ExportTest, AnUnknownStepListsTheStepsThereAre) {
  const absl::Status status = Export(15);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("job job-1 has no checkpoint at step 15"));
  EXPECT_THAT(status.message(), HasSubstr("committed, valid steps: 10, 20"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, RefusesAStepFoundInvalidOrNotCommittedSayingWhy) {
  absl::Status status = Export(30);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("at step 30 is found invalid: model.safetensors: "));
  EXPECT_THAT(status.message(), HasSubstr("committed, valid steps: 10, 20"));
  status = Export(40);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("at step 40 is not committed (0/1 ranks reported)"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, AFlippedByteIsDataLossNamingTheFileAndNothingIsWritten) {
  std::string model = ModelBytes(20);
  model[model.size() / 2] ^= 0x01;
  WriteAll(StepDir(20) + "/model.safetensors", model);
  const absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(StepDir(20)));
  EXPECT_THAT(status.message(), HasSubstr("model.safetensors: CRC-32C "));
  ExpectNothingWritten();
}

TEST_F(ExportTest, ATruncatedOtherFileFailsTooAndKeepsTheOldOutput) {
  // The weights are intact, but a checkpoint is exported only whole.
  std::filesystem::resize_file(StepDir(10) + "/optimizer.safetensors", 100);
  WriteAll(output_, "old weights");
  const absl::Status status = Export(10, /*force=*/true);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("optimizer.safetensors: 100 bytes, the manifest says 3000"));
  EXPECT_EQ(ReadAll(output_), "old weights");
  EXPECT_FALSE(std::filesystem::exists(output_ + ".tmp"));
}

TEST_F(ExportTest, AMissingDirectorySaysWhereCheckpointsLive) {
  std::filesystem::remove_all(StepDir(20));
  const absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr(StepDir(20)));
  EXPECT_THAT(status.message(), HasSubstr("not reachable from this machine"));
  EXPECT_THAT(status.message(), HasSubstr("--checkpoint-root"));
  EXPECT_THAT(status.message(), HasSubstr("checkpoint.dir"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, AMissingManifestFailsVerification) {
  std::filesystem::remove(absl::StrCat(StepDir(20), "/", kManifestName));
  const absl::Status status = Export();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("fails verification: MANIFEST"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, RefusesADirectoryRewrittenSinceItWasCommitted) {
  Listed(20).set_manifest_sha256(std::string(64, 'a'));
  const absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("is not the one committed for step 20"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, RefusesARelativeCheckpointPath) {
  Listed(20).set_path("ckpt/step-00000020");
  const absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("no absolute directory"));
  ExpectNothingWritten();
}

TEST_F(ExportTest, KeepsAnExistingOutputUnlessForced) {
  WriteAll(output_, "old weights");
  absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_THAT(status.message(), HasSubstr("pass --force"));
  EXPECT_EQ(ReadAll(output_), "old weights");
  EXPECT_EQ(server_.fake.list_checkpoints_calls(), 0);

  status = Export(std::nullopt, /*force=*/true);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(ReadAll(output_) == ModelBytes(20)) << "the output is not step 20's weights";
}

TEST_F(ExportTest, RefusesBadOutputPathsBeforeAskingTheCoordinator) {
  output_ = root_ + "/no-such-dir/model.safetensors";
  absl::Status status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("directory " + root_ + "/no-such-dir does not exist"));
  EXPECT_FALSE(std::filesystem::exists(root_ + "/no-such-dir"));

  output_ = root_ + "/out/model.pt";
  status = Export();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("ending in .safetensors"));

  output_ = root_ + "/out.safetensors";
  std::filesystem::create_directories(output_);
  status = Export(std::nullopt, /*force=*/true);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("it is a directory"));

  EXPECT_EQ(server_.fake.list_checkpoints_calls(), 0);
}

TEST_F(ExportTest, AnUnknownJobIsTheCoordinatorsNotFound) {
  server_.Start();
  started_ = true;
  ExportOptions options;
  options.job_id = "job-9";
  options.output_path = output_;
  const absl::Status status = RunExport(server_.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("job job-9 not found"));
  ExpectNothingWritten();
}

TEST(Sha256Hex, MatchesTheFips180Vectors) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(ChooseCheckpoint, SaysWhyNoCheckpointCanBeExported) {
  google::protobuf::RepeatedPtrField<v1::Checkpoint> checkpoints;
  absl::StatusOr<v1::Checkpoint> chosen = ChooseCheckpoint(checkpoints, "job-1", std::nullopt);
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(chosen.status().message(), HasSubstr("job job-1 has no checkpoints"));

  v1::Checkpoint* invalid = checkpoints.Add();
  invalid->set_step(10);
  invalid->set_committed(true);
  invalid->set_invalid_reason("state.txt: missing");
  v1::Checkpoint* partial = checkpoints.Add();
  partial->set_step(20);
  partial->add_ranks_expected(0);
  partial->add_ranks_expected(1);
  partial->add_ranks_reported(1);
  chosen = ChooseCheckpoint(checkpoints, "job-1", std::nullopt);
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(chosen.status().message(),
            "job job-1 has no committed, valid checkpoint: step 10 found invalid: state.txt: "
            "missing; step 20 not committed (1/2 ranks reported)");
  chosen = ChooseCheckpoint(checkpoints, "job-1", 20);
  EXPECT_THAT(chosen.status().message(), HasSubstr("no checkpoint is committed and valid"));
}

TEST(ChooseCheckpoint, TakesTheNewestStepWhateverTheListOrder) {
  google::protobuf::RepeatedPtrField<v1::Checkpoint> checkpoints;
  for (int64_t step : {30, 10, 20}) {
    v1::Checkpoint* c = checkpoints.Add();
    c->set_step(step);
    c->set_committed(true);
  }
  absl::StatusOr<v1::Checkpoint> chosen = ChooseCheckpoint(checkpoints, "job-1", std::nullopt);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->step(), 30);
  chosen = ChooseCheckpoint(checkpoints, "job-1", 10);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->step(), 10);
}

}  // namespace
}  // namespace aidn::ctl
