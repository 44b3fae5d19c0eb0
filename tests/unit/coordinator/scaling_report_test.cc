#include "coordinator/scaling_report.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::coordinator::scaling_report_test {
namespace {

// A TRAIN row whose record was made `at` seconds in.
v1::StepMetrics Train(int64_t generation, int64_t step, int64_t samples, double at,
                      int64_t tokens = 0) {
  v1::StepMetrics s;
  s.set_kind(v1::MetricRecord::TRAIN);
  s.set_generation(generation);
  s.set_step(step);
  s.set_samples(samples);
  s.set_step_seconds(0.1);
  s.set_tokens(tokens);
  s.mutable_time()->set_seconds(static_cast<int64_t>(at));
  s.mutable_time()->set_nanos(static_cast<int32_t>((at - static_cast<int64_t>(at)) * 1e9));
  return s;
}

TEST(ScalingReport, ThroughputIsWallTimeBetweenConsecutiveStepsButAfterEvaluations) {
  std::vector<v1::StepMetrics> steps = {
      Train(1, 1, 64, 100.0),  // warm-up: no interval before it
      Train(1, 2, 64, 100.5),      Train(1, 3, 64, 101.0),
      Train(1, 4, 64, 109.0),  // after the evaluation at step 3: left out
      Train(2, 3, 64, 200.0),  // the restart's first step
      Train(2, 4, 64, 201.0, 640),
  };
  v1::StepMetrics eval;
  eval.set_kind(v1::MetricRecord::EVAL);
  eval.set_generation(1);
  eval.set_step(3);
  steps.push_back(eval);
  const v1::Throughput t = SummarizeThroughput(steps, 2);
  EXPECT_EQ(t.steps(), 3);
  EXPECT_EQ(t.world_size(), 2);
  EXPECT_DOUBLE_EQ(t.samples_per_second(), 3 * 64 / 2.0);
  EXPECT_DOUBLE_EQ(t.tokens_per_second(), 640 / 2.0);
  // Without consecutive steps, the step times.
  const v1::Throughput one = SummarizeThroughput({Train(1, 1, 10, 5.0)}, 1);
  EXPECT_EQ(one.steps(), 1);
  EXPECT_DOUBLE_EQ(one.samples_per_second(), 100);
  EXPECT_EQ(SummarizeThroughput({}, 1).samples_per_second(), 0);
}

TEST(ScalingReport, TheKeyIgnoresWhatDoesNotChangeAStep) {
  v1::JobSpec a;
  a.mutable_model()->set_name("cnn");
  a.set_batch_size(64);
  a.set_world_size(1);
  a.set_max_steps(100);
  a.set_name("one");
  v1::JobSpec b = a;
  b.set_world_size(4);
  b.set_max_steps(5000);
  b.set_name("four");
  b.set_seed(9);
  (*b.mutable_labels())["team"] = "x";
  b.mutable_checkpoint()->set_every_steps(10);
  b.set_scaling_baseline("job-1");
  EXPECT_EQ(ScalingKey(a), ScalingKey(b));
  b.set_batch_size(32);
  EXPECT_NE(ScalingKey(a), ScalingKey(b));
  b = a;
  b.mutable_model()->set_name("mlp");
  EXPECT_NE(ScalingKey(a), ScalingKey(b));
}

TEST(ScalingReport, EfficiencyIsThroughputOverTheIdealMultipleOfTheBaselines) {
  v1::Job base;
  base.set_id("job-3");
  base.set_state(v1::Job::SUCCEEDED);
  base.mutable_throughput()->set_samples_per_second(1000);
  base.mutable_throughput()->set_world_size(1);
  base.mutable_throughput()->set_steps(50);
  v1::Throughput t;
  t.set_samples_per_second(1800);
  t.set_world_size(2);
  t.set_steps(99);
  CompareWithBaseline(base, &t);
  EXPECT_EQ(t.baseline_job(), "job-3");
  EXPECT_DOUBLE_EQ(t.scaling_efficiency(), 0.9);
  EXPECT_EQ(ThroughputLine(t),
            "1800.0 samples/s over 99 steps at 2 ranks; scaling efficiency 0.90 against job-3 "
            "(1 rank, 1000.0 samples/s)");

  v1::Job failed;
  failed.set_id("job-4");
  failed.set_state(v1::Job::FAILED);
  v1::Throughput u;
  u.set_samples_per_second(5);
  u.set_world_size(2);
  CompareWithBaseline(failed, &u);
  EXPECT_TRUE(u.baseline_job().empty());
  EXPECT_EQ(u.note(), "baseline job-4 has no throughput (FAILED)");
}

}  // namespace
}  // namespace aidn::coordinator::scaling_report_test
