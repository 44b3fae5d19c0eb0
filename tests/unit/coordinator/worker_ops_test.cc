// Operating workers: cordon, drain, uncordon and remove (the coordinator's
// side, with a fake clock and in-memory or file-backed SQLite).
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using v1::Job;

std::set<std::string> PlacedOn(const Job& job) {
  std::set<std::string> workers;
  for (const v1::RankPlacement& p : job.placement()) workers.insert(p.worker_id());
  return workers;
}

TEST_F(CoordinatorTest, ACordonedWorkerGetsNoNewRanksUntilUncordoned) {
  ASSERT_TRUE(Register("w1", 1).ok());
  absl::StatusOr<v1::Worker> cordoned =
      c().SetWorkerScheduling("w1", v1::Worker::CORDONED, "disk swap", "admin");
  ASSERT_TRUE(cordoned.ok()) << cordoned.status();
  EXPECT_EQ(cordoned->scheduling(), v1::Worker::CORDONED);
  EXPECT_EQ(cordoned->scheduling_reason(), "admin: disk swap");

  const std::string id = Submit(Spec(1));
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  EXPECT_THAT(Get(id).message(), HasSubstr("1 worker(s) cordoned"));
  const std::vector<v1::Event> events = EventList("");
  ASSERT_FALSE(events.empty());
  bool recorded = false;
  for (const v1::Event& e : events) {
    if (e.type() != "worker.cordoned") continue;
    recorded = true;
    EXPECT_EQ(e.worker_id(), "w1");
    EXPECT_EQ(e.message(), "cordoned by admin: disk swap");
  }
  EXPECT_TRUE(recorded);

  // The worker's daemon restarting does not undo it.
  ASSERT_TRUE(Register("w1", 1).ok());
  EXPECT_EQ(WorkerNamed("w1").scheduling(), v1::Worker::CORDONED);
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::PENDING);

  absl::StatusOr<v1::Worker> uncordoned =
      c().SetWorkerScheduling("w1", v1::Worker::SCHEDULABLE, "", "ops");
  ASSERT_TRUE(uncordoned.ok()) << uncordoned.status();
  EXPECT_EQ(uncordoned->scheduling_reason(), "");
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED) << Get(id).message();
  EXPECT_THAT(Events(""), Contains("worker.uncordoned"));
}

TEST_F(CoordinatorTest, SchedulingOfAnUnknownWorkerOrWithABadValueIsRefusedAndChangesNothing) {
  ASSERT_TRUE(Register("w1", 1).ok());
  const size_t events = EventList("").size();
  absl::StatusOr<v1::Worker> unknown =
      c().SetWorkerScheduling("w9", v1::Worker::CORDONED, "", "admin");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("w9"));
  absl::StatusOr<v1::Worker> bad =
      c().SetWorkerScheduling("w1", static_cast<v1::Worker::Scheduling>(7), "", "admin");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("scheduling"));
  absl::StatusOr<v1::Worker> long_reason =
      c().SetWorkerScheduling("w1", v1::Worker::CORDONED, std::string(2000, 'x'), "admin");
  EXPECT_EQ(long_reason.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(long_reason.status().message()), HasSubstr("reason"));
  EXPECT_EQ(WorkerNamed("w1").scheduling(), v1::Worker::SCHEDULABLE);
  EXPECT_EQ(EventList("").size(), events);
}

TEST_F(CoordinatorTest, ADrainedWorkersJobMovesAtItsNextCheckpointWithoutARestartCounted) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_dir("ckpt");
  spec.mutable_checkpoint()->set_every_steps(100);
  const std::string id = RunningJobOnTwoWorkers(spec);
  const std::string plain = Submit(Spec(1));  // no checkpoints; waits for room
  ASSERT_TRUE(Register("w3", 1).ok());
  ASSERT_EQ(Get(plain).state(), Job::SCHEDULED);
  ASSERT_EQ(WorkerOf(plain, 0), "w3");
  ASSERT_TRUE(Register("w4", 1).ok());  // the spare

  absl::StatusOr<v1::Worker> draining =
      c().SetWorkerScheduling("w1", v1::Worker::DRAINING, "kernel update", "admin");
  ASSERT_TRUE(draining.ok()) << draining.status();
  EXPECT_THAT(draining->job_ids(), ElementsAre(id));
  // Nothing moves before the next checkpoint.
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  EXPECT_EQ(Get(id).generation(), 1);

  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 100, {0, 1})).ok());
  EXPECT_EQ(Get(id).generation(), 1) << "moved before the checkpoint was committed";
  absl::StatusOr<v1::CommitCheckpointResponse> last = CommitDurable(Commit(id, 1, 1, 100, {0, 1}));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->committed());

  const Job moved = Get(id);
  EXPECT_EQ(moved.generation(), 2);
  EXPECT_EQ(moved.restarts(), 0);
  EXPECT_EQ(moved.last_checkpoint_step(), 100);
  EXPECT_EQ(moved.state(), Job::SCHEDULED) << moved.message();
  EXPECT_EQ(PlacedOn(moved), (std::set<std::string>{"w2", "w4"}));
  EXPECT_THAT(Events(id), Contains("job.moving"));
  // The old generation's trainer on w1 is told to stop.
  absl::StatusOr<v1::HeartbeatResponse> beat = Beat("w1");
  ASSERT_TRUE(beat.ok()) << beat.status();
  ASSERT_EQ(beat->stops_size(), 1);
  EXPECT_EQ(beat->stops(0).job_id(), id);
  EXPECT_EQ(beat->stops(0).generation(), 1);
  EXPECT_THAT(beat->assignments(), IsEmpty());
  EXPECT_THAT(WorkerNamed("w1").job_ids(), IsEmpty());

  // Draining a worker whose job takes no checkpoints says so; it stays.
  absl::StatusOr<v1::Worker> w3 = c().SetWorkerScheduling("w3", v1::Worker::DRAINING, "", "admin");
  ASSERT_TRUE(w3.ok()) << w3.status();
  EXPECT_THAT(EventList("").back().message(), HasSubstr("running to their end here: " + plain));
  EXPECT_THAT(WorkerNamed("w3").job_ids(), ElementsAre(plain));
}

TEST_F(CoordinatorTest, OnlyALostWorkerIsRemovedAndItStaysRemovedAcrossARestart) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  ASSERT_TRUE(c().SetWorkerScheduling("w2", v1::Worker::CORDONED, "", "admin").ok());

  absl::Status alive = c().RemoveWorker("w1", "admin");
  EXPECT_EQ(alive.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(alive.message()), HasSubstr("alive"));
  EXPECT_EQ(c().RemoveWorker("w9", "admin").code(), absl::StatusCode::kNotFound);

  // w1 falls silent; w2 keeps beating.
  clock_.Advance(kWorkerTimeout + milliseconds(1));
  ASSERT_TRUE(Beat("w2").ok());
  c().Tick();
  ASSERT_EQ(WorkerNamed("w1").state(), v1::Worker::LOST);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr("aidn_worker_up{worker_id=\"w1\"} 0\n"));
  EXPECT_THAT(c().registry()->Serialize(),
              HasSubstr("aidn_worker_scheduling{scheduling=\"cordoned\",worker_id=\"w2\"} 1\n"));
  ASSERT_TRUE(c().RemoveWorker("w1", "admin").ok());
  EXPECT_EQ(c().ListWorkers().workers_size(), 1);
  EXPECT_THAT(Events(""), Contains("worker.removed"));
  // Its series go with it.
  EXPECT_THAT(c().registry()->Serialize(), Not(HasSubstr("worker_id=\"w1\"")));

  Open(path);
  ASSERT_NE(coord_, nullptr);
  const v1::ListWorkersResponse after = c().ListWorkers();
  ASSERT_EQ(after.workers_size(), 1);
  EXPECT_EQ(after.workers(0).info().id(), "w2");
  EXPECT_EQ(after.workers(0).scheduling(), v1::Worker::CORDONED) << "cordon lost in the restart";
}

// A worker known only from the store (its node may have gone with the
// coordinator, as a Slurm allocation's do) gets no ranks until it is heard
// from.
TEST_F(CoordinatorTest, AfterARestartAWorkerGetsRanksOnlyOnceHeardFrom) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_TRUE(Register("w1", 1).ok());
  Open(path);
  const std::string id = Submit(Spec(1));
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  EXPECT_THAT(Get(id).message(), HasSubstr("1 worker(s) not heard from since the coordinator"));
  ASSERT_TRUE(Beat("w1").ok());
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED) << Get(id).message();
}

}  // namespace
}  // namespace aidn::coordinator
