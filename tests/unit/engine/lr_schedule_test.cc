#include "worker/engine/lr_schedule.h"

#include <cmath>
#include <numbers>

#include <gtest/gtest.h>

namespace aidn::engine {
namespace {

using Kind = LrScheduleConfig::Kind;

LrScheduleConfig Schedule(Kind kind, int64_t warmup = 0) {
  LrScheduleConfig c;
  c.kind = kind;
  c.warmup_steps = warmup;
  return c;
}

TEST(LearningRate, ConstantReturnsTheBaseRate) {
  const LrScheduleConfig c = Schedule(Kind::kConstant);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 0, 100), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 99, 100), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 1000, 100), 0.1);
}

TEST(LearningRate, WarmupRisesLinearlyFromBaseOverWarmupAndReachesBaseOnItsLastStep) {
  const LrScheduleConfig c = Schedule(Kind::kConstant, 4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 0, 100), 0.025);  // the first step trains
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 1, 100), 0.05);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 2, 100), 0.075);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 3, 100), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 4, 100), 0.1);
}

TEST(LearningRate, NegativeStepCountsAsTheFirst) {
  const LrScheduleConfig c = Schedule(Kind::kConstant, 4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, -3, 100), 0.025);
}

TEST(LearningRate, StepDecayMultipliesByGammaEveryStepSizeSteps) {
  LrScheduleConfig c = Schedule(Kind::kStep);
  c.step_size = 10;
  c.gamma = 0.1;
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 0, 100), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.1, 9, 100), 0.1);
  EXPECT_NEAR(LearningRate(c, 0.1, 10, 100), 0.01, 1e-15);
  EXPECT_NEAR(LearningRate(c, 0.1, 19, 100), 0.01, 1e-15);
  EXPECT_NEAR(LearningRate(c, 0.1, 25, 100), 0.001, 1e-15);
}

TEST(LearningRate, StepDecayCountsFromTheEndOfWarmup) {
  LrScheduleConfig c = Schedule(Kind::kStep, 5);
  c.step_size = 10;
  c.gamma = 0.5;
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.2, 0, 100), 0.04);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.2, 5, 100), 0.2);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.2, 14, 100), 0.2);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.2, 15, 100), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 0.2, 35, 100), 0.025);
}

TEST(LearningRate, CosineFallsFromBaseToMinOverTheStepsAfterWarmup) {
  LrScheduleConfig c = Schedule(Kind::kCosine, 10);
  c.min_lr = 0.001;
  const double base = 0.1;
  const int64_t total = 110;  // T = 100
  EXPECT_DOUBLE_EQ(LearningRate(c, base, 9, total), base);
  EXPECT_DOUBLE_EQ(LearningRate(c, base, 10, total), base);
  EXPECT_NEAR(LearningRate(c, base, 60, total), (base + 0.001) / 2, 1e-15);
  EXPECT_NEAR(LearningRate(c, base, 35, total),
              0.001 + (base - 0.001) * (1 + std::cos(std::numbers::pi / 4)) / 2, 1e-15);
  EXPECT_NEAR(LearningRate(c, base, 109, total),
              0.001 + (base - 0.001) * (1 + std::cos(std::numbers::pi * 99 / 100)) / 2, 1e-15);
  EXPECT_DOUBLE_EQ(LearningRate(c, base, 110, total), 0.001);
  EXPECT_DOUBLE_EQ(LearningRate(c, base, 500, total), 0.001);
  double previous = base;
  for (int64_t step = 10; step < 200; ++step) {
    const double lr = LearningRate(c, base, step, total);
    EXPECT_LE(lr, previous) << step;
    EXPECT_GE(lr, 0.001) << step;
    previous = lr;
  }
}

TEST(LearningRate, CosineWithoutStepsAfterWarmupGivesMinLr) {
  LrScheduleConfig c = Schedule(Kind::kCosine, 10);
  c.min_lr = 0.01;
  EXPECT_DOUBLE_EQ(LearningRate(c, 1.0, 9, 10), 1.0);  // warmup still applies
  EXPECT_DOUBLE_EQ(LearningRate(c, 1.0, 10, 10), 0.01);
  EXPECT_DOUBLE_EQ(LearningRate(c, 1.0, 12, 5), 0.01);
}

TEST(ValidateLrSchedule, RefusesNonsenseNamingTheField) {
  EXPECT_TRUE(ValidateLrSchedule(Schedule(Kind::kConstant)).ok());
  auto refused = [](const LrScheduleConfig& c, const char* field) {
    absl::Status s = ValidateLrSchedule(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
  };
  refused(Schedule(Kind::kConstant, -1), "warmup_steps");
  LrScheduleConfig step = Schedule(Kind::kStep);
  refused(step, "step_size");
  step.step_size = 3;
  EXPECT_TRUE(ValidateLrSchedule(step).ok());
  step.gamma = 1.5;
  refused(step, "gamma");
  LrScheduleConfig cosine = Schedule(Kind::kCosine);
  EXPECT_TRUE(ValidateLrSchedule(cosine).ok());
  cosine.min_lr = -0.1;
  refused(cosine, "min_lr");
}

}  // namespace
}  // namespace aidn::engine
