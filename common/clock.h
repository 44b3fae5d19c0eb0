#ifndef AIDN_COMMON_CLOCK_H_
#define AIDN_COMMON_CLOCK_H_

// Time as a seam: production code asks a Clock, tests hand in a FakeClock and
// advance it instead of sleeping.

#include <chrono>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace aidn {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  // Monotonic time, for timeouts and deadlines.
  virtual TimePoint Now() = 0;
  // Wall-clock time, for timestamps people read.
  virtual absl::Time WallNow() = 0;

  // The process-wide real clock. Thread-safe.
  static Clock* Real();
};

// Seconds on the steady clock since `start`, for the timings metrics report.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A clock that moves only when told. Thread-safe.
class FakeClock final : public Clock {
 public:
  FakeClock();
  TimePoint Now() override;
  absl::Time WallNow() override;
  void Advance(std::chrono::milliseconds delta);

 private:
  absl::Mutex mu_;
  TimePoint now_ ABSL_GUARDED_BY(mu_);
  absl::Time wall_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aidn

#endif  // AIDN_COMMON_CLOCK_H_
