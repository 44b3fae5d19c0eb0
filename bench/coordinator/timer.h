#ifndef AIDN_BENCH_COORDINATOR_TIMER_H_
#define AIDN_BENCH_COORDINATOR_TIMER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <queue>
#include <thread>
#include <tuple>
#include <vector>

namespace aidn::bench {

// Runs functions at given times on one thread of its own. The functions only
// start asynchronous calls, so one thread paces all simulated processes.
// Thread-safe; functions given after Stop are dropped.
class Timer {
 public:
  using Clock = std::chrono::steady_clock;

  Timer() : thread_([this] { Loop(); }) {}
  ~Timer() { Stop(); }

  void At(Clock::time_point when, std::function<void()> fn);
  void After(std::chrono::milliseconds delay, std::function<void()> fn) {
    At(Clock::now() + delay, std::move(fn));
  }
  void Stop();

 private:
  struct Entry {
    Clock::time_point when;
    uint64_t seq;
    std::function<void()> fn;
    bool operator>(const Entry& other) const {
      return std::tie(when, seq) > std::tie(other.when, other.seq);
    }
  };

  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue_;
  uint64_t next_seq_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_TIMER_H_
