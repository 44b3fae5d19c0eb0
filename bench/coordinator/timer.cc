#include "bench/coordinator/timer.h"

#include <utility>

namespace aidn::bench {

void Timer::At(Clock::time_point when, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    queue_.push(Entry{when, next_seq_++, std::move(fn)});
  }
  cv_.notify_one();
}

void Timer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Timer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (queue_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const Clock::time_point when = queue_.top().when;
    if (Clock::now() < when) {
      cv_.wait_until(lock, when);
      continue;
    }
    std::function<void()> fn = std::move(const_cast<Entry&>(queue_.top()).fn);
    queue_.pop();
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace aidn::bench
