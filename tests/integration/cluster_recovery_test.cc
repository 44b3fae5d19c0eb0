// Failures and how the coordinator recovers: a silent worker, trainers that
// exit, a coordinator killed with -9 (cluster_test_fixture.h).

#include <csignal>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_test_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(ClusterTest, SilentWorkerRestartsTheJobWithTheNextGeneration) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  std::string job_id;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_NO_FATAL_FAILURE(StartRunningJob(&job_id, &by_rank));
  FakeWorker* w1 = workers_[0].get();
  FakeWorker* w2 = workers_[1].get();

  w2->Pause();
  v1::Job job;
  ASSERT_TRUE(WaitForJob(
      job_id,
      [](const v1::Job& j) { return j.state() == v1::Job::RESTARTING && j.generation() == 2; },
      "RESTARTING with generation 2", &job));
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_TRUE(job.placement().empty()) << job.ShortDebugString();
  EXPECT_EQ(Workers()["w2"].state(), v1::Worker::LOST);
  EXPECT_EQ(Workers()["w1"].state(), v1::Worker::ALIVE);
  EXPECT_TRUE(WaitForEvent("worker.lost", "", "w2"));
  EXPECT_TRUE(WaitForEvent("job.restarting", job_id));

  // Generation 1 is fenced off.
  for (const auto& [worker_id, a] : by_rank) {
    JoinResult late = Join(a, worker_id);
    EXPECT_EQ(late.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "JoinRendezvous gen 1: " << Describe(late.status);
    grpc::Status status = KvSet(a, "k", "v");
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "KvSet gen 1: " << Describe(status);
    v1::ReportProgressRequest progress;
    progress.set_job_id(job_id);
    progress.set_generation(1);
    progress.set_rank(a.rank());
    progress.set_step(10);
    v1::ReportProgressResponse progress_response;
    status = cluster_stub()->ReportProgress(Context(a.trainer_token()).get(), progress,
                                            &progress_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "ReportProgress gen 1: " << Describe(status);
  }

  // The surviving worker drops generation 1 and is told to stop it.
  EXPECT_TRUE(WaitFor(
      [&] {
        for (const v1::TrainerAssignment& a : w1->Assignments()) {
          if (a.job_id() == job_id && a.generation() == 1) return false;
        }
        return true;
      },
      kLong))
      << DescribeAssignments();
  EXPECT_TRUE(WaitFor(
      [&] {
        for (const v1::StopOrder& stop : w1->Stops()) {
          if (stop.job_id() == job_id && stop.generation() == 1) return true;
        }
        return false;
      },
      kLong))
      << "w1 got no StopOrder for generation 1";
  // One alive 1-slot worker cannot hold 2 ranks: still waiting.
  ASSERT_TRUE(GetJob(job_id).ok());
  EXPECT_EQ(GetJob(job_id)->state(), v1::Job::RESTARTING);

  // The silent worker comes back: generation 2 is placed on both.
  w2->Resume();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> gen2;
  ASSERT_TRUE(WaitForAssignments(job_id, 2, 2, &gen2));
  EXPECT_NE(gen2[0].first, gen2[1].first);
  ASSERT_TRUE(WaitForState(job_id, v1::Job::SCHEDULED, &job));
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(Workers()["w2"].state(), v1::Worker::ALIVE);

  // And generation 2 rendezvous works.
  for (const JoinResult& r : JoinAll(gen2)) {
    ASSERT_TRUE(r.status.ok()) << Describe(r.status);
    EXPECT_EQ(r.response.generation(), 2);
  }
  EXPECT_TRUE(WaitForState(job_id, v1::Job::RUNNING));
}

TEST_F(ClusterTest, TrainerExitsDecideTheOutcome) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  FakeWorker* w1 = AddWorker("w1", 1);
  FakeWorker* w2 = AddWorker("w2", 1);
  std::map<std::string, FakeWorker*> by_id = {{"w1", w1}, {"w2", w2}};

  // Both ranks exit 0: the job succeeded and the workers run nothing more.
  {
    absl::StatusOr<v1::Job> submitted = Submit(MlpSpec(2));
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));
    for (const JoinResult& r : JoinAll(by_rank)) ASSERT_TRUE(r.status.ok()) << Describe(r.status);
    ASSERT_TRUE(WaitForState(job_id, v1::Job::RUNNING));
    for (const auto& [worker_id, a] : by_rank) {
      grpc::Status status = by_id[worker_id]->ReportExit(a, 0);
      ASSERT_TRUE(status.ok()) << Describe(status);
    }
    v1::Job job;
    ASSERT_TRUE(WaitForState(job_id, v1::Job::SUCCEEDED, &job));
    EXPECT_EQ(job.generation(), 1);
    EXPECT_TRUE(WaitForEvent("job.succeeded", job_id));
    EXPECT_TRUE(
        WaitFor([&] { return w1->Assignments().empty() && w2->Assignments().empty(); }, kLong))
        << DescribeAssignments();
    EXPECT_TRUE(WaitFor(
        [&] {
          std::map<std::string, v1::Worker> workers = Workers();
          return workers["w1"].cpu_slots_used() == 0 && workers["w2"].cpu_slots_used() == 0;
        },
        kLong));
  }

  // A non-zero exit restarts the job while restarts remain, then fails it.
  {
    v1::JobSpec spec = MlpSpec(1);
    spec.set_max_restarts(1);
    absl::StatusOr<v1::Job> submitted = Submit(spec);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen1;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 1, &gen1));
    grpc::Status status =
        by_id[gen1[0].first]->ReportExit(gen1[0].second, 1, false, "RuntimeError: boom");
    ASSERT_TRUE(status.ok()) << Describe(status);

    v1::Job job;
    ASSERT_TRUE(WaitForJob(
        job_id,
        [](const v1::Job& j) {
          return j.generation() == 2 &&
                 (j.state() == v1::Job::RESTARTING || j.state() == v1::Job::SCHEDULED);
        },
        "restarting with generation 2", &job));
    EXPECT_EQ(job.restarts(), 1);
    EXPECT_TRUE(WaitForEvent("job.restarting", job_id));

    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen2;
    ASSERT_TRUE(WaitForAssignments(job_id, 2, 1, &gen2));
    status = by_id[gen2[0].first]->ReportExit(gen2[0].second, 1, false, "RuntimeError: boom");
    ASSERT_TRUE(status.ok()) << Describe(status);
    ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
    EXPECT_EQ(job.generation(), 2);
    EXPECT_EQ(job.restarts(), 1);
    EXPECT_THAT(absl::AsciiStrToLower(job.message()), HasSubstr("exit")) << job.message();
    EXPECT_TRUE(WaitForEvent("job.failed", job_id));
    EXPECT_TRUE(WaitFor([&] { return AssignmentsOf(job_id).empty(); }, kLong))
        << DescribeAssignments();
  }

  // A permanent failure fails the job at once, restarts or not.
  {
    v1::JobSpec spec = MlpSpec(1);
    spec.set_max_restarts(3);
    absl::StatusOr<v1::Job> submitted = Submit(spec);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen1;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 1, &gen1));
    grpc::Status status =
        by_id[gen1[0].first]->ReportExit(gen1[0].second, 78, true, "dataset not found");
    ASSERT_TRUE(status.ok()) << Describe(status);
    v1::Job job;
    ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
    EXPECT_EQ(job.generation(), 1);
    EXPECT_EQ(job.restarts(), 0);
    EXPECT_FALSE(job.message().empty());
    EXPECT_FALSE(HasEvent("job.restarting", job_id));
  }
}

TEST_F(ClusterTest, CoordinatorKill9KeepsJobsAndWorkers) {
  // A longer worker timeout: the workers need a moment to find the restarted
  // coordinator on its new port.
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith(CoordinatorArgs("3s")));
  std::string job_id;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_NO_FATAL_FAILURE(StartRunningJob(&job_id, &by_rank));
  const std::vector<v1::Event> events_before = Events();
  ASSERT_FALSE(events_before.empty());
  const std::string admin_token = admin();

  absl::StatusOr<int> exit = cluster().KillCoordinator();
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 128 + SIGKILL);

  // The same state directory, on a new port that the workers are told.
  const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/false);
  ASSERT_TRUE(restarted.ok()) << restarted;
  EXPECT_EQ(admin(), admin_token);
  std::vector<int64_t> heartbeats_at_restart;
  for (const auto& worker : workers_) {
    worker->SetAddress(cluster().address());
    heartbeats_at_restart.push_back(worker->successful_heartbeats());
  }

  // Let the workers heartbeat to the new coordinator for longer than the
  // worker timeout: a coordinator that lost them would show it by then.
  ASSERT_TRUE(WaitFor(
      [&] {
        for (size_t i = 0; i < workers_.size(); ++i) {
          if (workers_[i]->successful_heartbeats() < heartbeats_at_restart[i] + 20) return false;
        }
        return true;
      },
      kLong))
      << "the workers could not heartbeat to the restarted coordinator";

  v1::Job job;
  ASSERT_TRUE(GetJob(job_id).ok()) << GetJob(job_id).status();
  job = *GetJob(job_id);
  EXPECT_EQ(job.state(), v1::Job::RUNNING) << job.ShortDebugString();
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_FALSE(HasEvent("job.restarting", job_id));
  std::map<std::string, v1::Worker> workers = Workers();
  EXPECT_EQ(workers["w1"].state(), v1::Worker::ALIVE);
  EXPECT_EQ(workers["w2"].state(), v1::Worker::ALIVE);
  // The workers still hold generation 1.
  EXPECT_TRUE(WaitForAssignments(job_id, 1, 2, nullptr));

  // Every event from before is there with the same seq.
  std::map<int64_t, v1::Event> after;
  for (const v1::Event& e : Events()) after[e.seq()] = e;
  for (const v1::Event& e : events_before) {
    auto it = after.find(e.seq());
    ASSERT_NE(it, after.end()) << "event " << e.seq() << " " << e.type() << " is gone";
    EXPECT_EQ(it->second.type(), e.type()) << e.seq();
    EXPECT_EQ(it->second.job_id(), e.job_id()) << e.seq();
    EXPECT_EQ(it->second.worker_id(), e.worker_id()) << e.seq();
  }

  // Job numbering carries on.
  absl::StatusOr<v1::Job> next = Submit(MlpSpec(1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->id(), "job-2");
}

}  // namespace
}  // namespace aidn::testing
