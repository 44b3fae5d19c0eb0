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
#include "coordinator/held_heartbeats.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using std::chrono::milliseconds;
using v1::Job;

// --- HeldHeartbeats alone ----------------------------------------------------

// Answers that name the worker and count the answers built.
struct CountingBuilder {
  int built = 0;
  HeldHeartbeats::Builder Get() {
    return [this](const std::string& worker_id) {
      ++built;
      v1::HeartbeatResponse response;
      response.add_assignments()->set_job_id(worker_id);
      return response;
    };
  }
};

TEST(HeldHeartbeats, AnswersOnlyTheCallsWhoseDeadlinePassed) {
  FakeClock clock;
  HeldHeartbeats held;
  CountingBuilder builder;
  Async<v1::HeartbeatResponse> early, late;
  held.Hold("w1", clock.Now() + milliseconds(100), early.Callback());
  held.Hold("w1", clock.Now() + milliseconds(200), late.Callback());
  EXPECT_FALSE(held.AnyDue(clock.Now()));
  clock.Advance(milliseconds(100));
  ASSERT_TRUE(held.AnyDue(clock.Now()));
  {
    Deferred deferred;
    held.AnswerDue(clock.Now(), builder.Get(), &deferred);
    EXPECT_FALSE(early.done());  // answered once the Deferred runs
  }
  EXPECT_TRUE(early.done());
  EXPECT_EQ(early.get()->assignments(0).job_id(), "w1");
  EXPECT_FALSE(late.done());
  EXPECT_EQ(held.held("w1"), 1u);
  EXPECT_EQ(builder.built, 1);
}

TEST(HeldHeartbeats, NextDeadlineIsTheEarliestHeld) {
  FakeClock clock;
  HeldHeartbeats held;
  CountingBuilder builder;
  EXPECT_FALSE(held.NextDeadline().has_value());
  Async<v1::HeartbeatResponse> a, b;
  held.Hold("w1", clock.Now() + milliseconds(300), a.Callback());
  held.Hold("w2", clock.Now() + milliseconds(100), b.Callback());
  EXPECT_EQ(held.NextDeadline(), clock.Now() + milliseconds(100));
  clock.Advance(milliseconds(100));
  {
    Deferred deferred;
    held.AnswerDue(clock.Now(), builder.Get(), &deferred);
  }
  EXPECT_TRUE(b.done());
  EXPECT_EQ(held.NextDeadline(), clock.Now() + milliseconds(200));
}

TEST(HeldHeartbeats, AnswerWorkerAnswersEveryCallOfThatWorkerOnly) {
  FakeClock clock;
  HeldHeartbeats held;
  CountingBuilder builder;
  Async<v1::HeartbeatResponse> a1, a2, b;
  held.Hold("a", clock.Now() + milliseconds(100), a1.Callback());
  held.Hold("a", clock.Now() + milliseconds(100), a2.Callback());
  held.Hold("b", clock.Now() + milliseconds(100), b.Callback());
  {
    Deferred deferred;
    held.AnswerWorker("a", builder.Get(), &deferred);
  }
  EXPECT_TRUE(a1.done());
  EXPECT_TRUE(a2.done());
  EXPECT_FALSE(b.done());
  EXPECT_EQ(held.held("a"), 0u);
  // The deadline queue still names "a": nothing is answered twice.
  clock.Advance(milliseconds(100));
  {
    Deferred deferred;
    held.AnswerDue(clock.Now(), builder.Get(), &deferred);
  }
  EXPECT_EQ(a1.calls(), 1);
  EXPECT_EQ(b.calls(), 1);
  EXPECT_EQ(builder.built, 3);
}

TEST(HeldHeartbeats, FailWorkerAndFailAllAnswerWithTheStatus) {
  FakeClock clock;
  HeldHeartbeats held;
  Async<v1::HeartbeatResponse> a, b;
  held.Hold("a", clock.Now() + milliseconds(100), a.Callback());
  held.Hold("b", clock.Now() + milliseconds(100), b.Callback());
  {
    Deferred deferred;
    held.FailWorker("a", absl::NotFoundError("lost"), &deferred);
  }
  EXPECT_EQ(a.get().status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(b.done());
  {
    Deferred deferred;
    held.FailAll(absl::UnavailableError("closing"), &deferred);
  }
  EXPECT_EQ(b.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(held.held("b"), 0u);
}

// --- Coordinator-level: held heartbeats -------------------------------------

TEST_F(CoordinatorTest, HeldHeartbeatIsAnsweredWhenAJobIsScheduledOntoTheWorker) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok()) << first.status();
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  EXPECT_FALSE(held.done());
  c().Tick();
  EXPECT_FALSE(held.done());

  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(held.done());
  ASSERT_TRUE(held.get().ok()) << held.get().status();
  ASSERT_EQ(held.get()->assignments_size(), 1);
  EXPECT_EQ(held.get()->assignments(0).job_id(), id);
  EXPECT_GT(held.get()->assignments_version(), first->assignments_version());
  EXPECT_EQ(held.calls(), 1);
}

TEST_F(CoordinatorTest, HeldHeartbeatIsAnsweredOnceMaxWaitHasPassed) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok()) << first.status();
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(held.done());
  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(held.done());
  ASSERT_TRUE(held.get().ok()) << held.get().status();
  EXPECT_EQ(held.get()->assignments_size(), 0);
  EXPECT_EQ(held.get()->assignments_version(), first->assignments_version());
  c().Tick();
  EXPECT_EQ(held.calls(), 1);
}

// The held-heartbeat thread sleeps until the earliest call is due; a call
// held while it sleeps longer wakes it. With a ticker that never ticks, only
// that thread can answer.
TEST_F(CoordinatorTest, HeldHeartbeatThreadWakesForACallDueBeforeItsNextLook) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok()) << first.status();
  // Due before the thread starts: answered in its first look, after which
  // it sleeps as long as it may (an hour).
  Async<v1::HeartbeatResponse> before =
      HeldBeat("w1", first->assignments_version(), milliseconds(100));
  clock_.Advance(milliseconds(100));
  c().StartTicker(std::chrono::hours(1));
  ASSERT_TRUE(before.WaitDone(absl::Seconds(30)));
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(200));
  clock_.Advance(milliseconds(300));
  ASSERT_TRUE(held.WaitDone(absl::Seconds(30)));
  ASSERT_TRUE(held.get().ok()) << held.get().status();
  EXPECT_EQ(held.get()->assignments_version(), first->assignments_version());
  c().StopTicker();
}

TEST_F(CoordinatorTest, HeldHeartbeatOfAWorkerAChangeDoesNotConcernStaysHeld) {
  // w2 has no slots: the job can only go to w1.
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 0).ok());
  absl::StatusOr<v1::HeartbeatResponse> first1 = Beat("w1");
  absl::StatusOr<v1::HeartbeatResponse> first2 = Beat("w2");
  ASSERT_TRUE(first1.ok()) << first1.status();
  ASSERT_TRUE(first2.ok()) << first2.status();
  Async<v1::HeartbeatResponse> held1 =
      HeldBeat("w1", first1->assignments_version(), milliseconds(1000));
  Async<v1::HeartbeatResponse> held2 =
      HeldBeat("w2", first2->assignments_version(), milliseconds(1000));

  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(held1.done());
  ASSERT_TRUE(held1.get().ok()) << held1.get().status();
  ASSERT_EQ(held1.get()->assignments_size(), 1);
  EXPECT_FALSE(held2.done()) << "w2 was woken by a job placed on w1";

  // At its deadline w2 is answered with the new version, and nothing for it.
  clock_.Advance(milliseconds(1100));
  c().Tick();
  ASSERT_TRUE(held2.done());
  ASSERT_TRUE(held2.get().ok()) << held2.get().status();
  EXPECT_EQ(held2.get()->assignments_size(), 0);
  EXPECT_EQ(held2.get()->assignments_version(), held1.get()->assignments_version());

  // Ending the job wakes w1 (its stop order), not w2.
  Async<v1::HeartbeatResponse> again1 =
      HeldBeat("w1", held1.get()->assignments_version(), milliseconds(1000));
  Async<v1::HeartbeatResponse> again2 =
      HeldBeat("w2", held2.get()->assignments_version(), milliseconds(1000));
  ASSERT_FALSE(again1.done());
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  ASSERT_TRUE(again1.done());
  ASSERT_TRUE(again1.get().ok()) << again1.get().status();
  EXPECT_EQ(again1.get()->stops_size(), 1);
  EXPECT_FALSE(again2.done()) << "w2 was woken by a job ending on w1";
  clock_.Advance(milliseconds(1100));
  c().Tick();
  EXPECT_TRUE(again2.done());
}

TEST_F(CoordinatorTest, HeartbeatWithAnOutdatedVersionIsAnsweredAtOnce) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok());
  Submit(Spec(1));
  Async<v1::HeartbeatResponse> r = HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  ASSERT_TRUE(r.done());
  ASSERT_TRUE(r.get().ok());
  EXPECT_EQ(r.get()->assignments_size(), 1);
}

}  // namespace
}  // namespace aidn::coordinator
