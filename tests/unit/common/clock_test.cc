#include "common/clock.h"

#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace aidn {
namespace {

using std::chrono::milliseconds;

TEST(FakeClock, StandsStillUntilAdvanced) {
  FakeClock clock;
  Clock::TimePoint now = clock.Now();
  absl::Time wall = clock.WallNow();
  EXPECT_EQ(clock.Now(), now);
  EXPECT_EQ(clock.WallNow(), wall);
}

TEST(FakeClock, AdvanceMovesBothClocksByTheSameAmount) {
  FakeClock clock;
  Clock::TimePoint now = clock.Now();
  absl::Time wall = clock.WallNow();
  clock.Advance(milliseconds(1500));
  EXPECT_EQ(clock.Now() - now, milliseconds(1500));
  EXPECT_EQ(clock.WallNow() - wall, absl::Milliseconds(1500));
  clock.Advance(milliseconds(1));
  EXPECT_EQ(clock.Now() - now, milliseconds(1501));
  EXPECT_EQ(clock.WallNow() - wall, absl::Milliseconds(1501));
}

TEST(FakeClock, StartsAtTheSamePointEveryTime) {
  FakeClock a;
  FakeClock b;
  EXPECT_EQ(a.Now(), b.Now());
  EXPECT_EQ(a.WallNow(), b.WallNow());
  // A plausible wall time (after 2020), so formatted timestamps look real.
  EXPECT_GT(a.WallNow(), absl::FromUnixSeconds(1'577'836'800));
}

TEST(FakeClock, AdvancesConcurrentlyWithoutLosingTime) {
  FakeClock clock;
  Clock::TimePoint start = clock.Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&clock] {
      for (int i = 0; i < 1000; ++i) clock.Advance(milliseconds(1));
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(clock.Now() - start, milliseconds(4000));
}

TEST(RealClock, IsOneProcessWideInstance) {
  EXPECT_NE(Clock::Real(), nullptr);
  EXPECT_EQ(Clock::Real(), Clock::Real());
}

TEST(RealClock, NowNeverGoesBackwards) {
  Clock* clock = Clock::Real();
  Clock::TimePoint prev = clock->Now();
  for (int i = 0; i < 100000; ++i) {
    Clock::TimePoint now = clock->Now();
    ASSERT_GE(now, prev) << "at iteration " << i;
    prev = now;
  }
}

TEST(RealClock, NowMovesForward) {
  Clock* clock = Clock::Real();
  Clock::TimePoint start = clock->Now();
  // Poll with a deadline rather than sleeping a fixed time.
  Clock::TimePoint deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (clock->Now() == start && std::chrono::steady_clock::now() < deadline) {
  }
  EXPECT_GT(clock->Now(), start);
}

TEST(RealClock, WallNowIsTheSystemTime) {
  absl::Time before = absl::Now();
  absl::Time wall = Clock::Real()->WallNow();
  absl::Time after = absl::Now();
  EXPECT_LE(before, wall);
  EXPECT_LE(wall, after);
}

}  // namespace
}  // namespace aidn
