// Pausing and resuming a job: the agreement on the checkpoint step (pure),
// and the coordinator's side with a fake clock.
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/checkpoint_agreement.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using v1::Job;

AgreementInputs Inputs(int world, int64_t max_step, double step_seconds, int64_t total = 0) {
  AgreementInputs in;
  in.world_size = world;
  in.max_step = max_step;
  in.step_seconds = step_seconds;
  in.total_steps = total;
  return in;
}

TEST(CheckpointAgreementTest, AProposalLiesTwoSecondsOfTrainingAheadOfTheFurthestRank) {
  CheckpointAgreement a;
  EXPECT_EQ(CheckpointAgreements::Propose(&a, Inputs(2, 1000, 0.01)), 1200);
  CheckpointAgreement unknown;
  EXPECT_EQ(CheckpointAgreements::Propose(&unknown, Inputs(2, 1000, 0)),
            1000 + CheckpointAgreements::kUnknownLeadSteps);
  CheckpointAgreement slow;  // steps slower than the lead: the next one
  EXPECT_EQ(CheckpointAgreements::Propose(&slow, Inputs(2, 7, 30.0)), 8);
  CheckpointAgreement near_end;  // never past the last step
  EXPECT_EQ(CheckpointAgreements::Propose(&near_end, Inputs(2, 1000, 0.01, 1100)), 1100);
}

TEST(CheckpointAgreementTest, GoComesOnceEveryRankAckedAndAMissMovesThePastEveryRank) {
  CheckpointAgreement a;
  // The first beat proposes.
  EXPECT_TRUE(CheckpointAgreements::Beat(&a, 0, 0, 0, Inputs(3, 100, 0.01)));
  EXPECT_EQ(a.step, 300);
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 0, 300, 0, Inputs(3, 150, 0.01)));
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 1, 300, 0, Inputs(3, 150, 0.01)));
  // A stale answer (to no proposal made) changes nothing.
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 2, 17, 0, Inputs(3, 150, 0.01)));
  EXPECT_FALSE(a.go);
  // Rank 2 was past it: a later step, with twice the lead, past rank 2.
  EXPECT_TRUE(CheckpointAgreements::Beat(&a, 2, 0, 300, Inputs(3, 320, 0.01)));
  EXPECT_EQ(a.step, 320 + 400);
  EXPECT_THAT(a.acked, IsEmpty());
  // Acks of the old step do not count for the new one.
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 0, 300, 0, Inputs(3, 320, 0.01)));
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 0, 720, 0, Inputs(3, 320, 0.01)));
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 1, 720, 0, Inputs(3, 320, 0.01)));
  // A miss of the old step, arriving late, changes nothing either.
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 1, 0, 300, Inputs(3, 320, 0.01)));
  EXPECT_TRUE(CheckpointAgreements::Beat(&a, 2, 720, 0, Inputs(3, 320, 0.01)));
  EXPECT_TRUE(a.go);
  EXPECT_EQ(a.step, 720);
  // Once agreed, it stays.
  EXPECT_FALSE(CheckpointAgreements::Beat(&a, 2, 0, 720, Inputs(3, 800, 0.01)));
  EXPECT_EQ(a.step, 720);
}

absl::StatusOr<v1::ReportProgressResponse> PauseBeat(Coordinator& c, const std::string& id,
                                                     int64_t generation, int rank, int64_t step,
                                                     int64_t ack, int64_t missed) {
  v1::ReportProgressRequest request;
  request.set_job_id(id);
  request.set_generation(generation);
  request.set_rank(rank);
  request.set_step(step);
  request.set_epoch(1);
  request.set_checkpoint_ack(ack);
  request.set_checkpoint_missed(missed);
  return c.ReportProgress(request);
}

v1::JobSpec CheckpointedSpec() {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_dir("ckpt");
  spec.mutable_checkpoint()->set_every_steps(1000);
  return spec;
}

TEST_F(CoordinatorTest, APausedJobCheckpointsAtTheAgreedStepStopsAndResumesWithoutARestart) {
  const std::string id = RunningJobOnTwoWorkers(CheckpointedSpec());
  ASSERT_TRUE(Register("w3", 1).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 0, 1, 40, 0.01).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 1, 1, 40, 0.01).ok());
  ASSERT_TRUE(Progress(id, 1, 0, 40, 0).ok());

  absl::StatusOr<Job> pausing = c().PauseJob(id, "maintenance", "alice");
  ASSERT_TRUE(pausing.ok()) << pausing.status();
  EXPECT_EQ(pausing->state(), Job::RUNNING);
  EXPECT_EQ(pausing->pausing().by(), "alice");
  EXPECT_EQ(pausing->pausing().after_step(), 40);
  EXPECT_THAT(Events(id), Contains("job.pausing"));
  // Asked again: the first request stands.
  ASSERT_TRUE(c().PauseJob(id, "again", "bob").ok());
  EXPECT_EQ(Get(id).pausing().by(), "alice");

  // Both ranks hear of the step (two seconds at 10 ms a step ahead), ack it
  // and, at go, checkpoint there.
  absl::StatusOr<v1::ReportProgressResponse> r0 = PauseBeat(c(), id, 1, 0, 41, 0, 0);
  ASSERT_TRUE(r0.ok()) << r0.status();
  const int64_t step = r0->checkpoint().step();
  EXPECT_EQ(step, 240);
  EXPECT_FALSE(r0->checkpoint().go());
  EXPECT_THAT(r0->checkpoint().reason(), HasSubstr("paused by alice: maintenance"));
  ASSERT_FALSE(PauseBeat(c(), id, 1, 0, 50, step, 0)->checkpoint().go());
  absl::StatusOr<v1::ReportProgressResponse> r1 = PauseBeat(c(), id, 1, 1, 52, step, 0);
  ASSERT_TRUE(r1.ok());
  EXPECT_TRUE(r1->checkpoint().go());
  EXPECT_TRUE(PauseBeat(c(), id, 1, 0, step, step, 0)->checkpoint().go());
  EXPECT_THAT(Events(id), Contains("job.checkpoint_agreed"));

  absl::StatusOr<v1::CommitCheckpointResponse> committed =
      CommitDurable(Commit(id, 1, 0, step, {0}));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_TRUE(committed->committed());
  const Job paused = Get(id);
  EXPECT_EQ(paused.state(), Job::PAUSED) << paused.message();
  EXPECT_EQ(paused.message(),
            absl::StrCat("paused by alice: maintenance (at checkpoint step ", step, ")"));
  EXPECT_EQ(paused.generation(), 2);
  EXPECT_EQ(paused.restarts(), 0);
  EXPECT_FALSE(paused.has_pausing());
  EXPECT_THAT(paused.placement(), IsEmpty());
  // Its trainers are told to stop; the old generation is fenced off; a
  // waiting job gets the slots.
  absl::StatusOr<v1::HeartbeatResponse> beat = Beat("w1");
  ASSERT_TRUE(beat.ok());
  ASSERT_EQ(beat->stops_size(), 1);
  EXPECT_EQ(beat->stops(0).job_id(), id);
  EXPECT_EQ(PauseBeat(c(), id, 1, 0, step, step, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const std::string other = Submit(Spec(3));
  EXPECT_EQ(Get(other).state(), Job::SCHEDULED) << Get(other).message();
  ASSERT_TRUE(c().CancelJob(other, "", "test").ok());

  // Paused jobs are not placed; resumed, it is, from the checkpoint.
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::PAUSED);
  EXPECT_EQ(c().PauseJob(id, "", "alice").status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<Job> resumed = c().ResumeJob(id, "bob");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  const Job placed = Get(id);
  EXPECT_EQ(placed.state(), Job::SCHEDULED) << placed.message();
  EXPECT_EQ(placed.generation(), 2);
  EXPECT_THAT(Events(id), Contains("job.pending"));
  std::vector<JoinAnswer> joined = RunJob(id);
  ASSERT_EQ(joined.size(), 2u);
  ASSERT_TRUE(joined[0].get().ok()) << joined[0].get().status();
  EXPECT_EQ(joined[0].get()->resume_from().step(), step);
  EXPECT_EQ(c().ResumeJob(id, "bob").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, ADrainAsksTheJobForACheckpointAndMovesItThereCountingNoRestart) {
  v1::JobSpec spec = CheckpointedSpec();
  spec.mutable_checkpoint()->set_every_steps(0);  // only the last step on the schedule
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Register("w3", 1).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 0, 1, 10, 0.01).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 1, 1, 10, 0.01).ok());
  // No ask before the drain.
  EXPECT_EQ(PauseBeat(c(), id, 1, 0, 10, 0, 0)->checkpoint().step(), 0);
  ASSERT_TRUE(c().SetWorkerScheduling("w1", v1::Worker::DRAINING, "", "admin").ok());
  EXPECT_THAT(EventList("").back().message(),
              HasSubstr("moving at a checkpoint their ranks are asked for now: " + id));
  absl::StatusOr<v1::ReportProgressResponse> r0 = PauseBeat(c(), id, 1, 0, 11, 0, 0);
  ASSERT_TRUE(r0.ok()) << r0.status();
  const int64_t step = r0->checkpoint().step();
  ASSERT_GT(step, 11);
  EXPECT_EQ(r0->checkpoint().reason(), "moving off a draining worker");
  ASSERT_TRUE(PauseBeat(c(), id, 1, 0, 12, step, 0).ok());
  EXPECT_TRUE(PauseBeat(c(), id, 1, 1, 12, step, 0)->checkpoint().go());
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, step, {0})).ok());
  const Job moved = Get(id);
  EXPECT_EQ(moved.generation(), 2);
  EXPECT_EQ(moved.restarts(), 0);
  EXPECT_EQ(moved.state(), Job::SCHEDULED) << moved.message();
  EXPECT_THAT(Events(id), Contains("job.moving"));
  for (const v1::RankPlacement& p : moved.placement()) EXPECT_NE(p.worker_id(), "w1");
}

TEST_F(CoordinatorTest, APauseIsRefusedForAJobWithoutCheckpointsAndAQueuedJobPausesAtOnce) {
  const std::string plain = RunningJobOnTwoWorkers(Spec(2));
  const size_t events = EventList("").size();
  absl::StatusOr<Job> refused = c().PauseJob(plain, "", "alice");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("writes no checkpoints"));
  EXPECT_FALSE(Get(plain).has_pausing());
  EXPECT_EQ(EventList("").size(), events);

  const std::string queued = Submit(CheckpointedSpec());
  ASSERT_EQ(Get(queued).state(), Job::PENDING);
  absl::StatusOr<Job> paused = c().PauseJob(queued, "", "alice");
  ASSERT_TRUE(paused.ok()) << paused.status();
  EXPECT_EQ(paused->state(), Job::PAUSED);
  EXPECT_EQ(paused->message(), "paused by alice");
  ASSERT_TRUE(c().CancelJob(plain, "", "test").ok());
  EXPECT_EQ(Get(queued).state(), Job::PAUSED);
  EXPECT_EQ(c().PauseJob(plain, "", "alice").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c().PauseJob("job-99", "", "alice").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<Job> long_reason = c().PauseJob(queued, std::string(2000, 'x'), "alice");
  EXPECT_EQ(long_reason.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(long_reason.status().message()), HasSubstr("reason"));
}

TEST_F(CoordinatorTest, APausingJobWhoseGenerationFailsPausesInsteadOfRestarting) {
  const std::string id = RunningJobOnTwoWorkers(CheckpointedSpec());
  ASSERT_TRUE(c().PauseJob(id, "", "alice").ok());
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  const Job job = Get(id);
  EXPECT_EQ(job.state(), Job::PAUSED) << job.message();
  EXPECT_THAT(job.message(), HasSubstr("its generation failed first"));
  EXPECT_EQ(job.generation(), 2);
}

TEST_F(CoordinatorTest, APauseRequestOutlivesACoordinatorRestart) {
  TempDir dir;
  Open(dir.path() + "/coordinator.db");
  const std::string id = RunningJobOnTwoWorkers(CheckpointedSpec());
  ASSERT_TRUE(c().PauseJob(id, "", "alice").ok());
  Open(dir.path() + "/coordinator.db");
  ASSERT_TRUE(Get(id).has_pausing());
  // The ranks' next beats get a step to agree on.
  absl::StatusOr<v1::ReportProgressResponse> r = PauseBeat(c(), id, 1, 0, 10, 0, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->checkpoint().step(), 10);
}

}  // namespace
}  // namespace aidn::coordinator
