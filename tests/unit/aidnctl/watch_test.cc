// Tests of `aidnctl watch` against a fake coordinator that breaks its
// streams on cue: what each call asks for, that nothing is shown twice or
// missed across reconnections, and how the watch ends.

#include "aidnctl/watch.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/aidnctl/fake_job_coordinator.h"

namespace aidn::ctl {
namespace {

using ::testing::ElementsAre;
using testing::Eval;
using testing::FakeServer;
using ::testing::HasSubstr;
using testing::MakeEvent;
using ::testing::Not;
using testing::Train;

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// How many lines start with `prefix`.
int CountStartingWith(const std::vector<std::string>& lines, const std::string& prefix) {
  return static_cast<int>(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
    return absl::StartsWith(l, prefix);
  }));
}

WatchOptions FastOptions() {
  WatchOptions options;
  options.job_id = "job-1";
  options.progress_interval = std::chrono::milliseconds(0);  // every step
  options.initial_backoff = std::chrono::milliseconds(1);
  options.max_backoff = std::chrono::milliseconds(5);
  options.reconnect_timeout = std::chrono::seconds(20);
  return options;
}

// A 10-step job with an evaluation at steps 5 and 10 and three events.
void TenSteps(testing::FakeJobCoordinator* fake) {
  fake->events_ = {MakeEvent(1, "job.scheduled", "on w1"), MakeEvent(2, "job.running", "joined"),
                   MakeEvent(3, "checkpoint.committed", "step 5")};
  for (int step = 1; step <= 10; ++step) {
    fake->steps_.push_back(Train(step));
    if (step % 5 == 0) fake->steps_.push_back(Eval(step, 0.5 + step / 100.0));
  }
}

TEST(Watch, PrintsStateChangesEventsProgressAndEvaluationsOnce) {
  FakeServer server;
  TenSteps(&server.fake);
  server.Start();
  ASSERT_TRUE(RunWatch(server.env, FastOptions()).ok());
  const std::vector<std::string> lines = Lines(server.out.str());
  EXPECT_EQ(lines.front(), "job job-1 RUNNING");
  EXPECT_EQ(lines.back(), "job job-1 SUCCEEDED: all ranks finished");
  for (int step = 1; step <= 10; ++step) {
    EXPECT_EQ(CountStartingWith(lines, absl::StrCat("step ", step, "/10 ")), 1) << step;
  }
  EXPECT_EQ(CountStartingWith(lines, "eval at step 5 "), 1);
  EXPECT_EQ(CountStartingWith(lines, "eval at step 10 "), 1);
  EXPECT_EQ(CountStartingWith(lines, "2027-01-15T08:00:02Z  job.running  joined"), 1);
  EXPECT_THAT(server.out.str(), Not(HasSubstr("\x1b")));  // no escape sequences off a terminal
  const auto requests = server.fake.watch_requests();
  ASSERT_EQ(requests.size(), 1u);
  EXPECT_TRUE(requests[0].include_metrics());
  EXPECT_EQ(requests[0].from_step(), 0);
  EXPECT_EQ(requests[0].after_event_seq(), 0);
}

TEST(Watch, ResumesAfterABrokenStreamWithNothingMissedOrRepeated) {
  FakeServer server;
  TenSteps(&server.fake);
  // Items: job, 3 events, then steps 1..5, EVAL 5, 6..10, EVAL 10, job.
  // The first stream breaks after TRAIN 5 (before EVAL 5); the second after
  // its job and its first step; the third fails at once.
  server.fake.breaks_ = {9, 2, 0};
  server.Start();
  ASSERT_TRUE(RunWatch(server.env, FastOptions()).ok()) << server.out.str();

  const auto requests = server.fake.watch_requests();
  ASSERT_EQ(requests.size(), 4u);
  // Resume at the last step received, asked for again: its EVAL may be due.
  EXPECT_EQ(requests[1].from_step(), 5);
  EXPECT_EQ(requests[1].after_event_seq(), 3);
  // The second stream re-sent TRAIN 5 and then sent EVAL 5.
  EXPECT_EQ(requests[2].from_step(), 5);
  EXPECT_EQ(requests[3].from_step(), 5);
  EXPECT_EQ(requests[3].after_event_seq(), 3);

  const std::vector<std::string> lines = Lines(server.out.str());
  for (int step = 1; step <= 10; ++step) {
    EXPECT_EQ(CountStartingWith(lines, absl::StrCat("step ", step, "/10 ")), 1) << step;
  }
  EXPECT_EQ(CountStartingWith(lines, "eval at step 5 "), 1);
  EXPECT_EQ(CountStartingWith(lines, "eval at step 10 "), 1);
  EXPECT_EQ(CountStartingWith(lines, "2027-01-15T08:00:0"), 3);  // each event once
  EXPECT_EQ(CountStartingWith(lines, "job job-1 RUNNING"), 1);
  EXPECT_EQ(CountStartingWith(lines, "lost the coordinator at "), 2);
  EXPECT_EQ(CountStartingWith(lines, "reconnected to the coordinator at "), 2);
  EXPECT_THAT(server.out.str(), HasSubstr("(connection reset by peer); reconnecting..."));
  EXPECT_EQ(lines.back(), "job job-1 SUCCEEDED: all ranks finished");
}

TEST(Watch, AStepOfALaterGenerationIsNewEvenAtAStepSeenBefore) {
  FakeServer server;
  for (int step = 1; step <= 4; ++step) server.fake.steps_.push_back(Train(step));
  for (int step = 3; step <= 6; ++step) {
    server.fake.steps_.push_back(Train(step));
    server.fake.steps_.back().set_generation(2);
  }
  server.fake.running_.set_total_steps(6);
  server.fake.final_.set_total_steps(6);
  server.Start();
  ASSERT_TRUE(RunWatch(server.env, FastOptions()).ok());
  const std::vector<std::string> lines = Lines(server.out.str());
  EXPECT_EQ(CountStartingWith(lines, "step 3/6 "), 2);
  EXPECT_EQ(CountStartingWith(lines, "step 6/6 "), 1);
}

TEST(Watch, StartsAtTheStepAskedFor) {
  FakeServer server;
  TenSteps(&server.fake);
  server.Start();
  WatchOptions options = FastOptions();
  options.from_step = 8;
  ASSERT_TRUE(RunWatch(server.env, options).ok());
  EXPECT_EQ(server.fake.watch_requests()[0].from_step(), 8);
  const std::vector<std::string> lines = Lines(server.out.str());
  EXPECT_EQ(CountStartingWith(lines, "step 7/10 "), 0);
  EXPECT_EQ(CountStartingWith(lines, "step 8/10 "), 1);
}

TEST(Watch, ThrottledProgressStillEndsWithTheLastStep) {
  FakeServer server;
  TenSteps(&server.fake);
  server.Start();
  WatchOptions options = FastOptions();
  options.progress_interval = std::chrono::hours(1);
  ASSERT_TRUE(RunWatch(server.env, options).ok());
  const std::vector<std::string> lines = Lines(server.out.str());
  EXPECT_EQ(CountStartingWith(lines, "step "), 2);  // the first, and the last
  EXPECT_EQ(CountStartingWith(lines, "step 10/10 (100%)"), 1);
  // The last progress line comes before the line saying the job ended.
  ASSERT_GE(lines.size(), 2u);
  EXPECT_THAT(lines[lines.size() - 2], ::testing::StartsWith("step 10/10"));
}

TEST(Watch, AFailedJobIsAnErrorNamingItsMessage) {
  FakeServer server;
  server.fake.final_.set_state(v1::Job::FAILED);
  server.fake.final_.set_message("rank 1 exited with code 3");
  server.Start();
  const absl::Status status = RunWatch(server.env, FastOptions());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), "job job-1 FAILED: rank 1 exited with code 3");

  server.fake.final_.set_state(v1::Job::CANCELLED);
  server.fake.final_.set_message("by alice");
  EXPECT_EQ(RunWatch(server.env, FastOptions()).message(), "job job-1 CANCELLED: by alice");
}

TEST(Watch, AnUnknownJobFailsAtOnce) {
  FakeServer server;
  server.Start();
  WatchOptions options = FastOptions();
  options.job_id = "job-x";
  const absl::Status status = RunWatch(server.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "job job-x not found");
  EXPECT_EQ(server.fake.watch_requests().size(), 1u);
}

TEST(Watch, AFirstCallThatFailsIsNotRetried) {
  FakeServer server;
  server.fake.breaks_ = {0};
  server.Start();
  const absl::Status status = RunWatch(server.env, FastOptions());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()), HasSubstr("cannot reach coordinator at 127.0.0.1:"));
  EXPECT_EQ(server.fake.watch_requests().size(), 1u);
}

TEST(Watch, GivesUpAfterTheReconnectTimeout) {
  FakeServer server;
  TenSteps(&server.fake);
  server.fake.breaks_ = std::vector<int>(10000, 0);
  server.fake.breaks_[0] = 4;  // one good stream, then failures only
  server.Start();
  WatchOptions options = FastOptions();
  options.reconnect_timeout = std::chrono::milliseconds(300);
  const absl::Time start = absl::Now();
  const absl::Status status = RunWatch(server.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("gave up reconnecting to the coordinator at 127.0.0.1:"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("after 300ms: connection reset by peer"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_GE(server.fake.watch_requests().size(), 3u);
}

TEST(Watch, AStreamThatEndsBeforeTheJobIsCalledAgain) {
  FakeServer server;
  TenSteps(&server.fake);
  server.fake.breaks_ = {4};
  server.fake.break_code_ = grpc::StatusCode::OK;
  server.Start();
  ASSERT_TRUE(RunWatch(server.env, FastOptions()).ok());
  EXPECT_EQ(server.fake.watch_requests().size(), 2u);
  EXPECT_THAT(server.out.str(), HasSubstr("(the watch ended before the job did); reconnecting"));
}

TEST(Watch, AnotherErrorAfterTheStartEndsTheWatch) {
  FakeServer server;
  TenSteps(&server.fake);
  server.fake.breaks_ = {4};
  server.fake.break_code_ = grpc::StatusCode::PERMISSION_DENIED;
  server.Start();
  const absl::Status status = RunWatch(server.env, FastOptions());
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(server.fake.watch_requests().size(), 1u);
}

TEST(Watch, LiveRedrawsTheBlockInPlaceWithEventsAbove) {
  FakeServer server;
  TenSteps(&server.fake);
  server.fake.breaks_ = {6};
  server.Start();
  WatchOptions options = FastOptions();
  options.live = true;
  options.width = [] { return 100; };
  options.redraw_interval = std::chrono::milliseconds(0);
  ASSERT_TRUE(RunWatch(server.env, options).ok());
  const std::string out = server.out.str();
  // Each redraw after the first moves up over the 4-line block.
  EXPECT_THAT(out, HasSubstr("\r\x1b[4A\x1b[J"));
  EXPECT_THAT(out, HasSubstr("job.running  joined\n"));
  EXPECT_THAT(out, HasSubstr("reconnecting..."));
  EXPECT_THAT(out, HasSubstr("eval at step 10 (epoch 1)"));
  // The last frame is the finished job at 100%.
  const std::string last = out.substr(out.rfind("\x1b[J"));
  EXPECT_THAT(last, HasSubstr("job-1  SUCCEEDED"));
  EXPECT_THAT(last, HasSubstr("100%  step 10/10"));
  EXPECT_THAT(last, HasSubstr("test accuracy 60.00% (step 10)"));
  for (const std::string& line : Lines(last.substr(3))) EXPECT_LT(line.size(), 100u) << line;
}

TEST(TerminalWidth, IsEightyWithoutATerminal) { EXPECT_EQ(TerminalWidth(-1), 80); }

}  // namespace
}  // namespace aidn::ctl
