// A worker's claim on its work directory: one daemon at a time (the second
// is told who holds it), the instance id kept across claims, a damaged id
// file replaced, another directory another id.

#include "worker/work_dir_claim.h"

#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"

namespace aidn::worker {
namespace {

using ::aidn::testing::TempDir;
using ::testing::HasSubstr;

TEST(WorkDirClaim, OneHolderAtATimeAndTheInstanceStays) {
  TempDir dir("aidn-claim-test");
  std::string instance;
  {
    absl::StatusOr<std::unique_ptr<WorkDirClaim>> first = WorkDirClaim::Take(dir.path());
    ASSERT_TRUE(first.ok()) << first.status();
    instance = (*first)->instance();
    EXPECT_EQ(instance.size(), 32u);
    // A second claim (its own open file, as another process's would be).
    absl::StatusOr<std::unique_ptr<WorkDirClaim>> second = WorkDirClaim::Take(dir.path());
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(second.status().message()),
                HasSubstr(absl::StrCat("work_dir ", dir.path(),
                                       " is in use by another aidn-worker (pid ", getpid(), ")")));
  }
  // Released with its holder; the same directory is the same instance.
  absl::StatusOr<std::unique_ptr<WorkDirClaim>> again = WorkDirClaim::Take(dir.path());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->instance(), instance);

  TempDir other("aidn-claim-test");
  absl::StatusOr<std::unique_ptr<WorkDirClaim>> elsewhere = WorkDirClaim::Take(other.path());
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  EXPECT_NE((*elsewhere)->instance(), instance);
}

TEST(WorkDirClaim, ADamagedInstanceFileIsReplaced) {
  TempDir dir("aidn-claim-test");
  { std::ofstream(dir.path() + "/worker.instance") << "not-an-instance\n"; }
  absl::StatusOr<std::unique_ptr<WorkDirClaim>> claim = WorkDirClaim::Take(dir.path());
  ASSERT_TRUE(claim.ok()) << claim.status();
  EXPECT_EQ((*claim)->instance().size(), 32u);
  std::string stored;
  std::getline(std::ifstream(dir.path() + "/worker.instance"), stored);
  EXPECT_EQ(stored, (*claim)->instance());
}

TEST(WorkDirClaim, AMissingDirectoryIsAnError) {
  EXPECT_FALSE(WorkDirClaim::Take("/nonexistent/aidn-claim-test").ok());
}

}  // namespace
}  // namespace aidn::worker
