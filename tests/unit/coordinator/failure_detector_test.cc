#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/failure_detector.h"
#include "coordinator/time_util.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using std::chrono::milliseconds;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using v1::Job;

// --- FailureDetector alone ---------------------------------------------------

v1::Job PlacedJob(int world_size) {
  v1::Job job;
  job.set_id("job-1");
  job.set_generation(1);
  job.set_state(v1::Job::RUNNING);
  *job.mutable_spec() = Spec(world_size);
  for (int r = 0; r < world_size; ++r) {
    v1::RankPlacement* p = job.add_placement();
    p->set_rank(r);
    p->set_worker_id(absl::StrCat("w", r));
  }
  return job;
}

TEST(FailureDetector, AWorkerIsLostOnlyOnceSilentLongerThanTheTimeout) {
  FakeClock clock;
  FailureDetector detector({.worker_timeout = milliseconds(10'000)});
  const WorkerLiveness worker{v1::Worker::ALIVE, clock.Now()};
  clock.Advance(milliseconds(10'000));
  EXPECT_FALSE(detector.WorkerSilence(worker, clock.Now()).has_value());
  clock.Advance(milliseconds(1));
  EXPECT_EQ(detector.WorkerSilence(worker, clock.Now()), milliseconds(10'001));
  // A worker already lost is not lost again.
  EXPECT_FALSE(detector.WorkerSilence({v1::Worker::LOST, worker.last_seen}, clock.Now()));
}

TEST(FailureDetector, PlacementFailureNamesTheUnknownLostOrSilentWorker) {
  FakeClock clock;
  FailureDetector detector({.worker_timeout = milliseconds(10'000)});
  v1::Job job = PlacedJob(2);
  *job.mutable_spec()->mutable_timeouts()->mutable_worker() = Dur(milliseconds(3'000));
  std::map<std::string, WorkerLiveness> workers{{"w0", {v1::Worker::ALIVE, clock.Now()}},
                                                {"w1", {v1::Worker::ALIVE, clock.Now()}}};
  const auto lookup = [&](const std::string& id) -> std::optional<WorkerLiveness> {
    auto it = workers.find(id);
    if (it == workers.end()) return std::nullopt;
    return it->second;
  };
  EXPECT_EQ(detector.PlacementFailure(job, lookup, clock.Now()), "");
  clock.Advance(milliseconds(3'001));  // past the job's own timeout, not the worker timeout
  workers["w0"].last_seen = clock.Now();
  EXPECT_EQ(detector.PlacementFailure(job, lookup, clock.Now()),
            "worker w1 silent for 3.001s (job's worker timeout 3s) with rank 1");
  workers["w1"].state = v1::Worker::LOST;
  EXPECT_THAT(detector.PlacementFailure(job, lookup, clock.Now()),
              StartsWith("worker w1 lost (no heartbeat for 3.001s) with rank 1"));
  workers.erase("w1");
  EXPECT_EQ(detector.PlacementFailure(job, lookup, clock.Now()), "worker w1 is unknown");
}

TEST(FailureDetector, AHangNamesTheSilentRankAndWhereTheOthersWait) {
  FakeClock clock;
  FailureDetector detector({.trainer_beat_interval = milliseconds(1000)});
  v1::Job job = PlacedJob(3);
  *job.mutable_spec()->mutable_timeouts()->mutable_progress() = Dur(milliseconds(5'000));
  JobHealth health;
  health.Restart(clock.Now());
  for (int r = 0; r < 3; ++r) FailureDetector::Beat(&health, r, 7, 40, clock.Now());
  // Every rank beat, so the spec's timeout holds (not the one-minute floor).
  clock.Advance(milliseconds(3'000));
  FailureDetector::Beat(&health, 0, 7, 41, clock.Now());
  FailureDetector::Beat(&health, 1, 7, 41, clock.Now());
  EXPECT_FALSE(detector.Hang(job, health, nullptr, clock.Now()).has_value());
  clock.Advance(milliseconds(2'001));
  FailureDetector::Beat(&health, 0, 7, 41, clock.Now());
  FailureDetector::Beat(&health, 1, 7, 41, clock.Now());
  const std::optional<std::string> hang = detector.Hang(job, health, nullptr, clock.Now());
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang,
            "no progress for 5s at step 7: rank 2 silent for 5.001s (last beat at step 7, "
            "collective 40); ranks 0, 1 waiting at step 7, collective 41");
}

TEST(FailureDetector, UntilEveryRankBeatTheProgressTimeoutIsAtLeastAMinute) {
  FakeClock clock;
  FailureDetector detector({});
  v1::Job job = PlacedJob(2);
  *job.mutable_spec()->mutable_timeouts()->mutable_progress() = Dur(milliseconds(5'000));
  JobHealth health;
  health.Restart(clock.Now());
  FailureDetector::Beat(&health, 0, 1, 0, clock.Now());
  clock.Advance(FailureDetector::kMinAutoProgressTimeout);
  EXPECT_FALSE(detector.Hang(job, health, nullptr, clock.Now()).has_value());
  clock.Advance(milliseconds(1));
  const std::optional<std::string> hang = detector.Hang(job, health, nullptr, clock.Now());
  ASSERT_TRUE(hang.has_value());
  EXPECT_THAT(*hang, HasSubstr("rank 1 silent for 60.001s (no beat yet)"));
}

TEST(FailureDetector, AutomaticProgressTimeoutFollowsTheMedianStep) {
  v1::Job job = PlacedJob(1);
  const std::deque<double> slow(30, 9.0);  // ten steps: 90 s
  EXPECT_EQ(FailureDetector::ProgressTimeout(job, nullptr), milliseconds(60'000));
  EXPECT_EQ(FailureDetector::ProgressTimeout(job, &slow), milliseconds(90'000));
}

TEST(FailureDetector, AStragglerIsReportedOnceAndRecoversBelowTheLowerRatio) {
  JobHealth health;
  for (int i = 0; i < 20; ++i) {
    FailureDetector::AddStepTime(&health, 0, 1.0);
    FailureDetector::AddStepTime(&health, 1, 1.0);
    FailureDetector::AddStepTime(&health, 2, 2.0);
  }
  std::vector<StragglerChange> changes = FailureDetector::CheckStragglers(&health);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].rank, 2);
  EXPECT_TRUE(changes[0].slow);
  EXPECT_THAT(changes[0].message, HasSubstr("(2.00x)"));
  EXPECT_TRUE(FailureDetector::CheckStragglers(&health).empty());
  // 1.3x: still a straggler, since it recovers only below 1.2x.
  for (size_t i = 0; i < FailureDetector::kStragglerWindow; ++i) {
    FailureDetector::AddStepTime(&health, 2, 1.3);
  }
  EXPECT_TRUE(FailureDetector::CheckStragglers(&health).empty());
  for (size_t i = 0; i < FailureDetector::kStragglerWindow; ++i) {
    FailureDetector::AddStepTime(&health, 2, 1.0);
  }
  changes = FailureDetector::CheckStragglers(&health);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_FALSE(changes[0].slow);
  EXPECT_TRUE(health.stragglers.empty());
}

// --- Coordinator-level: failure detector -------------------------------------

TEST_F(CoordinatorTest, RendezvousTimeoutAnswersTheWaiterNamingTheMissingRank) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_rendezvous() = Dur(milliseconds(1000));
  const std::string id = Submit(spec);
  JoinAnswer r0 = Join(id, 1, 0);

  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(r0.done()) << "timed out early";

  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(r0.done());
  EXPECT_EQ(r0.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r0.get().status().message(), HasSubstr("missing ranks 1"));
  EXPECT_THAT(r0.get().status().message(), HasSubstr("timed out after 1s"));

  // The generation failed; there is room, so the next one is placed after
  // the restart backoff.
  Job job = Get(id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  PassBackoff(id);
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_TRUE(InOrder(Events(id), {"rendezvous.timeout", "job.restarting", "job.scheduled"}));
  // The old generation's rendezvous is closed.
  JoinAnswer late = Join(id, 1, 1);
  ASSERT_TRUE(late.done());
  EXPECT_EQ(late.get().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, SilentWorkerIsLostAndItsJobRestartsWhenCapacityReturns) {
  const std::string id = RunningJobOnTwoWorkers();
  // w2 keeps beating; w1 goes silent past the worker timeout.
  clock_.Advance(milliseconds(6000));
  ASSERT_TRUE(Beat("w2").ok());
  clock_.Advance(milliseconds(3000));
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE) << "lost before its timeout";
  EXPECT_EQ(Get(id).state(), Job::RUNNING);

  clock_.Advance(milliseconds(2000));  // w1 silent 11s, w2 5s
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::LOST);
  EXPECT_EQ(WorkerNamed("w2").state(), v1::Worker::ALIVE);
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RESTARTING) << job.message();
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.placement_size(), 0);
  // The event says why it restarted.
  EXPECT_THAT(job.message(), HasSubstr("restart 1 of 3 in 1s: worker w1 lost"));
  std::string restart_reason;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.restarting") restart_reason = e.message();
  }
  EXPECT_THAT(restart_reason, HasSubstr("worker w1 lost"));
  bool lost_event = false;
  for (const v1::Event& e : EventList("")) {
    if (e.type() == "worker.lost" && e.worker_id() == "w1") lost_event = true;
    EXPECT_FALSE(e.type() == "worker.lost" && e.worker_id() == "w2");
  }
  EXPECT_TRUE(lost_event);

  // w2 is told to stop the old generation and runs nothing.
  absl::StatusOr<v1::HeartbeatResponse> w2 = Beat("w2");
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_EQ(w2->assignments_size(), 0);
  ASSERT_EQ(w2->stops_size(), 1);
  EXPECT_EQ(w2->stops(0).job_id(), id);
  EXPECT_EQ(w2->stops(0).generation(), 1);

  // Only one slot is alive: once the backoff ran out, the job still cannot be
  // placed, and its message says what it waits for.
  clock_.Advance(BackoffOf(id));
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RESTARTING);
  EXPECT_THAT(Get(id).message(), HasSubstr("needs 2"));

  // w1 comes back: the job is placed again, as generation 2.
  absl::StatusOr<v1::HeartbeatResponse> w1 = Beat("w1");
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  ASSERT_EQ(w1->assignments_size(), 1);
  EXPECT_EQ(w1->assignments(0).generation(), 2);
  EXPECT_THAT(Events(""), Contains("worker.back"));
  RunJob(id);
}

TEST_F(CoordinatorTest, WorkerSilentPastTheJobsOwnTimeoutFailsTheGeneration) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_worker() = Dur(milliseconds(3000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  clock_.Advance(milliseconds(2000));
  ASSERT_TRUE(Beat("w2").ok());
  clock_.Advance(milliseconds(2000));  // w1 silent 4s: past the job's 3s
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  Job job = Get(id);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  // Generation 2 is not put back on the silent worker (that would fail it
  // again at the next tick and burn every restart within a second).
  EXPECT_EQ(job.state(), Job::RESTARTING);
  // Past the restart backoff (1s), w2 alone is not enough.
  for (int i = 0; i < 15; ++i) {
    clock_.Advance(milliseconds(100));
    ASSERT_TRUE(Beat("w2").ok());
    c().Tick();
  }
  job = Get(id);
  EXPECT_EQ(job.state(), Job::RESTARTING);
  EXPECT_EQ(job.restarts(), 1);
  // Once it is heard from again, it gets the job back.
  ASSERT_TRUE(Beat("w1").ok());
  c().Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
}

TEST_F(CoordinatorTest, WorkersThatDoNotComeBackAfterARestartAreLost) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_NE(coord_, nullptr);
  const std::string id = RunningJobOnTwoWorkers();
  clock_.Advance(milliseconds(60'000));  // the coordinator was down a while
  Open(path);
  ASSERT_NE(coord_, nullptr);
  // A full worker timeout from the restart, not from the last heartbeat.
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  clock_.Advance(milliseconds(5000));
  ASSERT_TRUE(Beat("w1").ok());
  clock_.Advance(milliseconds(6000));
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  EXPECT_EQ(WorkerNamed("w2").state(), v1::Worker::LOST);
  EXPECT_EQ(Get(id).generation(), 2);
}

TEST_F(CoordinatorTest, AHangIsCaughtThoughBeatsGoOnAndTheSilentRankIsNamed) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  // Rank 1 stops (SIGSTOP) after step 49; rank 0 finishes step 50 and
  // waits in the allreduce of step 51, beating all along.
  ASSERT_TRUE(Progress(id, 1, 1, 49, 2012).ok());
  ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
  for (int s = 1; s <= 5; ++s) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::RUNNING) << "hang declared after " << s << "s";
  }
  clock_.Advance(milliseconds(100));
  c().Tick();
  const Job job = Get(id);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  const std::string expected =
      "no progress for 5s at step 50: rank 1 silent for 5.1s (last beat at step 49, collective "
      "2012); rank 0 waiting at step 50, collective 2013";
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang, expected);
  EXPECT_THAT(job.message(), HasSubstr(expected));
  EXPECT_TRUE(InOrder(Events(id), {"job.hang", "job.restarting"}));
}

TEST_F(CoordinatorTest, AHangWhereEveryRankBeatsNamesTheRanksBehind) {
  v1::JobSpec spec = Spec(3);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  const std::string id = Submit(spec);
  RunJob(id);
  for (int s = 0; s <= 5; ++s) {
    ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
    ASSERT_TRUE(Progress(id, 1, 1, 50, 2012).ok());
    ASSERT_TRUE(Progress(id, 1, 2, 50, 2013).ok());
    for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Beat(w).ok());
    clock_.Advance(milliseconds(1000));
  }
  c().Tick();
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang,
            "no progress for 5s at step 50: rank 1 behind at step 50, collective 2012; ranks 0, "
            "2 waiting at step 50, collective 2013");
  EXPECT_EQ(Get(id).generation(), 2);
}

TEST_F(CoordinatorTest, ARankThatNeverBeatIsNamedAsSilent) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  auto hang = [&] {
    std::string text;
    for (const v1::Event& e : EventList(id)) {
      if (e.type() == "job.hang") text = e.message();
    }
    return text;
  };
  // Until every rank has beaten once, the ranks are still setting up: the
  // 5s timeout is stretched to the automatic minimum of 60s.
  for (int s = 1; s <= 60; ++s) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(hang(), "") << "at " << s << "s";
  }
  // (rank 0's first beat, at step 0, was its first advance, at 1s.)
  clock_.Advance(milliseconds(1100));
  c().Tick();
  EXPECT_THAT(hang(), HasSubstr("rank 1 silent for"));
  EXPECT_THAT(hang(), HasSubstr("(no beat yet); rank 0 waiting at step 0, collective 0"));
}

TEST_F(CoordinatorTest, ARankThatBeatOnceAndStoppedIsCaughtWithinTheSpecsTimeout) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 0, 0).ok());
  clock_.Advance(milliseconds(5100));
  ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
  c().Tick();
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang,
            "no progress for 5s at step 0: rank 1 silent for 5.1s (last beat at step 0, "
            "collective 0); rank 0 waiting at step 0, collective 0");
}

TEST_F(CoordinatorTest, EveryStepTakenPushesTheProgressDeadlineBack) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  for (int64_t step = 1; step <= 10; ++step) {
    clock_.Advance(milliseconds(4000));
    ASSERT_TRUE(Progress(id, 1, static_cast<int>(step % 2), step, step * 10).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::RUNNING) << "at step " << step;
  }
  EXPECT_EQ(Get(id).restarts(), 0);
}

TEST_F(CoordinatorTest, AutomaticProgressTimeoutIsTenMedianStepsButAtLeastAMinute) {
  const std::string id = RunningJobOnTwoWorkers();
  auto run_until = [&](milliseconds total) {
    for (milliseconds t(0); t < total; t += milliseconds(5000)) {
      clock_.Advance(milliseconds(5000));
      for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
      c().Tick();
    }
  };
  // No step times yet: a minute.
  ASSERT_TRUE(Progress(id, 1, 0, 1, 1).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 1, 1).ok());
  run_until(milliseconds(60'000));
  ASSERT_EQ(Get(id).state(), Job::RUNNING);
  clock_.Advance(milliseconds(100));
  c().Tick();
  ASSERT_EQ(Get(id).generation(), 2) << "no hang after 60.1s";
  PassBackoff(id);
  RunJob(id);

  // Steps of 9s (the slower rank's): 90s.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 2, rank, 1, 9, 4.5 * (rank + 1)).ok());
  ASSERT_TRUE(Progress(id, 2, 0, 9, 9).ok());
  run_until(milliseconds(90'000));
  ASSERT_EQ(Get(id).state(), Job::RUNNING) << Get(id).message();
  clock_.Advance(milliseconds(100));
  c().Tick();
  EXPECT_EQ(Get(id).generation(), 3);
}

TEST_F(CoordinatorTest, ASlowRankIsReportedAsAStragglerOnceAndAsRecoveredLater) {
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  const std::string id = Submit(Spec(3));
  RunJob(id);
  auto count = [&](const std::string& type) {
    int n = 0;
    for (const std::string& t : Events(id)) n += t == type;
    return n;
  };
  const std::string gauge = absl::StrCat("aidn_rank_straggler{job_id=\"", id, "\",rank=\"2\"} ");
  // 19 steps each: too few to judge.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 1, 19, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 1, 19, 0.20).ok());
  c().Tick();
  EXPECT_EQ(count("rank.straggler"), 0);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "0\n"));

  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 20, 20, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 20, 20, 0.20).ok());
  c().Tick();
  ASSERT_EQ(count("rank.straggler"), 1);
  for (const v1::Event& e : EventList(id)) {
    if (e.type() != "rank.straggler") continue;
    EXPECT_EQ(e.worker_id(), WorkerOf(id, 2));
    EXPECT_THAT(e.message(), StartsWith("rank 2: median compute time 0.2s over its last 20 steps"));
    EXPECT_THAT(e.message(), HasSubstr("(2.00x)"));
  }
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "1\n"));
  EXPECT_THAT(c().registry()->Serialize(),
              HasSubstr(absl::StrCat("aidn_rank_straggler{job_id=\"", id, "\",rank=\"0\"} 0\n")));

  // Still slow: no second event. Then it catches up.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 21, 30, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 21, 30, 0.20).ok());
  c().Tick();
  EXPECT_EQ(count("rank.straggler"), 1);
  EXPECT_EQ(count("rank.recovered"), 0);
  // 1.4x is not recovered (hysteresis: below 1.2x), and a state lasts at
  // least a window (50) of the rank's own steps, so noise does not flap.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 31, 60, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 31, 60, 0.14).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 0);
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 61, 69, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 61, 69, 0.11).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 0) << "within a window of the last change";
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 70, 100, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 70, 100, 0.11).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 1);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "0\n"));
  // Nothing restarted.
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  EXPECT_EQ(Get(id).generation(), 1);
}

}  // namespace
}  // namespace aidn::coordinator

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using std::chrono::milliseconds;
using ::testing::HasSubstr;
using v1::Job;

// A rank's exit report with the worker's time of the exit.
v1::ReportTrainerExitRequest ExitAt(const std::string& job_id, const std::string& worker, int rank,
                                    absl::Time at, bool stopped_by_order = false) {
  v1::ReportTrainerExitRequest r;
  r.set_worker_id(worker);
  r.set_job_id(job_id);
  r.set_generation(1);
  r.set_rank(rank);
  r.set_exit_code(1);
  r.set_stopped_by_order(stopped_by_order);
  r.set_stderr_tail(absl::StrCat("rank ", rank, "'s last words"));
  *r.mutable_exited_at() = ToProto(at);
  return r;
}

// Two ranks, and a restart backoff longer than the tests look, so the job
// stays RESTARTING with the failure's reason in its message.
v1::JobSpec SlowRestartSpec() {
  v1::JobSpec spec = Spec(2);
  spec.mutable_timeouts()->mutable_restart_backoff()->set_seconds(60);
  return spec;
}

std::vector<std::string> MessagesOf(const std::vector<v1::Event>& events, const std::string& type) {
  std::vector<std::string> out;
  for (const v1::Event& e : events) {
    if (e.type() == type) out.push_back(e.message());
  }
  return out;
}

TEST_F(CoordinatorTest, AWorkerSilentBeforeARanksFailureIsTheRootCause) {
  const std::string id = RunningJobOnTwoWorkers(SlowRestartSpec());
  const std::string healthy = WorkerOf(id, 0);
  const std::string dead = WorkerOf(id, 1);
  // `dead` dies (with its rank) right after a heartbeat; the rank on the
  // healthy worker fails on the broken connection and is reported first.
  ASSERT_TRUE(Beat(healthy).ok());
  ASSERT_TRUE(Beat(dead).ok());
  clock_.Advance(milliseconds(300));
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, healthy, 0, clock_.WallNow())).ok());
  EXPECT_THAT(Get(id).message(), HasSubstr("rank 0 on worker " + healthy));

  // The dead worker is declared lost after its timeout; the healthy one
  // keeps beating.
  for (int i = 0; i < 12 && WorkerNamed(dead).state() != v1::Worker::LOST; ++i) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Beat(healthy).ok());
    c().Tick();
  }
  ASSERT_EQ(WorkerNamed(dead).state(), v1::Worker::LOST);
  const Job job = Get(id);
  EXPECT_THAT(job.message(), HasSubstr("restart 1 of 3 in 60s: worker " + dead + " lost"));
  const std::vector<v1::Event> events = EventList(id);
  const std::vector<std::string> causes = MessagesOf(events, "job.cause");
  ASSERT_EQ(causes.size(), 1u);
  EXPECT_THAT(causes[0], HasSubstr("root cause of generation 1's failure: worker " + dead));
  EXPECT_THAT(causes[0], HasSubstr("which came before: rank 0 on worker " + healthy));
  // `events JOB` shows the loss.
  EXPECT_EQ(MessagesOf(events, "worker.lost").size(), 1u);
}

TEST_F(CoordinatorTest, AWorkerLostAfterAFailureIsNotItsCause) {
  const std::string id = RunningJobOnTwoWorkers(SlowRestartSpec());
  const std::string failing = WorkerOf(id, 0);
  const std::string other = WorkerOf(id, 1);
  clock_.Advance(milliseconds(300));
  // Both beat after the exit: `other` was alive then.
  const absl::Time exited = clock_.WallNow();
  clock_.Advance(milliseconds(100));
  ASSERT_TRUE(Beat(failing).ok());
  ASSERT_TRUE(Beat(other).ok());
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, failing, 0, exited)).ok());
  for (int i = 0; i < 12 && WorkerNamed(other).state() != v1::Worker::LOST; ++i) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Beat(failing).ok());
    c().Tick();
  }
  ASSERT_EQ(WorkerNamed(other).state(), v1::Worker::LOST);
  EXPECT_THAT(Get(id).message(), HasSubstr("rank 0 on worker " + failing));
  EXPECT_TRUE(MessagesOf(EventList(id), "job.cause").empty());
}

TEST_F(CoordinatorTest, AnEarlierExitReportedLaterBecomesTheRootCause) {
  const std::string id = RunningJobOnTwoWorkers();
  const std::string w0 = WorkerOf(id, 0);
  const std::string w1 = WorkerOf(id, 1);
  const absl::Time first = clock_.WallNow();
  clock_.Advance(milliseconds(50));
  // Rank 0's exit (a consequence) reaches the coordinator first.
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, w0, 0, clock_.WallNow())).ok());
  // Rank 1, stopped by order, says nothing of the cause.
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, w1, 1, first, /*stopped_by_order=*/true)).ok());
  EXPECT_THAT(Get(id).message(), HasSubstr("rank 0 on worker " + w0));
  // Rank 1 failed on its own, earlier.
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, w1, 1, first)).ok());
  EXPECT_THAT(Get(id).message(), HasSubstr("rank 1 on worker " + w1 + " exited with code 1"));
  EXPECT_THAT(MessagesOf(EventList(id), "job.cause"),
              testing::ElementsAre(HasSubstr("root cause of generation 1's failure: "
                                             "rank 1 on worker " +
                                             w1)));
  // A later failure does not replace it.
  ASSERT_TRUE(c().ReportTrainerExit(ExitAt(id, w0, 0, first + absl::Seconds(1))).ok());
  EXPECT_EQ(MessagesOf(EventList(id), "job.cause").size(), 1u);
}

}  // namespace
}  // namespace aidn::coordinator
