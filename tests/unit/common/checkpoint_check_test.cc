// OpenCommittedWeights (common/checkpoint_check.h): a committed
// checkpoint's weights opened to be sent to someone else read those
// weights and nothing else: no symbolic link anywhere in the path, the
// MANIFEST the coordinator recorded, the size and CRC-32C it names.

#include "common/checkpoint_check.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "common/digest.h"

namespace aidn {
namespace {

using ::testing::HasSubstr;

class OpenCommittedWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "/aidn_ckcheck_XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    root_ = templ;
    dir_ = root_ + "/step-5";
    std::filesystem::create_directory(dir_);
    Write(dir_ + "/model.safetensors", kWeights);
    Write(root_ + "/secret", "the admin token");
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  static void Write(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
  }
  // Writes `dir`/MANIFEST naming `name` with `text`'s size and CRC-32C, and
  // returns the checkpoint the coordinator would have recorded.
  v1::Checkpoint Commit(const std::string& dir, const std::string& name, const std::string& text) {
    Manifest m;
    m.step = 5;
    m.files.push_back({name, static_cast<int64_t>(text.size()), Crc32c(text.data(), text.size())});
    const std::string manifest = FormatManifest(m);
    Write(dir + "/MANIFEST", manifest);
    v1::Checkpoint c;
    c.set_step(5);
    c.set_path(dir);
    c.set_committed(true);
    c.set_manifest_sha256(Sha256Hex(manifest));
    return c;
  }
  static std::string Contents(const OpenedWeights& w) {
    std::string out(static_cast<size_t>(w.entry.bytes), '\0');
    EXPECT_EQ(::pread(w.file->get(), out.data(), out.size(), 0), w.entry.bytes);
    return out;
  }

  static constexpr char kWeights[] = "weights of step five";
  std::string root_, dir_;
};

TEST_F(OpenCommittedWeightsTest, OpensTheWeightsTheManifestNames) {
  absl::StatusOr<std::optional<OpenedWeights>> w =
      OpenCommittedWeights(Commit(dir_, "model.safetensors", kWeights));
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(w->has_value());
  EXPECT_EQ(Contents(**w), kWeights);
}

TEST_F(OpenCommittedWeightsTest, AShardedCheckpointHasNoWholeModelFile) {
  Write(dir_ + "/model-rank-0.safetensors", kWeights);
  absl::StatusOr<std::optional<OpenedWeights>> w =
      OpenCommittedWeights(Commit(dir_, "model-rank-0.safetensors", kWeights));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->has_value());
}

TEST_F(OpenCommittedWeightsTest, RefusesWhatCouldReadAnotherFile) {
  // The weights a link to another file, the manifest made for that file.
  std::filesystem::remove(dir_ + "/model.safetensors");
  std::filesystem::create_symlink(root_ + "/secret", dir_ + "/model.safetensors");
  absl::StatusOr<std::optional<OpenedWeights>> linked =
      OpenCommittedWeights(Commit(dir_, "model.safetensors", "the admin token"));
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition) << linked.status();
  EXPECT_THAT(linked.status().message(), HasSubstr("symbolic link"));

  // A directory reached through a link.
  const std::string real = root_ + "/real";
  std::filesystem::create_directory(real);
  Write(real + "/model.safetensors", kWeights);
  const v1::Checkpoint through = Commit(real, "model.safetensors", kWeights);
  v1::Checkpoint via_link = through;
  std::filesystem::create_directory_symlink(real, root_ + "/link");
  via_link.set_path(root_ + "/link");
  EXPECT_EQ(OpenCommittedWeights(via_link).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(OpenCommittedWeights(through).ok());

  // No digest recorded: nothing to hold the manifest to.
  v1::Checkpoint undigested = Commit(dir_, "model.safetensors", kWeights);
  undigested.clear_manifest_sha256();
  EXPECT_THAT(OpenCommittedWeights(undigested).status().message(),
              HasSubstr("recorded no MANIFEST digest"));
}

TEST_F(OpenCommittedWeightsTest, RefusesWeightsThatAreNotTheCommittedOnes) {
  const v1::Checkpoint c = Commit(dir_, "model.safetensors", kWeights);
  std::string changed = kWeights;
  changed[0] = 'W';
  Write(dir_ + "/model.safetensors", changed);
  EXPECT_EQ(OpenCommittedWeights(c).status().code(), absl::StatusCode::kDataLoss);

  Write(dir_ + "/model.safetensors", kWeights);
  v1::Checkpoint rewritten = Commit(dir_, "model.safetensors", kWeights);
  Write(dir_ + "/MANIFEST", "aidn-checkpoint 1\nstep 5\nfile model.safetensors 3 0\n");
  EXPECT_THAT(OpenCommittedWeights(rewritten).status().message(), HasSubstr("was rewritten"));

  v1::Checkpoint missing = c;
  missing.set_path(root_ + "/nowhere");
  EXPECT_EQ(OpenCommittedWeights(missing).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace aidn
