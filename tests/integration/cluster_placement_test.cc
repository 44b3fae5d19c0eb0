// Gang placement and the queue: jobs wait for room in priority order, and
// who may call what (cluster_test_fixture.h).

#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_test_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(ClusterTest, GangPlacementWaitsForRoom) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  AddWorker("w1", 1);
  AddWorker("w2", 1);

  // Three ranks can never fit on two slots: the job waits and says why.
  absl::StatusOr<v1::Job> big = Submit(MlpSpec(3));
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(WaitForEvent("job.waiting", big->id()));
  v1::Job job;
  ASSERT_TRUE(GetJob(big->id()).ok());
  job = *GetJob(big->id());
  EXPECT_EQ(job.state(), v1::Job::PENDING);
  EXPECT_EQ(job.generation(), 0);
  EXPECT_THAT(job.message(), HasSubstr("3")) << job.message();

  // It does not block a job that fits behind it.
  absl::StatusOr<v1::Job> filler = Submit(MlpSpec(2));
  ASSERT_TRUE(filler.ok()) << filler.status();
  ASSERT_TRUE(WaitForAssignments(filler->id(), 1, 2, nullptr));
  ASSERT_TRUE(WaitForState(filler->id(), v1::Job::SCHEDULED));
  job = *GetJob(big->id());
  EXPECT_EQ(job.state(), v1::Job::PENDING);
  EXPECT_TRUE(AssignmentsOf(big->id()).empty());

  // With the cluster full, a low-priority job and then a high-priority one
  // queue up; when room frees for one of them, the high-priority one goes.
  v1::JobSpec low_spec = MlpSpec(2);
  low_spec.set_name("low");
  absl::StatusOr<v1::Job> low = Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  v1::JobSpec high_spec = MlpSpec(2);
  high_spec.set_name("high");
  high_spec.set_priority(5);
  absl::StatusOr<v1::Job> high = Submit(high_spec);
  ASSERT_TRUE(high.ok()) << high.status();
  EXPECT_EQ(GetJob(low->id())->state(), v1::Job::PENDING);
  EXPECT_EQ(GetJob(high->id())->state(), v1::Job::PENDING);

  v1::CancelJobRequest cancel;
  cancel.set_job_id(filler->id());
  cancel.set_reason("make room");
  v1::Job cancelled;
  grpc::Status status = coord()->CancelJob(Context(admin()).get(), cancel, &cancelled);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(cancelled.state(), v1::Job::CANCELLED);

  ASSERT_TRUE(WaitForAssignments(high->id(), 1, 2, nullptr));
  EXPECT_TRUE(WaitForState(high->id(), v1::Job::SCHEDULED));
  EXPECT_EQ(GetJob(low->id())->state(), v1::Job::PENDING);
  EXPECT_EQ(GetJob(big->id())->state(), v1::Job::PENDING);
  EXPECT_TRUE(AssignmentsOf(low->id()).empty());
  EXPECT_TRUE(AssignmentsOf(filler->id()).empty());
}

TEST_F(ClusterTest, AuthRolesAreEnforced) {
  const std::string token_file = cluster().Path("tokens.txt");
  const std::string user_token = "user-token-0123456789abcdef";
  WriteFileOrDie(token_file, absl::StrCat("# extra tokens\n\n", user_token, " user alice\n"));
  std::vector<std::string> args = CoordinatorArgs();
  args.push_back(absl::StrCat("--token-file=", token_file));
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith(args));

  v1::ListJobsResponse jobs;
  grpc::Status status = coord()->ListJobs(Context("").get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);
  status =
      coord()->ListJobs(Context("not-a-real-token-0123456789").get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id("w1");
  v1::HeartbeatResponse heartbeat_response;
  status = cluster_stub()->Heartbeat(Context("not-a-real-token-0123456789").get(), heartbeat,
                                     &heartbeat_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);

  // Worker token: cluster calls only.
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = MlpSpec(1);
  v1::SubmitJobResponse submitted;
  status = coord()->SubmitJob(Context(cluster().worker_token()).get(), submit, &submitted);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  status = coord()->ListJobs(Context(cluster().worker_token()).get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);

  // User token: coordinator calls only.
  v1::RegisterWorkerRequest reg;
  reg.mutable_info()->set_id("by-user");
  reg.mutable_info()->set_cpu_slots(1);
  v1::RegisterWorkerResponse reg_response;
  status = cluster_stub()->RegisterWorker(Context(user_token).get(), reg, &reg_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  absl::StatusOr<v1::Job> a = Submit(MlpSpec(1), user_token);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->owner(), "alice");
  status = coord()->ListJobs(Context(user_token).get(), v1::ListJobsRequest(), &jobs);
  EXPECT_TRUE(status.ok()) << Describe(status);

  // Admin token: everything, RegisterWorker included.
  FakeWorker* worker = AddWorker("w-admin", 2, admin());
  EXPECT_EQ(worker->registered_id(), "w-admin");
  absl::StatusOr<v1::Job> b = Submit(MlpSpec(1));
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> a_ranks;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> b_ranks;
  ASSERT_TRUE(WaitForAssignments(a->id(), 1, 1, &a_ranks));
  ASSERT_TRUE(WaitForAssignments(b->id(), 1, 1, &b_ranks));
  const v1::TrainerAssignment& a0 = a_ranks[0].second;
  const v1::TrainerAssignment& b0 = b_ranks[0].second;

  // A trainer token is good for its own job's trainer calls, nothing else.
  status = KvSet(a0, "k", "v");
  EXPECT_TRUE(status.ok()) << "own job: " << Describe(status);
  v1::TrainerAssignment a_token_for_b = b0;
  a_token_for_b.set_trainer_token(a0.trainer_token());
  status = KvSet(a_token_for_b, "k", "v");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  v1::GetJobRequest get;
  get.set_job_id(a->id());
  v1::Job job;
  status = coord()->GetJob(Context(a0.trainer_token()).get(), get, &job);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  v1::ReportTrainerExitRequest exit;
  exit.set_worker_id("w-admin");
  exit.set_job_id(a->id());
  exit.set_generation(1);
  exit.set_rank(0);
  exit.set_exit_code(0);
  v1::ReportTrainerExitResponse exit_response;
  status =
      cluster_stub()->ReportTrainerExit(Context(a0.trainer_token()).get(), exit, &exit_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
}

}  // namespace
}  // namespace aidn::testing
