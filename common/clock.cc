#include "common/clock.h"

#include "absl/time/clock.h"

namespace aidn {
namespace {

class RealClock final : public Clock {
 public:
  TimePoint Now() override { return std::chrono::steady_clock::now(); }
  absl::Time WallNow() override { return absl::Now(); }
};

}  // namespace

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

// Starts at an arbitrary fixed point so tests are repeatable.
FakeClock::FakeClock()
    : now_(TimePoint(std::chrono::hours(1000))), wall_(absl::FromUnixSeconds(1'790'000'000)) {}

Clock::TimePoint FakeClock::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

absl::Time FakeClock::WallNow() {
  absl::MutexLock lock(&mu_);
  return wall_;
}

void FakeClock::Advance(std::chrono::milliseconds delta) {
  absl::MutexLock lock(&mu_);
  now_ += delta;
  wall_ += absl::FromChrono(delta);
}

}  // namespace aidn
