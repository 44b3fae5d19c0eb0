#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
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
#include "coordinator/checkpoint_registry.h"
#include "coordinator/store.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;
using v1::Job;

// --- CheckpointRegistry alone ------------------------------------------------

class CheckpointRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ":memory:"});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    registry_ = std::make_unique<CheckpointRegistry>(store_.get(), &clock_);
    job_.set_id("job-1");
    job_.set_generation(1);
    *job_.mutable_spec() = Spec(2);
    job_.mutable_spec()->mutable_checkpoint()->set_keep_last(2);
  }

  // Both ranks of generation `generation` report the checkpoint at `step`;
  // the retired steps of the commit.
  std::vector<int64_t> CommitBoth(int64_t generation, int64_t step) {
    job_.set_generation(generation);
    std::vector<int64_t> retired;
    for (int rank = 0; rank < 2; ++rank) {
      absl::StatusOr<CommitOutcome> outcome = registry_->Commit(
          job_, &state_, Commit(job_.id(), generation, rank, step, {0, 1}), durable_);
      EXPECT_TRUE(outcome.ok()) << outcome.status();
      if (!outcome.ok() || !outcome->newly_committed) continue;
      retired = registry_->ApplyRetention(job_, &state_, &outcome->checkpoints);
    }
    return retired;
  }

  FakeClock clock_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<CheckpointRegistry> registry_;
  v1::Job job_;
  JobCheckpoints state_;
  // Whether metrics are durable: up to `durable_through_` of any generation.
  int64_t durable_through_ = 1'000'000;
  MetricsDurable durable_ = [this](int64_t step, int64_t) { return step <= durable_through_; };
};

TEST_F(CheckpointRegistryTest, CommitsOnceEveryWriterReportedAndLaterGenerationsResumeFromIt) {
  absl::StatusOr<CommitOutcome> first =
      registry_->Commit(job_, &state_, Commit("job-1", 1, 0, 100, {0, 1}), durable_);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->committed);
  absl::StatusOr<CommitOutcome> again =
      registry_->Commit(job_, &state_, Commit("job-1", 1, 0, 100, {0, 1}), durable_);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->committed);
  absl::StatusOr<CommitOutcome> last =
      registry_->Commit(job_, &state_, Commit("job-1", 1, 1, 100, {0, 1}), durable_);
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->committed);
  EXPECT_TRUE(last->newly_committed);
  ASSERT_EQ(last->checkpoints.size(), 1u);
  EXPECT_EQ(last->checkpoints[0].bytes(), 2000);

  // Generation 1 wrote it: it resumes nothing, generation 2 resumes it.
  v1::JoinRendezvousResponse same;
  registry_->FillResume(job_, &state_, &same);
  EXPECT_FALSE(same.has_resume_from());
  EXPECT_EQ(state_.resumed_from_step, -1);
  job_.set_generation(2);
  v1::JoinRendezvousResponse next;
  registry_->FillResume(job_, &state_, &next);
  EXPECT_EQ(next.resume_from().step(), 100);
  EXPECT_EQ(state_.resumed_from_step, 100);
}

TEST_F(CheckpointRegistryTest, CommitRefusesWritersOutOfRangeOrARankNotAmongThem) {
  EXPECT_EQ(registry_->Commit(job_, &state_, Commit("job-1", 1, 0, 100, {0, 2}), durable_)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      registry_->Commit(job_, &state_, Commit("job-1", 1, 1, 100, {0}), durable_).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckpointRegistry::ValidateCommit(Commit("job-1", 1, 0, -1, {0})).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointRegistryTest, RetentionKeepsKeepLastAndTheCheckpointBeingResumedFrom) {
  EXPECT_THAT(CommitBoth(1, 100), IsEmpty());
  EXPECT_THAT(CommitBoth(1, 200), IsEmpty());
  EXPECT_THAT(CommitBoth(1, 300), ElementsAre(100));
  job_.set_generation(2);
  v1::JoinRendezvousResponse join;
  registry_->FillResume(job_, &state_, &join);
  ASSERT_EQ(state_.resumed_from_step, 300);
  EXPECT_THAT(CommitBoth(2, 400), ElementsAre(200));
  // 300 is being resumed from: kept beyond keep_last.
  EXPECT_THAT(CommitBoth(2, 500), IsEmpty());
  EXPECT_THAT(CommitBoth(2, 600), ElementsAre(400));
}

TEST_F(CheckpointRegistryTest, AnInvalidCheckpointIsNotOfferedAndTheResumePointMovesBelowIt) {
  CommitBoth(1, 100);
  CommitBoth(1, 200);
  job_.set_generation(2);
  v1::JoinRendezvousResponse join;
  registry_->FillResume(job_, &state_, &join);
  ASSERT_EQ(state_.resumed_from_step, 200);
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id("job-1");
  bad.set_generation(2);
  bad.set_step(200);
  bad.set_reason("sha256 mismatch");
  absl::StatusOr<InvalidOutcome> outcome = registry_->MarkInvalid(job_, &state_, bad);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_FALSE(outcome->already);
  EXPECT_EQ(outcome->reason, "sha256 mismatch");
  EXPECT_EQ(outcome->newest_valid_step, 100);
  EXPECT_EQ(state_.resumed_from_step, 100);
  outcome = registry_->MarkInvalid(job_, &state_, bad);
  ASSERT_TRUE(outcome.ok());
  EXPECT_TRUE(outcome->already);
  bad.set_step(150);
  EXPECT_EQ(registry_->MarkInvalid(job_, &state_, bad).status().code(),
            absl::StatusCode::kNotFound);

  job_.set_generation(3);
  v1::JoinRendezvousResponse later;
  registry_->FillResume(job_, &state_, &later);
  ASSERT_EQ(later.resume_candidates_size(), 1);
  EXPECT_EQ(later.resume_from().step(), 100);
}

TEST_F(CheckpointRegistryTest, AWrittenCheckpointAwaitsItsMetricsAndIsNotOfferedUntilThen) {
  durable_through_ = 99;  // the metrics of step 100 are not in the store yet
  ASSERT_TRUE(registry_->Commit(job_, &state_, Commit("job-1", 1, 0, 100, {0, 1}), durable_).ok());
  absl::StatusOr<CommitOutcome> last =
      registry_->Commit(job_, &state_, Commit("job-1", 1, 1, 100, {0, 1}), durable_);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->written);
  EXPECT_FALSE(last->committed);
  EXPECT_THAT(state_.awaiting_metrics, ElementsAre(std::pair<const int64_t, int64_t>(100, 1)));
  job_.set_generation(2);
  v1::JoinRendezvousResponse early;
  registry_->FillResume(job_, &state_, &early);
  EXPECT_FALSE(early.has_resume_from());

  // Still not durable: nothing changes, and the store is not read.
  absl::StatusOr<AwaitedOutcome> none = registry_->CompleteAwaiting(job_, &state_, durable_);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->committed.empty());
  durable_through_ = 100;  // a flush stored them
  absl::StatusOr<AwaitedOutcome> done = registry_->CompleteAwaiting(job_, &state_, durable_);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->committed.size(), 1u);
  EXPECT_EQ(done->committed[0].step(), 100);
  EXPECT_TRUE(state_.awaiting_metrics.empty());
  v1::JoinRendezvousResponse later;
  registry_->FillResume(job_, &state_, &later);
  EXPECT_EQ(later.resume_from().step(), 100);

  // A registry over the same store (a restarted coordinator) finds nothing
  // awaiting once committed, and finds the written ones that were not.
  durable_through_ = 0;
  job_.set_generation(2);
  ASSERT_TRUE(registry_->Commit(job_, &state_, Commit("job-1", 2, 0, 200, {0}), durable_).ok());
  JobCheckpoints loaded;
  ASSERT_TRUE(registry_->LoadAwaiting(job_, &loaded).ok());
  EXPECT_THAT(loaded.awaiting_metrics, ElementsAre(std::pair<const int64_t, int64_t>(200, 2)));
}

// --- Coordinator-level: checkpoint registry -------------------------------------

// The last rank's clean exit stores the job's steps and commits the
// checkpoints that awaited them before the job counts as succeeded, so an
// export right after success gets the final weights.
TEST_F(CoordinatorTest, ASucceededJobsLastCheckpointIsCommittedWhenItSucceeds) {
  const std::string id = RunningJobOnTwoWorkers();
  for (int rank : {0, 1}) {
    absl::StatusOr<v1::CommitCheckpointResponse> r =
        c().CommitCheckpoint(Commit(id, 1, rank, 100, {0, 1}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->committed()) << "no metrics were sent yet";
  }
  // Every rank sends its records, then exits; no flush or tick in between.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 1, 100, 0.01).ok());
  EXPECT_EQ(Get(id).last_checkpoint_step(), 0);
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  EXPECT_NE(Get(id).state(), v1::Job::SUCCEEDED);
  ASSERT_TRUE(Exit(id, 1, 1, 0).ok());
  const v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED);
  EXPECT_EQ(job.last_checkpoint_step(), 100);
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_TRUE(list->checkpoints(0).committed());
}

TEST_F(CoordinatorTest, CheckpointCommitsOnceEveryWriterReportedAndIsResumedFrom) {
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<v1::CommitCheckpointResponse> r = CommitDurable(Commit(id, 1, 0, 100, {0, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->committed());
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_FALSE(list->checkpoints(0).committed());

  r = CommitDurable(Commit(id, 1, 1, 100, {0, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->committed());
  list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 1);
  const v1::Checkpoint& cp = list->checkpoints(0);
  EXPECT_TRUE(cp.committed());
  EXPECT_EQ(cp.step(), 100);
  EXPECT_EQ(cp.generation(), 1);
  EXPECT_EQ(cp.path(), "ckpt/step-100");
  EXPECT_THAT(cp.ranks_reported(), UnorderedElementsAre(0, 1));
  EXPECT_EQ(Get(id).last_checkpoint_step(), 100);
  EXPECT_THAT(Events(id), Contains("checkpoint.committed"));

  // A later checkpoint only half written is not resumed from.
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 200, {0, 1})).ok());

  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  ASSERT_EQ(Get(id).generation(), 2);
  PassBackoff(id);
  std::vector<JoinAnswer> answers = RunJob(id);
  for (const JoinAnswer& a : answers) {
    ASSERT_TRUE(a.get().ok());
    ASSERT_TRUE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_from().step(), 100);
    EXPECT_TRUE(a.get()->resume_from().committed());
  }
}

TEST_F(CoordinatorTest, CheckpointCommitValidatesItsRequest) {
  const std::string id = RunningJobOnTwoWorkers();
  EXPECT_EQ(CommitDurable(Commit(id, 1, 0, 10, {})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CommitDurable(Commit(id, 1, 1, 10, {0})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CommitDurable(Commit(id, 1, 0, 10, {0, 5})).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::CommitCheckpointRequest bad_path = Commit(id, 1, 0, 10, {0});
  bad_path.set_path("../escape");
  EXPECT_EQ(CommitDurable(bad_path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints_size(), 0);
  EXPECT_EQ(c().ListCheckpoints("job-404").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, ACheckpointReportedInvalidIsMarkedNamedInAnEventAndNotResumedFrom) {
  const std::string id = RunningJobOnTwoWorkers();
  for (int64_t step : {10, 20}) {
    absl::StatusOr<v1::CommitCheckpointResponse> r = CommitDurable(Commit(id, 1, 0, step, {0}));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->committed());
  }
  ASSERT_EQ(Get(id).last_checkpoint_step(), 20);
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  PassBackoff(id);
  std::vector<JoinAnswer> answers = RunJob(id);
  ASSERT_TRUE(answers[0].get().ok());
  ASSERT_EQ(answers[0].get()->resume_from().step(), 20);

  // Rank 0 of generation 2 finds step 20 truncated.
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(2);
  bad.set_rank(0);
  bad.set_step(20);
  bad.set_reason("model.safetensors: size 1024, manifest says 1086784");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_EQ(list->checkpoints(0).invalid_reason(), "");
  EXPECT_EQ(list->checkpoints(1).invalid_reason(),
            "model.safetensors: size 1024, manifest says 1086784");
  EXPECT_EQ(Get(id).last_checkpoint_step(), 10);
  std::vector<std::string> messages;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "checkpoint.invalid") messages.push_back(e.message());
  }
  EXPECT_THAT(messages, ElementsAre("step 20 (ckpt/step-20) failed verification on rank 0: "
                                    "model.safetensors: size 1024, manifest says 1086784"));

  // Rank 1 finds the same: nothing changes, no second event.
  bad.set_rank(1);
  bad.set_reason("manifest.json: missing");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints(1).invalid_reason(),
            "model.safetensors: size 1024, manifest says 1086784");
  int invalid_events = 0;
  for (const std::string& type : Events(id)) invalid_events += type == "checkpoint.invalid";
  EXPECT_EQ(invalid_events, 1);

  // Refusals: an unknown step, another generation, a rank out of range.
  bad.set_step(30);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kNotFound);
  bad.set_step(10);
  bad.set_generation(1);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad.set_generation(2);
  bad.set_rank(2);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints(0).invalid_reason(), "");

  // The next generation resumes from step 10 only.
  ASSERT_TRUE(Exit(id, 2, 0, 1).ok());
  PassBackoff(id);
  answers = RunJob(id);
  for (const JoinAnswer& a : answers) {
    ASSERT_TRUE(a.get().ok());
    EXPECT_EQ(a.get()->resume_from().step(), 10);
    ASSERT_EQ(a.get()->resume_candidates_size(), 1);
    EXPECT_EQ(a.get()->resume_candidates(0).step(), 10);
  }
}

TEST_F(CoordinatorTest, JoinOffersEveryValidCommittedCheckpointNewestFirst) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  // A fresh start has nothing to resume from.
  for (const JoinAnswer& a : RunJob(id)) {
    ASSERT_TRUE(a.get().ok());
    EXPECT_FALSE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_candidates_size(), 0);
  }
  for (int64_t step : {10, 20, 30}) {
    ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, step, {0, 1})).ok());
    ASSERT_TRUE(CommitDurable(Commit(id, 1, 1, step, {0, 1})).ok());
  }
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 40, {0, 1})).ok());  // half written
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(1);
  bad.set_rank(1);
  bad.set_step(30);
  bad.set_reason("optimizer.bin: crc32c 0x1234abcd, manifest says 0x1234abce");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  for (const JoinAnswer& a : RunJob(id)) {
    ASSERT_TRUE(a.get().ok());
    ASSERT_TRUE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_from().step(), 20);
    std::vector<int64_t> steps;
    const absl::StatusOr<v1::JoinRendezvousResponse> answer = a.get();
    for (const v1::Checkpoint& cp : answer->resume_candidates()) steps.push_back(cp.step());
    EXPECT_THAT(steps, ElementsAre(20, 10));
  }
}

TEST_F(CoordinatorTest, RetentionKeepsTheNewestKeepLastAndAnswersTheRetiredSteps) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_dir("ckpt");
  spec.mutable_checkpoint()->set_every_steps(10);
  spec.mutable_checkpoint()->set_keep_last(2);
  const std::string id = RunningJobOnTwoWorkers(spec);
  std::vector<std::vector<int64_t>> retired, held;
  for (int64_t step : {10, 20, 30, 40}) {
    // Rank 1's report completes each one: it is told what to delete.
    absl::StatusOr<v1::CommitCheckpointResponse> r = CommitDurable(Commit(id, 1, 0, step, {0, 1}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->retired_steps(), IsEmpty()) << "retired before the commit completed";
    held.emplace_back(r->held_steps().begin(), r->held_steps().end());
    r = CommitDurable(Commit(id, 1, 1, step, {0, 1}));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->committed());
    retired.emplace_back(r->retired_steps().begin(), r->retired_steps().end());
    EXPECT_THAT(r->held_steps(), IsEmpty()) << "only rank 0 is told what is held";
  }
  EXPECT_THAT(retired, ElementsAre(IsEmpty(), IsEmpty(), ElementsAre(10), ElementsAre(20)));
  // What the registry held after each of rank 0's reports: rank 0 deletes
  // any other directory below the step (a retirement whose answer was lost).
  EXPECT_THAT(held, ElementsAre(ElementsAre(10), ElementsAre(10, 20), ElementsAre(10, 20, 30),
                                ElementsAre(20, 30, 40)));
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  std::vector<int64_t> kept;
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(30, 40));
  EXPECT_EQ(Get(id).last_checkpoint_step(), 40);
  // A commit reported again retires nothing more.
  absl::StatusOr<v1::CommitCheckpointResponse> again = CommitDurable(Commit(id, 1, 1, 40, {0, 1}));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->committed());
  EXPECT_THAT(again->retired_steps(), IsEmpty());
}

TEST_F(CoordinatorTest, RetentionNeverRetiresTheCheckpointBeingResumedFrom) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_keep_last(1);
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 10, {0})).ok());
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  RunJob(id);  // generation 2 resumes from step 10
  absl::StatusOr<v1::CommitCheckpointResponse> r = CommitDurable(Commit(id, 2, 0, 20, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), IsEmpty()) << "retired the checkpoint being resumed from";
  r = CommitDurable(Commit(id, 2, 0, 30, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(20));
  // Generation 3 resumes from 30; 10 goes with the next commit.
  ASSERT_TRUE(Exit(id, 2, 1, 1).ok());
  PassBackoff(id);
  RunJob(id);
  r = CommitDurable(Commit(id, 3, 0, 40, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(10));
  std::vector<int64_t> kept;
  const absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(30, 40));
}

TEST_F(CoordinatorTest, RetentionDropsInvalidAndAbandonedCheckpointsBehindTheNewestValidOne) {
  const std::string id = RunningJobOnTwoWorkers();  // keep_last 3
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 10, {0})).ok());
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 20, {0})).ok());
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 25, {0, 1})).ok());  // never completed
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  RunJob(id);
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(2);
  bad.set_rank(0);
  bad.set_step(20);
  bad.set_reason("model.safetensors: missing");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  // Generation 2 goes on from 10 and writes 15: the invalid 20 and the
  // abandoned 25 are newer, so they stay for now.
  absl::StatusOr<v1::CommitCheckpointResponse> r = CommitDurable(Commit(id, 2, 0, 15, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), IsEmpty());
  r = CommitDurable(Commit(id, 2, 0, 30, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(20, 25));
  std::vector<int64_t> kept;
  const absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(10, 15, 30));
}

TEST_F(CoordinatorTest, ACheckpointIsAResumePointOnlyOnceItsMetricsAreStored) {
  const std::string id = RunningJobOnTwoWorkers();
  // Rank 0's records of steps 1-10 came, rank 1's not yet (the steps wait
  // for it), and both writers reported the checkpoint at step 10.
  ASSERT_TRUE(SendSteps(id, 0, 1, 10).ok());
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 10, {0, 1})).ok());
  absl::StatusOr<v1::CommitCheckpointResponse> r =
      c().CommitCheckpoint(Commit(id, 1, 1, 10, {0, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->committed());
  c().Tick();
  EXPECT_EQ(Get(id).last_checkpoint_step(), 0);
  EXPECT_THAT(Events(id), Not(Contains("checkpoint.committed")));

  // Rank 1 fails before sending them: its steps are combined from rank 0's
  // records but not yet stored, and generation 2 starts from scratch rather
  // than from a step whose metrics would never be reported.
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  PassBackoff(id);
  std::vector<JoinAnswer> second = RunJob(id);
  ASSERT_TRUE(second[0].get().ok());
  EXPECT_FALSE(second[0].get()->has_resume_from());

  // Once stored, it commits and later generations resume from it.
  c().FlushSteps();
  c().Tick();
  EXPECT_EQ(Get(id).last_checkpoint_step(), 10);
  EXPECT_THAT(Events(id), Contains("checkpoint.committed"));
  ASSERT_TRUE(Exit(id, 2, 0, 1).ok());
  PassBackoff(id);
  std::vector<JoinAnswer> third = RunJob(id);
  ASSERT_TRUE(third[0].get().ok());
  EXPECT_EQ(third[0].get()->resume_from().step(), 10);
}

TEST_F(CoordinatorTest, StepsRetiredByADelayedCommitAreAnsweredToTheNextCommitCall) {
  v1::JobSpec spec = Spec(1);
  spec.mutable_checkpoint()->set_keep_last(1);
  ASSERT_TRUE(Register("w1", 1).ok());
  const std::string id = Submit(spec);
  RunJob(id);
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 5, {0})).ok());
  // Reported before its records came.
  absl::StatusOr<v1::CommitCheckpointResponse> r = c().CommitCheckpoint(Commit(id, 1, 0, 10, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->committed());
  EXPECT_THAT(r->retired_steps(), IsEmpty());
  ASSERT_TRUE(SendSteps(id, 0, 6, 10).ok());
  c().FlushSteps();
  c().Tick();  // commits step 10, retiring step 5
  EXPECT_EQ(Get(id).last_checkpoint_step(), 10);
  absl::StatusOr<v1::ListCheckpointsResponse> listed = c().ListCheckpoints(id);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->checkpoints_size(), 1);
  EXPECT_EQ(listed->checkpoints(0).step(), 10);
  // The rank learns of it with its next commit, once.
  ASSERT_TRUE(SendSteps(id, 0, 11, 15).ok());
  r = c().CommitCheckpoint(Commit(id, 1, 0, 15, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  // Step 5 retired by the tick's commit, step 10 by this one's.
  EXPECT_THAT(r->retired_steps(), ElementsAre(5, 10));
  r = c().CommitCheckpoint(Commit(id, 1, 0, 15, {0}));
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->retired_steps(), IsEmpty());
}

TEST_F(CoordinatorTest, AGenerationThatResumesFromACheckpointSaysSoInAnEvent) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 10, {0})).ok());
  EXPECT_THAT(Events(id), Not(Contains("job.resumed")));  // generation 1 started afresh
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  PassBackoff(id);
  RunJob(id);
  const std::vector<v1::Event> events = EventList(id);
  const auto resumed = std::find_if(events.begin(), events.end(),
                                    [](const v1::Event& e) { return e.type() == "job.resumed"; });
  ASSERT_NE(resumed, events.end());
  EXPECT_EQ(resumed->message(), "resumed from step 10, checkpoint ckpt/step-10");
  EXPECT_EQ(resumed->generation(), 2);
  EXPECT_TRUE(InOrder(Events(id), {"job.running", "job.resumed"}));
}

TEST_F(CoordinatorTest, ACommitWhoseRecordsCameFirstStoresThemAndCommitsInTheCall) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_keep_last(1);
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(CommitDurable(Commit(id, 1, 0, 5, {0})).ok());
  ASSERT_TRUE(SendSteps(id, 0, 6, 10).ok());
  ASSERT_TRUE(SendSteps(id, 1, 6, 10).ok());
  // Combined in memory, not stored: the call stores them, then commits.
  absl::StatusOr<v1::CommitCheckpointResponse> r = c().CommitCheckpoint(Commit(id, 1, 0, 10, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->committed());
  EXPECT_THAT(r->retired_steps(), ElementsAre(5));
  EXPECT_EQ(Get(id).last_checkpoint_step(), 10);
  absl::StatusOr<v1::StreamMetricsResponse> receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok());
  EXPECT_EQ(receipt->durable_step(), 10);
}

}  // namespace
}  // namespace aidn::coordinator
