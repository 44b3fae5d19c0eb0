// DynamicLossScaler: torch GradScaler's update rule, step by step.
#include "worker/engine/loss_scale.h"

#include <cmath>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

TEST(DynamicLossScaler, StartsAtTorchsDefaultAndBacksOffOnEveryOverflow) {
  absl::StatusOr<DynamicLossScaler> s = DynamicLossScaler::Create({});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->scale(), 65536.0);
  EXPECT_FALSE(s->Update(true)) << "an overflowing step is skipped";
  EXPECT_EQ(s->scale(), 32768.0);
  EXPECT_FALSE(s->Update(true));
  EXPECT_EQ(s->scale(), 16384.0);
  EXPECT_EQ(s->skipped_steps(), 2);
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), 16384.0);
  EXPECT_EQ(s->growth_tracker(), 1);
}

TEST(DynamicLossScaler, GrowsAfterAnIntervalOfCleanStepsAndAnOverflowRestartsTheCount) {
  absl::StatusOr<DynamicLossScaler> s =
      DynamicLossScaler::Create({.init_scale = 8, .growth_interval = 3});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->Update(false));
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), 8.0);
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), 16.0) << "the third clean step in a row doubles it";
  EXPECT_EQ(s->growth_tracker(), 0);
  EXPECT_TRUE(s->Update(false));
  EXPECT_TRUE(s->Update(false));
  EXPECT_FALSE(s->Update(true));
  EXPECT_EQ(s->scale(), 8.0);
  EXPECT_TRUE(s->Update(false));
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), 8.0) << "two clean steps since the overflow: not yet";
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), 16.0);
}

TEST(DynamicLossScaler, NeverGrowsToInfinity) {
  absl::StatusOr<DynamicLossScaler> s = DynamicLossScaler::Create(
      {.init_scale = std::numeric_limits<double>::max(), .growth_interval = 1});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->Update(false));
  EXPECT_EQ(s->scale(), std::numeric_limits<double>::max());
}

TEST(DynamicLossScaler, ARestoredScalerContinuesWhereTheCheckpointedOneStopped) {
  const LossScaleOptions options{.init_scale = 8, .growth_interval = 3};
  absl::StatusOr<DynamicLossScaler> first = DynamicLossScaler::Create(options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->Update(true));
  EXPECT_TRUE(first->Update(false));
  EXPECT_TRUE(first->Update(false));
  const LossScaleState saved = first->state();
  EXPECT_EQ(saved.scale, 4.0);
  EXPECT_EQ(saved.growth_tracker, 2);

  absl::StatusOr<DynamicLossScaler> resumed = DynamicLossScaler::Create(options);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE(resumed->Restore(saved).ok());
  // Both take the same next steps: the third clean step grows both.
  for (bool overflow : {false, false, true, false}) {
    EXPECT_EQ(first->Update(overflow), resumed->Update(overflow));
    EXPECT_EQ(first->scale(), resumed->scale());
    EXPECT_EQ(first->growth_tracker(), resumed->growth_tracker());
  }
  EXPECT_EQ(resumed->scale(), 4.0) << "grown to 8 then halved";
}

TEST(DynamicLossScaler, RefusesABadRestoredStateNamingTheFieldAndKeepsItsOwn) {
  absl::StatusOr<DynamicLossScaler> s =
      DynamicLossScaler::Create({.init_scale = 8, .growth_interval = 3});
  ASSERT_TRUE(s.ok()) << s.status();
  struct Case {
    LossScaleState state;
    const char* field;
  };
  const Case cases[] = {
      {{.scale = 0, .growth_tracker = 0}, "loss scale: must be"},
      {{.scale = -4, .growth_tracker = 0}, "loss scale: must be"},
      {{.scale = std::nan(""), .growth_tracker = 0}, "loss scale: must be"},
      {{.scale = INFINITY, .growth_tracker = 0}, "loss scale: must be"},
      {{.scale = 4, .growth_tracker = -1}, "growth_tracker"},
      {{.scale = 4, .growth_tracker = 3}, "growth_tracker"},
  };
  for (const Case& c : cases) {
    absl::Status status = s->Restore(c.state);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
    EXPECT_EQ(s->scale(), 8.0);
    EXPECT_EQ(s->growth_tracker(), 0);
  }
}

TEST(DynamicLossScaler, RefusesBadOptionsNamingTheField) {
  struct Case {
    LossScaleOptions options;
    const char* field;
  };
  const Case cases[] = {
      {{.init_scale = 0}, "init_scale"},
      {{.init_scale = std::nan("")}, "init_scale"},
      {{.init_scale = INFINITY}, "init_scale"},
      {{.growth_factor = 1}, "growth_factor"},
      {{.growth_factor = INFINITY}, "growth_factor"},
      {{.backoff_factor = 1}, "backoff_factor"},
      {{.backoff_factor = 0}, "backoff_factor"},
      {{.backoff_factor = std::nan("")}, "backoff_factor"},
      {{.growth_interval = 0}, "growth_interval"},
  };
  for (const Case& c : cases) {
    absl::Status s = DynamicLossScaler::Create(c.options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), HasSubstr(c.field));
  }
}

}  // namespace
}  // namespace aidn::engine
