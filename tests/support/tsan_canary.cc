// Proves scripts/tsan.sh's ThreadSanitizer pass can fail and sees Abseil's
// mutexes: "race" increments a counter from two threads without a lock (TSan
// must report it), "mutex" does the same under an absl::Mutex, through
// FakeClock (whose Advance was the first false report without an
// instrumented Abseil; TSan must stay quiet).
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"

int main(int argc, char** argv) {
  const bool locked = argc > 1 && std::strcmp(argv[1], "mutex") == 0;
  absl::Mutex mu;
  aidn::FakeClock clock;
  long counter = 0;
  auto work = [&] {
    for (int i = 0; i < 1000; ++i) {
      if (locked) {
        clock.Advance(std::chrono::milliseconds(1));
        absl::MutexLock lock(&mu);
        ++counter;
      } else {
        ++counter;
      }
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  std::printf("%ld\n", counter);
  return 0;
}
