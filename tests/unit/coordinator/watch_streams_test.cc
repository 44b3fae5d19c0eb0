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
#include "coordinator/store.h"
#include "coordinator/watch_streams.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::testing::Contains;
using ::testing::IsEmpty;
using v1::Job;

// --- WatchStreams alone ------------------------------------------------------

class CountingSubscriber final : public WatchSubscriber {
 public:
  void Notify() override { ++notified; }
  int notified = 0;
};

TEST(WatchSubscribers, NotifyReachesOnlyTheJobsSubscribersUntilRemoved) {
  WatchSubscribers subscribers;
  CountingSubscriber a, b;
  subscribers.Add("job-1", &a);
  subscribers.Add("job-2", &b);
  subscribers.Notify("job-1");
  EXPECT_EQ(a.notified, 1);
  EXPECT_EQ(b.notified, 0);
  subscribers.Remove("job-1", &a);
  subscribers.Notify("job-1");
  EXPECT_EQ(a.notified, 1);
}

TEST(WatchStreams, PollMemorySendsTheJobPerVersionAndStepsAfterTheCursor) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ":memory:"});
  ASSERT_TRUE(store.ok()) << store.status();
  WatchStreams streams(store->get());
  FakeClock clock;
  StepLog steps(StepLogOptions{});
  steps.StartGeneration(1, 1);
  for (int64_t step = 1; step <= 3; ++step) {
    v1::MetricRecord r;
    r.set_kind(v1::MetricRecord::TRAIN);
    r.set_step(step);
    r.set_generation(1);
    ASSERT_TRUE(steps.Add(r, clock.Now()));
  }
  v1::Job job;
  job.set_id("job-1");
  v1::WatchJobRequest request;
  request.set_job_id("job-1");
  request.set_include_metrics(true);
  request.set_from_step(2);
  WatchCursor cursor;
  cursor.catching_up = false;

  WatchBatch batch;
  absl::StatusOr<bool> added = streams.PollMemory(request, job, 1, &steps, &cursor, &batch);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_TRUE(*added);
  ASSERT_EQ(batch.items.size(), 3u);
  EXPECT_TRUE(batch.items[0].has_job());
  EXPECT_EQ(batch.items[1].step().step(), 2);
  EXPECT_EQ(batch.items[2].step().step(), 3);
  EXPECT_EQ(cursor.metrics_seq, 3);

  // Nothing new: nothing sent.
  WatchBatch again;
  added = streams.PollMemory(request, job, 1, &steps, &cursor, &again);
  ASSERT_TRUE(added.ok());
  EXPECT_FALSE(*added);
  EXPECT_TRUE(again.items.empty());
}

TEST(WatchStreams, ReadStoredSendsTheStoredStepsFromTheCursorAndSaysWhenDone) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ":memory:"});
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<Store::JobStep> rows;
  for (int64_t step = 1; step <= 5; ++step) {
    v1::StepMetrics m;
    m.set_step(step);
    m.set_generation(1);
    rows.push_back({"job-1", m});
  }
  ASSERT_TRUE((*store)->PutSteps(rows).ok());
  WatchStreams streams(store->get());
  v1::WatchJobRequest request;
  request.set_job_id("job-1");
  WatchCursor cursor;
  cursor.next_step = 3;
  WatchBatch batch;
  absl::StatusOr<bool> done = streams.ReadStored(request, &cursor, &batch);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  ASSERT_EQ(batch.items.size(), 3u);
  EXPECT_EQ(batch.items[0].step().step(), 3);
  EXPECT_EQ(cursor.last_step_sent, 5);
}

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
