// Tests of what `aidnctl watch` draws: bars, ETAs, the live block, the plain
// lines and the redraw escape sequences.

#include "aidnctl/watch_view.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/aidnctl/fake_job_coordinator.h"

namespace aidn::ctl {
namespace {

using ::testing::AllOf;
using testing::Eval;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using testing::Train;

TEST(FormatEta, WritesSecondsMinutesHoursAndDays) {
  EXPECT_EQ(FormatEta(absl::ZeroDuration()), "0s");
  EXPECT_EQ(FormatEta(absl::Seconds(45.9)), "45s");
  EXPECT_EQ(FormatEta(absl::Seconds(65)), "1m05s");
  EXPECT_EQ(FormatEta(absl::Minutes(59) + absl::Seconds(59)), "59m59s");
  EXPECT_EQ(FormatEta(absl::Hours(1) + absl::Minutes(3) + absl::Seconds(30)), "1h03m");
  EXPECT_EQ(FormatEta(absl::Hours(52)), "2d04h");
  EXPECT_EQ(FormatEta(absl::Seconds(-5)), "0s");
  EXPECT_EQ(FormatEta(absl::InfiniteDuration()), "0s");
}

TEST(FormatSeconds, PicksAUnitThatKeepsThreeDigits) {
  EXPECT_EQ(FormatSeconds(0.00085), "850us");
  EXPECT_EQ(FormatSeconds(0.0121), "12.1ms");
  EXPECT_EQ(FormatSeconds(1.25), "1.25s");
  EXPECT_EQ(FormatSeconds(95), "95s");
  EXPECT_EQ(FormatSeconds(-1), "-");
}

TEST(ProgressBar, FillsItsExactWidthToTheFraction) {
  EXPECT_EQ(ProgressBar(0, 7), "[>    ]");
  EXPECT_EQ(ProgressBar(0.5, 12), "[=====>    ]");
  EXPECT_EQ(ProgressBar(1, 7), "[=====]");
  EXPECT_EQ(ProgressBar(1.7, 7), "[=====]");
  EXPECT_EQ(ProgressBar(-1, 7), "[>    ]");
  EXPECT_EQ(ProgressBar(std::nan(""), 7), "[>    ]");
  EXPECT_EQ(ProgressBar(0.5, 0), "[>]");
  for (int width = 3; width < 60; ++width) {
    for (double f = 0; f <= 1.0; f += 0.01) {
      ASSERT_EQ(ProgressBar(f, width).size(), static_cast<size_t>(width)) << f;
    }
  }
}

TEST(Throughput, MeasuresStepsAndSamplesPerSecondOverTheWindow) {
  Throughput throughput(absl::Seconds(20));
  EXPECT_FALSE(throughput.StepsPerSecond());
  throughput.Add(Train(1));
  EXPECT_FALSE(throughput.StepsPerSecond()) << "one step gives no rate";
  for (int step = 2; step <= 200; ++step) throughput.Add(Train(step));  // 2 steps/s
  ASSERT_TRUE(throughput.StepsPerSecond());
  EXPECT_DOUBLE_EQ(*throughput.StepsPerSecond(), 2.0);
  EXPECT_DOUBLE_EQ(*throughput.SamplesPerSecond(), 256.0);
  // Evaluations do not count.
  throughput.Add(Eval(200, 0.8));
  EXPECT_DOUBLE_EQ(*throughput.StepsPerSecond(), 2.0);
}

TEST(Throughput, FollowsARateThatChangesAndForgetsOldSteps) {
  Throughput throughput(absl::Seconds(10));
  v1::StepMetrics step = Train(1);
  double t = 0;
  for (int i = 1; i <= 100; ++i) {  // 10 steps/s
    step.set_step(i);
    *step.mutable_time() = testing::At(t += 0.1);
    throughput.Add(step);
  }
  for (int i = 101; i <= 200; ++i) {  // then 1 step/s, for 100 s
    step.set_step(i);
    *step.mutable_time() = testing::At(t += 1);
    throughput.Add(step);
  }
  EXPECT_NEAR(*throughput.StepsPerSecond(), 1.0, 1e-9);
}

TEST(Throughput, StartsOverOnANewGenerationOrAStepBackwards) {
  Throughput throughput;
  for (int step = 1; step <= 10; ++step) throughput.Add(Train(step));
  ASSERT_TRUE(throughput.StepsPerSecond());
  v1::StepMetrics restarted = Train(5);
  restarted.set_generation(2);
  throughput.Add(restarted);
  EXPECT_FALSE(throughput.StepsPerSecond());
  throughput.Add(Train(3));  // back to generation 1 and behind: over again
  EXPECT_FALSE(throughput.StepsPerSecond());
}

WatchView RunningView() {
  WatchView view;
  view.job.set_id("job-1f3a");
  view.job.set_state(v1::Job::RUNNING);
  view.job.set_generation(2);
  view.job.set_restarts(1);
  view.job.mutable_spec()->set_max_restarts(3);
  view.job.set_message("all 2 ranks joined");
  view.job.set_total_steps(1000);
  view.job.set_last_checkpoint_step(400);
  view.train = Train(480, 0.4312);
  view.train->set_epoch(1);
  view.train->set_step_seconds(0.04);
  view.train->set_allreduce_seconds(0.01);
  view.eval = Eval(469, 0.85314);
  view.steps_per_second = 8.0;
  view.samples_per_second = 5290;
  return view;
}

TEST(StatusBlock, ShowsProgressEtaLossThroughputAndCheckpoint) {
  const std::vector<std::string> lines = StatusBlock(RunningView(), 120);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "job-1f3a  RUNNING  gen 2  restarts 1/3  all 2 ranks joined");
  // 520 steps left at 8 steps/s: 65 s.
  EXPECT_THAT(lines[1], AllOf(StartsWith("[==================> "),
                              HasSubstr("]  48%  step 480/1000  epoch 1  ETA 1m05s")));
  EXPECT_EQ(lines[2],
            "loss 0.4312 | 5290 samples/s | slowest rank 1 40.0ms | allreduce 25% of step");
  EXPECT_EQ(lines[3], "checkpoint step 400 | test accuracy 85.31% (step 469) | 8.0 steps/s");
}

TEST(StatusBlock, KeepsEveryLineInsideTheTerminal) {
  WatchView view = RunningView();
  view.job.set_message(std::string(300, 'm') + " \xc3\xa9t\xc3\xa9");
  for (int width : {1, 20, 21, 33, 40, 57, 80, 132, 400}) {
    for (const std::string& line : StatusBlock(view, width)) {
      EXPECT_LT(static_cast<int>(line.size()), std::max(width, 20)) << width << ": " << line;
    }
  }
  // Narrow: the bar goes before the numbers do.
  EXPECT_THAT(StatusBlock(view, 40)[1], StartsWith("48%  step 480/1000"));
  EXPECT_THAT(StatusBlock(view, 80)[1], StartsWith("["));
}

TEST(StatusBlock, FallsBackToMaxStepsThenToAStepCount) {
  WatchView view = RunningView();
  view.job.set_total_steps(0);
  view.job.mutable_spec()->set_max_steps(960);
  EXPECT_THAT(StatusBlock(view, 120)[1], HasSubstr("50%  step 480/960"));
  view.job.mutable_spec()->set_max_steps(0);
  const std::string line = StatusBlock(view, 120)[1];
  EXPECT_EQ(line, "step 480  epoch 1");
}

TEST(StatusBlock, SaysWhatIsNotKnownYet) {
  WatchView view;
  view.job.set_id("job-2");
  view.job.set_state(v1::Job::PENDING);
  view.job.set_message("waiting for 2 cpu slots");
  view.job.mutable_spec()->set_max_steps(100);
  const std::vector<std::string> lines = StatusBlock(view, 80);
  EXPECT_EQ(lines[0], "job-2  PENDING  gen 0  restarts 0  waiting for 2 cpu slots");
  EXPECT_THAT(lines[1], AllOf(HasSubstr("0%  step 0/100"), Not(HasSubstr("ETA"))));
  EXPECT_EQ(lines[2], "no step metrics yet");
  EXPECT_EQ(lines[3], "no checkpoint yet | no evaluation yet");
}

TEST(StatusBlock, ShowsReconnectingInsteadOfTheMessage) {
  WatchView view = RunningView();
  view.reconnecting = "reconnecting...";
  EXPECT_EQ(StatusBlock(view, 120)[0], "job-1f3a  RUNNING  gen 2  restarts 1/3  reconnecting...");
}

TEST(EstimatedTimeLeft, NeedsARunningJobATotalAndARate) {
  WatchView view = RunningView();
  EXPECT_EQ(*EstimatedTimeLeft(view), absl::Seconds(65));
  view.steps_per_second.reset();
  EXPECT_FALSE(EstimatedTimeLeft(view));
  view = RunningView();
  view.job.set_state(v1::Job::RESTARTING);
  EXPECT_FALSE(EstimatedTimeLeft(view));
  view = RunningView();
  view.job.set_total_steps(0);
  EXPECT_FALSE(EstimatedTimeLeft(view));
}

TEST(PlainLines, ReadAsOneLineEach) {
  EXPECT_EQ(ProgressLine(RunningView()),
            "step 480/1000 (48%) | epoch 1 | loss 0.4312 | 5290 samples/s | step 40.0ms (slowest "
            "rank 1) | allreduce 25% | ETA 1m05s");
  WatchView waiting;
  waiting.job.set_last_step(7);
  EXPECT_EQ(ProgressLine(waiting), "step 7 | epoch 0");
  EXPECT_EQ(EvalLine(Eval(469, 0.85314)),
            "eval at step 469 (epoch 1) | test loss 0.4500 | test accuracy 85.31%");
  // A language model's evaluation is of its validation text: e^0.45 = 1.568.
  EXPECT_EQ(EvalLine(Eval(469, 0.85314), /*language_model=*/true),
            "eval at step 469 (epoch 1) | val loss 0.4500 | perplexity 1.568 | next-token "
            "accuracy 85.31%");
  // Steps that count tokens show tokens/s: 5290 samples/s of 256 tokens.
  WatchView lm = RunningView();
  lm.train->set_tokens(lm.train->samples() * 256);
  EXPECT_TRUE(absl::StrContains(ProgressLine(lm), "| 1354240 tokens/s |")) << ProgressLine(lm);
  v1::Event event = testing::MakeEvent(3, "job.running", "all 2\nranks joined");
  EXPECT_EQ(EventLine(event), "2027-01-15T08:00:03Z  job.running  all 2 ranks joined");
  v1::Job job;
  job.set_id("job-9");
  job.set_state(v1::Job::FAILED);
  job.set_message("rank 1 exited with code 3");
  EXPECT_EQ(JobStateLine(job), "job job-9 FAILED: rank 1 exited with code 3");
  job.clear_message();
  EXPECT_EQ(JobStateLine(job), "job job-9 FAILED");
}

TEST(RedrawFrame, ReplacesTheBlockAndPrintsNewLinesAboveIt) {
  EXPECT_EQ(RedrawFrame(0, {}, {"a", "b"}), "\r\x1b[Ja\nb\n");
  EXPECT_EQ(RedrawFrame(2, {"event"}, {"a", "b"}), "\r\x1b[2A\x1b[Jevent\na\nb\n");
}

}  // namespace
}  // namespace aidn::ctl
