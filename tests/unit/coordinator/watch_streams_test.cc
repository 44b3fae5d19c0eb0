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
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::testing::Contains;
using ::testing::IsEmpty;
using v1::Job;

// --- Coordinator-level: watch streams -------------------------------------

TEST_F(CoordinatorTest, PollWatchSendsTheJobThenEventsAfterTheCursorThenFinishes) {
  const std::string id = Submit(Spec(2));  // no workers: submitted, waiting
  std::vector<v1::Event> events = EventList(id);
  ASSERT_GE(events.size(), 2u);
  ASSERT_EQ(events[0].type(), "job.submitted");

  v1::WatchJobRequest request;
  request.set_job_id(id);
  WatchCursor cursor;
  cursor.last_event_seq = events[0].seq();
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_GE(batch->items.size(), 2u);
  ASSERT_TRUE(batch->items[0].has_job());
  EXPECT_EQ(batch->items[0].job().state(), Job::PENDING);
  for (size_t i = 1; i < batch->items.size(); ++i) {
    ASSERT_TRUE(batch->items[i].has_event());
    EXPECT_GT(batch->items[i].event().seq(), events[0].seq());
  }
  EXPECT_EQ(batch->items[1].event().type(), "job.waiting");
  EXPECT_FALSE(batch->finished);

  // Nothing new: nothing sent, not finished.
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_THAT(batch->items, IsEmpty());
  EXPECT_FALSE(batch->finished);

  ASSERT_TRUE(c().CancelJob(id, "").ok());
  std::vector<v1::WatchJobResponse> after;
  bool finished = false;
  for (int polls = 0; polls < 10 && !finished; ++polls) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (auto& item : batch->items) after.push_back(item);
    finished = batch->finished;
  }
  ASSERT_TRUE(finished) << "the watch never finished";
  bool saw_cancelled_job = false;
  bool saw_cancelled_event = false;
  for (const v1::WatchJobResponse& item : after) {
    if (item.has_job() && item.job().state() == Job::CANCELLED) saw_cancelled_job = true;
    if (item.has_event() && item.event().type() == "job.cancelled") saw_cancelled_event = true;
  }
  EXPECT_TRUE(saw_cancelled_job);
  EXPECT_TRUE(saw_cancelled_event);
  // Once finished it stays finished with nothing more to send.
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(batch->finished);
  EXPECT_THAT(batch->items, IsEmpty());
}

TEST_F(CoordinatorTest, PollWatchReadsStoredStepsBackThenFollowsMemoryWithoutGapsOrRepeats) {
  options_.step_log.recent_steps = 4;
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 1, 10).ok());
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 10, 10, v1::MetricRecord::EVAL).ok());

  v1::WatchJobRequest request;
  request.set_job_id(id);
  request.set_include_metrics(true);
  request.set_from_step(3);
  WatchCursor cursor;
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(batch->items.front().has_job());
  using Steps = std::vector<std::pair<int64_t, int>>;
  const int kTrain = v1::MetricRecord::TRAIN, kEval = v1::MetricRecord::EVAL;
  Steps expected;
  for (int64_t k = 3; k <= 10; ++k) expected.emplace_back(k, kTrain);
  expected.emplace_back(10, kEval);
  EXPECT_EQ(StepItems(*batch), expected);

  // New steps come from memory, once each.
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 11, 12).ok());
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(StepItems(*batch), (Steps{{11, kTrain}, {12, kTrain}}));
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_THAT(StepItems(*batch), IsEmpty());

  // Ten steps while this watcher was away: more than the 4 memory holds,
  // so the rest is read back from the store.
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 13, 22).ok());
  Steps got;
  for (int i = 0; i < 3; ++i) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok());
    for (const auto& item : StepItems(*batch)) got.push_back(item);
  }
  Steps later;
  for (int64_t k = 13; k <= 22; ++k) later.emplace_back(k, kTrain);
  EXPECT_EQ(got, later);
  EXPECT_FALSE(batch->finished);

  // Once the job ended and everything was sent, the watch is finished.
  for (int rank : {0, 1}) ASSERT_TRUE(Exit(id, 1, rank, 0).ok());
  ASSERT_EQ(Get(id).state(), Job::SUCCEEDED);
  bool finished = false;
  for (int i = 0; i < 5 && !finished; ++i) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok());
    EXPECT_THAT(StepItems(*batch), IsEmpty());
    finished = batch->finished;
  }
  EXPECT_TRUE(finished);
}

TEST_F(CoordinatorTest, SubscribersAreNotifiedOutsideTheLockAndCanPull) {
  EXPECT_EQ(c().Subscribe("job-404", nullptr).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  PullingWatcher watcher(&c(), id);
  ASSERT_TRUE(c().Subscribe(id, &watcher).ok());
  RunJob(id);
  EXPECT_GT(watcher.notified(), 0);
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  c().Unsubscribe(id, &watcher);
  const int notified = watcher.notified();
  Submit(Spec(1));
  c().Tick();
  EXPECT_EQ(watcher.notified(), notified) << "notified after Unsubscribe";

  std::vector<Job::State> states;
  std::vector<std::string> types;
  for (const v1::WatchJobResponse& item : watcher.items()) {
    if (item.has_job()) states.push_back(item.job().state());
    if (item.has_event()) types.push_back(item.event().type());
  }
  ASSERT_FALSE(watcher.items().empty());
  EXPECT_TRUE(watcher.items()[0].has_job());
  EXPECT_THAT(states, Contains(Job::RUNNING));
  EXPECT_THAT(states, Contains(Job::CANCELLED));
  EXPECT_TRUE(InOrder(types, {"job.running", "job.cancelled"}));
}

}  // namespace
}  // namespace aidn::coordinator
