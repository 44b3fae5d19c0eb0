// The paths a job names against the roots workers report: refused at
// submission when no alive worker allows them, placed only on workers that
// do, waiting (and saying which field) while none of those has room.

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/job_paths.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using test_util::CoordinatorTest;
using test_util::Spec;
using ::testing::HasSubstr;
using v1::Job;

class PathPlacementTest : public CoordinatorTest {
 protected:
  absl::Status RegisterWithRoots(const std::string& id, const std::vector<std::string>& roots) {
    v1::RegisterWorkerRequest request;
    request.mutable_info()->set_id(id);
    request.mutable_info()->set_cpu_slots(1);
    for (const std::string& r : roots) request.mutable_info()->add_path_roots(r);
    return c().RegisterWorker(request).status();
  }

  static v1::JobSpec WithCheckpointDir(const std::string& dir) {
    v1::JobSpec spec = Spec(1);
    spec.mutable_checkpoint()->set_dir(dir);
    return spec;
  }
};

TEST_F(PathPlacementTest, APathNoAliveWorkerAllowsIsRefusedAtSubmissionNamingTheField) {
  ASSERT_TRUE(RegisterWithRoots("w1", {"/usr/share", "/var/lib/aidn/w1"}).ok());
  ASSERT_TRUE(RegisterWithRoots("w2", {"/usr/share", "/data"}).ok());
  absl::StatusOr<Job> job = c().SubmitJob(WithCheckpointDir("/database/ckpt"), "alice");
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
  EXPECT_THAT(job.status().message(), HasSubstr("checkpoint.dir: /database/ckpt is outside"));
  EXPECT_THAT(job.status().message(),
              HasSubstr("w1: /usr/share, /var/lib/aidn/w1; w2: /usr/share, /data"));
  EXPECT_THAT(job.status().message(), HasSubstr("--allowed-paths"));
  // Nothing was stored or numbered.
  v1::ListJobsRequest all;
  EXPECT_EQ(c().ListJobs(all)->jobs_size(), 0);
  EXPECT_EQ(Submit(Spec(1)), "job-1");
}

TEST_F(PathPlacementTest, AJobRunsOnlyOnWorkersWhoseRootsHoldItsPaths) {
  ASSERT_TRUE(RegisterWithRoots("w1", {"/usr/share"}).ok());
  ASSERT_TRUE(RegisterWithRoots("w2", {"/usr/share", "/data"}).ok());
  // w1 sorts first and has the same room, but only w2 allows /data.
  const std::string id = Submit(WithCheckpointDir("/data/ckpt"));
  const Job job = Get(id);
  ASSERT_EQ(job.placement_size(), 1);
  EXPECT_EQ(job.placement(0).worker_id(), "w2");
  // Relative paths lie under every worker's own directories.
  const std::string relative = Submit(WithCheckpointDir("ckpt/relative"));
  ASSERT_EQ(Get(relative).placement_size(), 1);
  EXPECT_EQ(Get(relative).placement(0).worker_id(), "w1");
}

TEST_F(PathPlacementTest, WhileTheAllowingWorkersAreFullTheJobWaitsSayingWhy) {
  // (The default dataset lies under /usr/share.)
  ASSERT_TRUE(RegisterWithRoots("w1", {"/usr/share"}).ok());
  ASSERT_TRUE(RegisterWithRoots("w2", {"/usr/share", "/data"}).ok());
  const std::string first = Submit(WithCheckpointDir("/data/a"));
  ASSERT_EQ(Get(first).placement(0).worker_id(), "w2");
  const std::string second = Submit(WithCheckpointDir("/data/b"));
  const Job waiting = Get(second);
  EXPECT_EQ(waiting.state(), Job::PENDING);
  EXPECT_THAT(waiting.message(),
              HasSubstr("1 worker(s) do not allow the job's paths: checkpoint.dir: /data/b is "
                        "outside w1's allowed paths"));
}

TEST_F(PathPlacementTest, WorkersThatReportNoRootsAreNotFiltered) {
  ASSERT_TRUE(Register("old", 1).ok());
  const std::string id = Submit(WithCheckpointDir("/anywhere/ckpt"));
  ASSERT_EQ(Get(id).placement_size(), 1);
  EXPECT_EQ(Get(id).placement(0).worker_id(), "old");
}

TEST(JobPaths, LexicalChecksFoldDotDotAndRespectComponentBoundaries) {
  EXPECT_EQ(LexicallyNormal("/data/./x/../y/"), "/data/y");
  EXPECT_TRUE(PathUnder("/data/y", "/data"));
  EXPECT_TRUE(PathUnder("/data", "/data"));
  EXPECT_FALSE(PathUnder("/database", "/data"));
  EXPECT_TRUE(PathUnder("/etc", "/"));
  v1::JobSpec spec;
  spec.mutable_checkpoint()->set_dir("relative");
  spec.mutable_command()->set_working_dir("/srv/../etc");
  const std::optional<PathOutside> out = FirstPathOutside(spec, {"/srv"});
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->named.field, "command.working_dir");
  EXPECT_EQ(out->resolved, "/etc");
}

}  // namespace
}  // namespace aidn::coordinator
