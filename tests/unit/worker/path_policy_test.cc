// What a job may make a worker read or create (worker/path_policy.h).

#include "worker/path_policy.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::worker {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class PathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/paths-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/data");
    fs::create_directories(dir_ + "/work");
    absl::StatusOr<std::vector<std::string>> roots =
        ResolveRoots({"/usr/share", dir_ + "/data", dir_ + "/work/"});
    ASSERT_TRUE(roots.ok()) << roots.status();
    roots_ = *roots;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
  std::vector<std::string> roots_;
};

TEST_F(PathPolicyTest, PathsUnderARootOrRelativeOnesPass) {
  v1::JobSpec spec;
  spec.mutable_checkpoint()->set_dir("runs/a");  // under the checkpoint root
  spec.mutable_dataset()->set_dir("/usr/share/datasets/fashion-mnist");
  spec.mutable_dataset()->add_files(dir_ + "/data/corpus.txt");
  spec.mutable_dataset()->add_files(dir_ + "/work");
  EXPECT_TRUE(CheckJobPaths(spec, roots_).ok()) << CheckJobPaths(spec, roots_);
}

TEST_F(PathPolicyTest, AnythingElseIsRefusedNamingTheFieldAndNothingIsMade) {
  v1::JobSpec spec;
  spec.mutable_checkpoint()->set_dir("/etc/aidn-should-not-exist");
  absl::Status s = CheckJobPaths(spec, roots_);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("checkpoint.dir: /etc/aidn-should-not-exist is outside the paths"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("--allowed-paths"));
  EXPECT_FALSE(fs::exists("/etc/aidn-should-not-exist"));

  // A sibling whose name starts like a root is not under it.
  spec.Clear();
  spec.mutable_dataset()->add_files(dir_ + "/data-other/x.txt");
  EXPECT_THAT(std::string(CheckJobPaths(spec, roots_).message()), HasSubstr("dataset.files[0]"));
  // ".." that climbs out, once normalised.
  spec.Clear();
  spec.mutable_command()->set_working_dir(dir_ + "/work/../../..");
  EXPECT_THAT(std::string(CheckJobPaths(spec, roots_).message()), HasSubstr("command.working_dir"));
  // A link inside a root that points out of it.
  fs::create_symlink("/etc", dir_ + "/data/etc");
  spec.Clear();
  spec.mutable_dataset()->set_kind("idx");
  spec.mutable_dataset()->set_train_images(dir_ + "/data/etc/shadow");
  s = CheckJobPaths(spec, roots_);
  EXPECT_THAT(std::string(s.message()), HasSubstr("dataset.train_images"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("(/etc/shadow)"));
}

TEST(ResolveRoots, ARelativeRootIsRefused) {
  EXPECT_EQ(ResolveRoots({"data"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveRoots({""}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aidn::worker
